"""A branch (docs/branch.md): a new run that starts at step K of a source run, from the source's checkpoint of step K,
so that arms which differ only in their norm from K on continue one shared function on the same batches.

- The weights: the source's, as they are for a branch of the source's own norm; for an uncentred norm of the centring
  x bias 2x2 (rmsnorm_bias, rmsnorm) of a LayerNorm source, converted exactly (model/conversion.py, normlab-convert's
  code); with branch.zero_mean_writers, the LayerNorm weights unchanged in an RMSNorm model whose every write into the
  residual stream is centred by forward hooks (centre_writes, here: the model itself knows nothing of it): it
  computes, and its gradients follow, what the LayerNorm model does. The branch's checkpoint of step K computes the
  source's function of step K.
- The rest of the state continues from step K: the data position and the loops' progress (from the source's
  checkpoint, which holds them even when it holds the weights only), the schedule (the lr of step K on: the same
  max_steps and schedule are required), the random generators where the source's checkpoint holds them.
- A tied source's head: the conversion centres the embeddings, which a tied head would read too, so a converted arm
  (and the control, to stay alike) unties it: model.tie_embeddings=false, in every arm alike, each starting its head
  from the source's shared matrix (the one setting of the model a branch may change: from tied to untied).
- The optimizer, for every arm alike: with branch.moments=fresh, a new AdamW (the source's moments are of the
  unconverted parameters and would not map onto converted ones, so no arm keeps them; the LayerNorm branch restarts
  too: what that restart costs is its difference from the source continuing); with branch.moments=kept, the source's
  AdamW state of step K for every parameter the conversion leaves unchanged (blocks' attention and MLP inputs, norms,
  the head), and new moments only for those it changes (embeddings, output projections; a head untied at K, a
  parameter the source did not have), in the converted arm and in the arms that keep their weights alike, so that the
  restart is the same in every arm and smaller.

`start_checkpoint` builds that first checkpoint; the run directory writes it as the branch's step-K and last
checkpoint (RunDirectory.prepare), from which the branch resumes as any run does: resume, SIGTERM, requeue and
sweeps need nothing more.
"""

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from normlab.common.errors import ConfigError
from normlab.common.moved import current_config
from normlab.common.run_identity import RUN_FILES, run_files, run_id
from normlab.model import norms
from normlab.model.conversion import ConvertError, centred_weights, changed_by_centring, check_convertible
from normlab.training.rundir.checkpoints import LAST, PREVIOUS, read_verified, recorded_step
from normlab.training.rundir.config import CONFIG_FILE, flat
from normlab.training.rundir.files import RunDirError

# What a branch must share with its source (beyond them it may differ in its norm, its optimizer's settings, its
# checkpoint schedule, probes and names): the model, the data and their order, the batch and the schedule
SHARED = ("model.", "data.", "seed", "global_batch_size", "trainer.max_steps", "schedule.")
NOT_SHARED = ("data.dir", "data.num_workers", "data.verify_checksums")  # where the data lies, how fast it is read
MOMENTS = ("fresh", "kept")  # branch.moments: every arm's AdamW new, or the source's kept where weights are unchanged
TIED = "model.tie_embeddings"  # a branch may untie a tied source's head (true -> false), and change the model no more
HEAD = "lm_head.weight"  # a tied model's parameters name the shared matrix once, as the embedding


@dataclass
class Source:
    """A branch's source: its run directory (absolute), its run id, and its checkpoint of the branch's step as it
    was read, once, and verified (rundir.checkpoints.read_verified)."""

    folder: Path
    run_id: str | None
    path: Path
    checkpoint: dict

    @property
    def config(self) -> dict:
        """The source's config as its checkpoint holds it: what the branch starts from, whatever config.yaml says."""
        return current_config(OmegaConf.to_container(OmegaConf.create(self.checkpoint["hyper_parameters"]["config"])))


def centred_output(module, args, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the module's output less its mean over the width (what it writes, with zero mean)."""
    return output - output.mean(-1, keepdim=True)


def centre_writes(model) -> None:
    """The control arm's model (branch.zero_mean_writers): every vector written into the residual stream of a normlab
    GPT centred in the forward, by hooks on the embeddings' sum (after its dropout) and on each block's attention and
    MLP; its weights and state dict unchanged."""
    for writer in (model.drop, *(m for block in model.blocks for m in (block.attn, block.mlp))):
        writer.register_forward_hook(centred_output)


def check_branch(cfg: DictConfig) -> Source | None:
    """branch.source and branch.step given together, the step a whole number from 1 to below trainer.max_steps, the
    source a run directory with an intact checkpoint of that step and the settings a branch shares with it; that
    checkpoint, read once and verified (None: not a branch). Before anything is written."""
    branch = cfg.get("branch") or {}
    source, step = branch.get("source"), branch.get("step")
    if source is None and step is None:
        if branch.get("zero_mean_writers"):
            raise ConfigError("branch.zero_mean_writers=true is the control arm of a branch: give branch.source and "
                              "branch.step too")
        return None
    if source is None or step is None:
        raise ConfigError("a branch needs both branch.source (a run directory) and branch.step (a step of its "
                          "checkpoints)")
    if branch.get("moments", "fresh") not in MOMENTS:
        raise ConfigError(f"branch.moments={branch.get('moments')}: give fresh (a new AdamW in every arm) or kept (the "
                          "source's AdamW moments of every parameter the conversion leaves unchanged, in every arm)")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 < step < cfg.trainer.max_steps:
        raise ConfigError(f"branch.step={step}: give a step of the source's checkpoints from 1 to below "
                          f"trainer.max_steps={cfg.trainer.max_steps}")
    folder = Path(str(source)).resolve()
    if not run_files(folder):
        raise ConfigError(f"branch.source={source} is not a run directory (it holds none of {', '.join(RUN_FILES)}): "
                          "give the directory of the run to branch from")
    path, checkpoint = source_checkpoint(folder, step, branch.get("moments") == "kept")
    found = Source(folder, run_id(str(folder)), path, checkpoint)
    check_shared(cfg, found)
    return found


def source_checkpoint(folder: Path, step: int, with_moments: bool = False) -> tuple[Path, dict]:
    """The source's checkpoint of `step` (a scheduled one before last.ckpt and previous.ckpt; `with_moments`: one
    that holds the optimizer's state), read once and verified: else one line naming the damaged one and what is wrong
    with it, or the steps it has."""
    checkpoints = folder / "checkpoints"
    candidates = [p for p in [*sorted(checkpoints.glob("step-*.ckpt")), checkpoints / LAST, checkpoints / PREVIOUS]
                  if p.is_file()]
    damaged, weights_only = [], []
    for path in (p for p in candidates if recorded_step(p) == step):
        try:
            record, checkpoint = read_verified(path)
        except RunDirError as e:
            damaged.append(str(e))
            continue
        if record.step != step or checkpoint.get("global_step") != step:
            damaged.append(f"{path} holds step {checkpoint.get('global_step')}, its digest file says {record.step}")
        elif with_moments and not checkpoint.get("optimizer_states"):
            weights_only.append(path.name)
        else:
            return path, checkpoint
    if weights_only and not damaged:
        raise ConfigError(f"branch.moments=kept: branch.source={folder}'s checkpoint of step {step:,} "
                          f"({', '.join(weights_only)}) holds the weights only, without the optimizer's moments: "
                          "branch a run trained with checkpoints.scheduled=full, or give branch.moments=fresh")
    recorded = {recorded_step(p) for p in candidates}
    steps = ", ".join(f"{s:,}" for s in sorted(s for s in recorded if s >= 0 and s != step))
    if damaged:
        raise ConfigError(f"branch.source={folder}: its checkpoint of step {step:,} cannot be read: {damaged[0]}; "
                          f"restore it, or give another of its steps as branch.step ({steps or 'it has none'})")
    raise ConfigError(f"branch.source={folder} has no checkpoint of step {step:,} (its steps: {steps or 'none'}): "
                      "give one of its steps as branch.step")


def check_shared(cfg: DictConfig, source: Source) -> None:
    """The settings a branch shares with its source (SHARED) equal those of the source's checkpoint, else one line
    naming the first that is not, where it comes from, and config.yaml's value where that file says otherwise."""
    mine, theirs = flat(OmegaConf.to_container(cfg, resolve=True)), flat(source.config)
    for key in sorted(mine.keys() | theirs.keys(), key=lambda k: (k.count("."), k)):  # seed before data.seed
        untied = key == TIED and theirs.get(key) is True and mine.get(key) is False
        differs = mine.get(key) != theirs.get(key) and not untied
        if key.startswith(SHARED) and not key.startswith(NOT_SHARED) and differs:
            written = saved_setting(source.folder, key)
            aside = (f" (its config.yaml says {json.dumps(written[1])}: the checkpoint is what a branch starts from)"
                     if written and written[1] != theirs.get(key) else "")
            raise ConfigError(f"{key}={json.dumps(mine.get(key))}, where branch.source={source.folder}'s checkpoint "
                              f"{source.path.name} has {json.dumps(theirs.get(key))}{aside}: a branch continues its "
                              "source, so only its norm (and its optimizer's settings) may differ: give the source's")


def saved_setting(folder: Path, key: str) -> tuple[bool, object] | None:
    """(True, value) of a dotted key in the run's config.yaml; None where the file cannot be read or has no such key."""
    try:
        written = flat(current_config(OmegaConf.to_container(OmegaConf.load(folder / CONFIG_FILE), resolve=True)))
    except Exception:  # noqa: BLE001 (missing, not YAML: the checkpoint's config is what counts)
        return None
    return (True, written[key]) if key in written else None


def same_norm(cfg: DictConfig, source: dict) -> bool:
    settings = OmegaConf.to_container(cfg.norm, resolve=True)
    return all(settings.get(k) == source["norm"].get(k) for k in ("layer", "sites"))


def branch_weights(cfg: DictConfig, module, source: dict, weights: dict, folder: Path) -> dict:
    """The branch model's weights (without the `model.` prefix): the source's own, or converted (module docstring)."""
    zero_mean = bool(cfg.branch.zero_mean_writers)
    if same_norm(cfg, source) and not zero_mean:
        return weights
    mine = module.model.norm_layers()[0]
    what = f"branch.source={folder} (norm={source['norm'].get('name')})"
    with torch.device("meta"):
        layernorm = instantiate(source["norm"]["layer"], _partial_=True)(mine.weight.shape[0])
    try:
        check_convertible(layernorm, what)
    except ConvertError as e:
        raise ConfigError(f"{e}; a branch of another norm than its source's needs a LayerNorm source") from None
    traits = norms.traits(mine)
    if not (traits.centring_pair and not traits.centres) or not isinstance(mine, norms.RMSNorm):
        if zero_mean:
            raise ConfigError(f"branch.zero_mean_writers=true with norm={cfg.norm.name}: the control arm is an RMSNorm "
                              "model whose writers are centred (norm=rmsnorm_bias, or rmsnorm for a LayerNorm without "
                              "bias)")
        raise ConfigError(f"norm={cfg.norm.name}: a branch keeps its source's norm or converts its LayerNorms "
                          "exactly into RMSNorms (norm=rmsnorm_bias, or rmsnorm for a LayerNorm without bias)")
    if traits.bias != (layernorm.bias is not None) or mine.eps != layernorm.eps:
        raise ConfigError(f"norm={cfg.norm.name} (bias {traits.bias}, eps {mine.eps}) is not the exact RMSNorm of "
                          f"{what} (bias {layernorm.bias is not None}, eps {layernorm.eps}): give "
                          f"norm={norms.exact_rms_norm(layernorm.bias is not None)} with its eps")
    if source["model"].get("tie_embeddings") and cfg.model.tie_embeddings:
        raise ConfigError(f"{what} ties its LM head to its embeddings, which the conversion centres: give "
                          "model.tie_embeddings=false to every arm of the branch alike (each starts its head from the "
                          "source's matrix)")
    return weights if zero_mean else centred_weights(weights)


def fresh_optimizer_at(module, step: int) -> tuple[dict, dict, list[list[str]]]:
    """The state of a new optimizer and of its schedule after `step` optimizer steps (no moments, the lr of step K),
    and the names of its parameters, group by group, in the order of its state's indices."""
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    with warnings.catch_warnings():  # stepping the schedule alone, before any optimizer step, is the point here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step):
            scheduler.step()
    name_of = {id(p): name for name, p in module.model.named_parameters()}
    return (optimizer.state_dict(), scheduler.state_dict(),
            [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups])


def kept_moments(fresh: dict, names: list[list[str]], module, source: dict, what: str, untied: bool) -> dict:
    """`fresh` (an optimizer state dict whose indices are the parameters `names`, by group) with the source's AdamW
    state of every parameter that the conversion leaves unchanged, copied as it is; the parameters it changes start
    anew, as does a head the branch unties (`untied`: the source's optimizer has none). The source's optimizer orders
    the same parameters the same way, the head aside (one architecture, one configure_optimizers): its groups' sizes
    and each state's shapes are checked."""
    shapes = dict((name, p.shape) for name, p in module.model.named_parameters())
    theirs = [[n for n in group if not (untied and n == HEAD)] for group in names]
    groups = [len(g["params"]) for g in source["param_groups"]]
    if groups != [len(g) for g in theirs]:
        raise ConfigError(f"branch.moments=kept: {what}'s optimizer groups its parameters as {groups}, the branch "
                          f"as {[len(g) for g in theirs]}: give branch.moments=fresh")
    index_of = {name: index for index, name in enumerate(n for group in names for n in group)}
    source_names = [n for group in theirs for n in group]
    state = {}
    for index, moments in source["state"].items():
        name = source_names[index]
        if changed_by_centring(name):
            continue
        if any(torch.is_tensor(v) and v.dim() and v.shape != shapes[name] for v in moments.values()):
            raise ConfigError(f"branch.moments=kept: {what}'s optimizer state of {name} does not fit its shape "
                              f"{tuple(shapes[name])}: give branch.moments=fresh")
        state[index_of[name]] = moments
    return {**fresh, "state": state}


def start_checkpoint(cfg: DictConfig, module, source: Source) -> dict:
    """The branch's first checkpoint, of step branch.step: the source's checkpoint of that step (as check_branch read
    and verified it: its loops' progress, data position, step and epoch, random generators where it holds them) with
    the branch's weights, config and an optimizer at that step (fresh, or with the source's moments kept), and where it
    came from (the source's absolute directory and run id). `module`: the branch's LightningModule. Built before the
    run directory is written to."""
    step, checkpoint = cfg.branch.step, source.checkpoint
    what = f"branch.source={source.folder}"
    if cfg.model.dropout and "rng_states" not in checkpoint:
        raise ConfigError(f"{what}: its checkpoint of step {step:,} holds the weights only, without the random "
                          "generators that dropout draws from: branch a run trained with checkpoints.scheduled=full, "
                          "or without dropout")
    weights = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    module.model.load_state_dict(branch_weights(cfg, module, source.config, weights, source.folder))
    optimizer, scheduler, names = fresh_optimizer_at(module, step)
    if cfg.branch.get("moments") == "kept":
        untied = bool(source.config["model"].get("tie_embeddings")) and not cfg.model.tie_embeddings
        optimizer = kept_moments(optimizer, names, module, checkpoint["optimizer_states"][0], what, untied)
    kept = {k: checkpoint[k] for k in ("epoch", "global_step", "pytorch-lightning_version", "loops", "rng_states")
            if k in checkpoint}
    return {**kept, "state_dict": module.state_dict(), "optimizer_states": [optimizer], "lr_schedulers": [scheduler],
            "hparams_name": checkpoint.get("hparams_name"), "hyper_parameters": dict(module.hparams),
            "branched_from": {"source": str(source.folder), "run_id": source.run_id, "step": step,
                              "checkpoint": source.path.name}}
