"""normlab-ablate: a causal test of LayerNorm's mean subtraction.

LayerNorm(x) = (x - mean(x) 1) / rms(x - mean(x) 1) * gamma + beta. For a LayerNorm model the probe loss is measured
with its norms as trained and with the mean subtraction removed (x / rms(x) * gamma + beta, "uncentred"), at each norm
site alone and at all of them at once; for an RMSNorm model the converse: the input centred before the RMSNorm
("centred"), and for a DyT model (gamma * tanh(alpha x) + beta, no norm at all) likewise the input centred before
the tanh. The difference in loss (nats/token) is paired per probe window. The windows are drawn at random (seeded,
the same for every model) among all the non-overlapping windows of the probe split, and the 95% percentile bootstrap
interval of the mean delta resamples blocks of consecutive tokens of the split (the windows that start in one block
together): neighbouring windows of one text are correlated, so windows are not independent units. Beside the delta
stands what predicts it: the share of the squared norm of the norm's input along 1,
(x . 1)^2 / (d |x|^2), whose null for random directions is 1/d. A norm whose inputs are orthogonal to 1 gives a delta
of 0 whichever way it is ablated.

The ablation's null: the same operation at every norm at once along each of `null_directions` random unit directions u
in place of 1 (seeded: the same directions for every model of one width). For a norm that does not centre, its input
loses its component along u, x - (x . u) u, where the ablation along 1 removes x's mean (x - (x . 1/sqrt d) 1/sqrt d);
for a centring norm, its projection off 1 is replaced by the projection off u (the output is the uncentred norm of
x - (x . u) u), where the ablation along 1 removes the projection. The along-1 delta's percentile among the
directions' deltas says whether 1 is special to the model or any one direction would do as much.
"""

import math
import statistics
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from normlab.common import outputs
from normlab.data.corpus import draw_windows
from normlab.interop import pretrained
from normlab.model import norms
from normlab.probe.sites import NormSite, norm_sites
from normlab.probe.table import AnalysisError, run_identity
from normlab.study.angles import check_positive, default_name, normlab_probe, plan_hugging_face
from normlab.training import loader

NULL_COLUMNS = ("direction", "null_percentile")  # "1" or "random k"; the along-1 delta's percentile among them
CSV_COLUMNS = ("run", "model", "norm", "seed", "step", "source", "site", "layer", "role", "ablation", "direction",
               "windows", "tokens", "loss", "ablated_loss", "delta", "ci_low", "ci_high", "resampling_unit",
               "resampling_units", "share_along_1", "d", "null_percentile")
UNIT_COLUMNS = ("resampling_unit", "resampling_units")  # the interval's unit ("blocks of 4096 tokens") and count
BEFORE_NULL_COLUMNS = tuple(c for c in CSV_COLUMNS if c not in NULL_COLUMNS)  # ablation.csv before its null
EARLIER_COLUMNS = tuple(c for c in BEFORE_NULL_COLUMNS if c not in UNIT_COLUMNS)  # and before the unit was written
LEVEL = 0.95  # of the bootstrap interval
ALONG_1 = "1"  # the direction column of the ablation itself


def ablation(site: NormSite) -> str:
    """What is done to the norm at `site` (models.norms.traits): "uncentred", a centring norm's centring skipped; or
    "centred", the input of any other norm centred."""
    if not norms.traits(site.module).centres:
        return "centred"
    if not norms.can_skip_centring(site.module):
        raise AnalysisError(f"cannot ablate {site_name(site)}: {type(site.module).__name__} says it centres its input "
                            "but has no without_centring(x) giving its output without the centring: add that method")
    return "uncentred"


def site_name(site: NormSite) -> str:
    return f"layer{site.layer:02d}.{site.role}"


def uncentred(module: nn.Module, args, output):
    """Forward hook: the norm's output with its centring skipped (norms.without_centring)."""
    return norms.without_centring(module, args[0]).to(output.dtype)


def centring(module: nn.Module, args):
    """Forward pre-hook: the norm's input with its mean removed, x - mean(x) 1."""
    x, *rest = args
    with torch.autocast(x.device.type, enabled=False):
        centred = x.float() - x.float().mean(-1, keepdim=True)
    return (centred.to(x.dtype), *rest)


def off(x: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """x with its component along the unit vector `direction` removed, x - (x . u) u, in float32."""
    with torch.autocast(x.device.type, enabled=False):
        u = direction.to(x.device, torch.float32)
        x = x.float()
        return x - (x @ u)[..., None] * u


def ablate(stack: ExitStack, site: NormSite, kind: str, direction: torch.Tensor | None = None) -> None:
    """Ablate `site` (`kind`: its ablation) until `stack` closes: along 1, or the same operation along the unit
    vector `direction` (the null: a centring norm projects off it instead of off 1, another norm's input loses it)."""
    if direction is None:
        hook = uncentred if kind == "uncentred" else centring
    elif kind == "uncentred":
        def hook(module, args, output):
            return norms.without_centring(module, off(args[0], direction)).to(output.dtype)
    else:
        def hook(module, args):
            x, *rest = args
            return (off(x, direction).to(x.dtype), *rest)
    if kind == "uncentred":
        stack.enter_context(site.module.register_forward_hook(hook))
    else:
        stack.enter_context(site.module.register_forward_pre_hook(hook))


def random_directions(width: int, count: int, seed: int) -> torch.Tensor:
    """[count, width]: unit vectors uniform on the sphere, seeded (the same for every model of one width)."""
    u = torch.randn(count, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (u / u.norm(dim=1, keepdim=True)).float()


class ShareAlong1:
    """Forward pre-hooks that add up, per site, (x . 1)^2 / (d |x|^2) over the tokens of the norm's input."""

    def __init__(self, sites: list[NormSite]):
        self.sites, self.d = sites, None
        self.sums, self.counts = [0.0] * len(sites), [0] * len(sites)

    def hooks(self, stack: ExitStack) -> None:
        for i, site in enumerate(self.sites):
            stack.enter_context(site.module.register_forward_pre_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(module, args):
            x = args[0].detach().double()  # float64: x . 1 sums d values that may nearly cancel
            self.d = x.shape[-1]
            share = x.sum(-1) ** 2 / (self.d * x.pow(2).sum(-1)).clamp_min(1e-300)
            self.sums[i] = self.sums[i] + share.sum()  # a tensor on the model's device: no sync per call
            self.counts[i] += share.numel()

        return hook

    def shares(self) -> torch.Tensor:
        return torch.stack([torch.as_tensor(s).cpu() for s in self.sums]) / torch.tensor(self.counts)


def window_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B]: the mean next-token loss (nats) of each window, computed in float32."""
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)  # the last position has no next token: ignored (no logits copy)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100)
    return loss.view_as(targets)[:, :-1].double().mean(1)


# Tokens whose logits a normlab model's loss holds at once: 64 x 50,257 in float32 is 13 MB, under glibc's largest
# mmap threshold (32 MB), so malloc reuses the blocks at every forward instead of mapping them and page-faulting
# them in again (the whole B x T x vocab logits, hundreds of MB, cost more system time than the forward)
LOSS_CHUNK = 64


def losses_of(model: nn.Module, layout: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids [B, T] -> [B], each window's mean next-token loss: a normlab model's head in chunks of LOSS_CHUNK tokens,
    another model's logits whole."""
    if layout != "normlab":
        return lambda ids: window_losses(model(input_ids=ids).logits, ids)

    def losses(ids: torch.Tensor) -> torch.Tensor:
        hidden, targets = model(ids, head=False)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        per_token = [F.cross_entropy(model.lm_head(h).float(), t, reduction="none")
                     for h, t in zip(hidden.split(LOSS_CHUNK), targets.split(LOSS_CHUNK))]
        return torch.cat(per_token).view(len(ids), -1).double().mean(1)

    return losses


@torch.no_grad()
def measure(losses_of_windows: Callable, sites: list[NormSite], batches, progress=None,
            directions: torch.Tensor | None = None) -> tuple[torch.Tensor, ShareAlong1]:
    """Per window, the loss as trained and with each ablation in turn (each site alone, all at once, then all at once
    along each of `directions` [n, d] in place of 1): [1 + len(sites) + 1 + n, windows] float64; and the share along 1
    at each site, as trained."""
    kinds = [ablation(s) for s in sites]
    every = list(range(len(sites)))
    ablations = [([i], None) for i in every] + [(every, None)]
    ablations += [(every, u) for u in (directions if directions is not None else [])]
    share = ShareAlong1(sites)
    losses = [[] for _ in range(1 + len(ablations))]
    for ids in batches:
        with ExitStack() as stack:
            share.hooks(stack)
            losses[0].append(losses_of_windows(ids).cpu())
        for row, (ablated, direction) in zip(losses[1:], ablations):
            with ExitStack() as stack:
                for i in ablated:
                    ablate(stack, sites[i], kinds[i], direction)
                row.append(losses_of_windows(ids).cpu())
        if progress is not None:
            progress.update()
    return torch.stack([torch.cat(row) for row in losses]), share


def bootstrap_interval(deltas: torch.Tensor, resamples: int, seed: int,
                       units: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 95% percentile bootstrap interval of the mean of each row of `deltas` [rows, windows], resampling units:
    `units` [windows] names each window's unit (its block), None makes every window its own. Each resample draws as
    many units as there are, with replacement (seeded; the same resamples for every row), and takes the mean over
    the windows of the units drawn (a unit drawn twice counts twice; units may hold different numbers of windows)."""
    windows = deltas.shape[1]
    unit_of = torch.arange(windows) if units is None else torch.unique(units, return_inverse=True)[1]
    n = int(unit_of.max()) + 1
    sums = torch.zeros(deltas.shape[0], n, dtype=torch.float64).index_add_(1, unit_of, deltas.double())
    sizes = torch.zeros(n, dtype=torch.float64).index_add_(0, unit_of, torch.ones(windows, dtype=torch.float64))
    picks = torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))
    counts = torch.zeros(resamples, n, dtype=torch.float64).scatter_add_(
        1, picks, torch.ones(resamples, n, dtype=torch.float64)
    )
    means = counts @ sums.T / (counts @ sizes)[:, None]  # [resamples, rows]
    low, high = torch.quantile(means, torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64), dim=0)
    return low, high


def ablation_rows(model: nn.Module, layout: str, windows: torch.Tensor, batch_size: int = 8, resamples: int = 1000,
                  seed: int = 0, device: str = "cpu", desc: str | None = None, blocks: torch.Tensor | None = None,
                  unit: str = "windows", null_directions: int = 0) -> list[dict]:
    """The CSV rows of `model` (an architecture of probe.sites.LAYOUTS) on `windows` [n, seq_len], without the columns
    that name the model (run, model, norm, seed, step, source): each site, all at once, then the null (all at once
    along each of `null_directions` random directions, seeded by `seed`). The intervals resample `blocks` [n] (each
    window's block, named `unit` in the CSV), or each window alone when None."""
    sites = norm_sites(model, layout)
    kinds = {ablation(s) for s in sites}
    if len(kinds) > 1:
        raise AnalysisError("some norms of this model centre their input and some do not: ablate a model whose norms "
                            "all centre (LayerNorm) or none do")
    (kind,) = kinds
    model = model.to(device).eval()
    batches = [b.to(device) for b in windows.split(batch_size)]
    directions = (random_directions(input_width(model, layout, sites[0], windows[:1].to(device)), null_directions,
                                    seed) if null_directions else None)
    with tqdm(total=len(batches), desc=desc, unit="batch") as progress:
        losses, share = measure(losses_of(model, layout), sites, batches, progress, directions)
    deltas = losses[1:] - losses[0]
    low, high = bootstrap_interval(deltas, resamples, seed, blocks)
    n, seq_len = windows.shape
    units = n if blocks is None else len(torch.unique(blocks))
    names = [(site_name(s), s.layer, s.role) for s in sites] + [("all", "", "")]
    directions_named = [ALONG_1] * len(names) + [f"random {k}" for k in range(null_directions)]
    names += [("all", "", "")] * null_directions
    shares = share.shares()
    shares = torch.cat([shares, shares.mean()[None]])  # "all": the mean over sites
    everywhere = len(sites)  # the row of every site at once, along 1
    null = deltas[everywhere + 1:].mean(1)
    rows = [
        {"site": name, "layer": layer, "role": role, "ablation": kind, "direction": direction, "windows": n,
         "tokens": n * (seq_len - 1), "loss": losses[0].mean().item(), "ablated_loss": losses[1 + i].mean().item(),
         "delta": deltas[i].mean().item(), "ci_low": low[i].item(), "ci_high": high[i].item(),
         "resampling_unit": unit, "resampling_units": units,
         "share_along_1": shares[i].item() if direction == ALONG_1 else "", "d": share.d, "null_percentile": ""}
        for i, ((name, layer, role), direction) in enumerate(zip(names, directions_named))
    ]
    if null_directions:
        rows[everywhere]["null_percentile"] = percentile(rows[everywhere]["delta"], null.tolist())
    return rows


def percentile(value: float, null: list[float]) -> float:
    """The percent of `null` below `value` (ties count half), as the share's percentile among random directions."""
    below = sum(v < value for v in null) + 0.5 * sum(v == value for v in null)
    return 100 * below / len(null)


@torch.no_grad()
def input_width(model: nn.Module, layout: str, site: NormSite, ids: torch.Tensor) -> int:
    """The width of the norm's input at `site`, seen in one forward (whatever the norm's parameters)."""
    seen = []
    with site.module.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-1])):
        losses_of(model, layout)(ids)
    return seen[0]


# -- the command (conf/ablate.yaml)


@dataclass
class Subject:
    """A model_path, checked and ready to measure, with the columns that name it in the CSV."""

    layout: str  # a key of probe.sites.LAYOUTS
    load: Callable[[], nn.Module]
    windows: torch.Tensor  # the probe: [windows, seq_len] token ids, drawn across the split (drawn_probe)
    starts: torch.Tensor  # [windows]: where each begins in the probe split, in the model's tokens
    names: dict  # run, model, norm, seed, step, source
    out: Path  # where the CSV goes unless out= says otherwise
    warnings: list[str] = field(default_factory=list)


def whole_split(cfg: DictConfig) -> DictConfig:
    """`cfg` with probe.tokens=null: every window of the probe split, which drawn_probe draws from."""
    return OmegaConf.merge(cfg, {"probe": {"tokens": None}})


def drawn_probe(slots: torch.Tensor, tokens: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of every non-overlapping window of the probe split in order (`slots` [slots, seq_len]), the tokens // seq_len
    windows that draw_windows draws with `seed` (tokens None: all), and where each starts in the split."""
    seq_len = slots.shape[1]
    count = None if tokens is None else tokens // seq_len
    if count == 0:
        raise AnalysisError(f"probe.tokens={tokens} is less than one sequence of {seq_len} tokens: give at least "
                            f"{seq_len}, a smaller seq_len, or probe.tokens=null for the whole split")
    if count is not None and count > len(slots):
        raise AnalysisError(f"the probe split holds {len(slots):,} windows of {seq_len} tokens "
                            f"({len(slots) * seq_len:,} tokens), fewer than the {tokens:,} asked: lower probe.tokens, "
                            "or probe.tokens=null for all of them")
    chosen = draw_windows(len(slots), count, seed)
    return slots[chosen], chosen * seq_len


def plan_normlab(path: Path, cfg: DictConfig) -> Subject:
    checkpoint, step, warnings = loader.chosen(
        path, AnalysisError, "a .ckpt, a run directory or a Hugging Face model directory (with its config.json)")
    out = path / "ablation.csv" if path.is_dir() else Path(cfg.paths.output_dir) / "ablation" / default_name(path)
    config, slots = normlab_probe(checkpoint, path, whole_split(cfg))
    checkpoint = checkpoint.resolve()
    run = checkpoint.parent.parent.name if checkpoint.parent.name == "checkpoints" else config["run_name"]
    names = {**run_identity(config, str(checkpoint)), "run": run, "step": step}  # run: the directory's name
    return Subject("normlab", partial(loader.load_model, checkpoint, cfg.dtype), *drawn_probe(slots, cfg.probe.tokens,
                   cfg.seed), names, out, warnings)


def plan(path: Path, cfg: DictConfig) -> Subject:
    if not path.exists():
        raise AnalysisError(f"{path} does not exist: give a .ckpt, a run directory or a Hugging Face model directory")
    if not (path / "config.json").is_file():
        return plan_normlab(path, cfg)
    analysis = plan_hugging_face(path, whole_split(cfg))  # the split re-tokenized by the model's tokenizer
    ((step, load, identity),) = analysis.checkpoints
    out = Path(cfg.paths.output_dir) / "ablation" / default_name(path)
    windows, starts = drawn_probe(analysis.windows, cfg.probe.tokens, cfg.seed)
    return Subject(analysis.layout, load, windows, starts, {**identity, "step": step}, out)


HEADERS = tuple(",".join(c) for c in (CSV_COLUMNS, BEFORE_NULL_COLUMNS, EARLIER_COLUMNS))  # what it replaces
COMMAND = "normlab-ablate"


def written_by_ablate(first_line: str) -> bool:
    """An ablation CSV written before normlab kept records of its outputs: by its header."""
    return first_line in HEADERS


def check_out(out: Path) -> None:
    """Before anything is measured: `out` is a new file or an earlier ablation CSV (its header), and no file of a run
    directory but its ablation.csv (outputs.py)."""
    try:
        outputs.check_file(out, COMMAND, written_by_ablate, owned_in_run=("ablation.csv",), example="ablation.csv")
    except outputs.OutputError as e:
        raise AnalysisError(str(e)) from None


def interval(row: dict) -> str:
    return f"{row['delta']:+.3g} [{row['ci_low']:+.3g}, {row['ci_high']:+.3g}]"


def summary(rows: list[dict]) -> str:
    """One line: the delta of ablating every norm at once, and the single site with the largest |delta|."""
    every = next(r for r in rows if r["site"] == "all" and r["direction"] == ALONG_1)
    top = max((r for r in rows if r["site"] != "all"), key=lambda r: abs(r["delta"]))
    what = "mean subtraction removed" if every["ablation"] == "uncentred" else "inputs centred"
    null = [r["delta"] for r in rows if r["direction"] != ALONG_1]
    among = (f" (percentile {every['null_percentile']:.0f} of {len(null)} random directions' deltas, their median "
             f"{statistics.median(null):+.3g})" if null else "")
    return (f"{every['run']} step {every['step']} ({every['norm']}), {what}: delta at all norms {interval(every)} "
            f"nats/token{among}; largest alone {top['site']} {interval(top)} (share along 1 "
            f"{top['share_along_1']:.2g}, null 1/d {1 / top['d']:.2g}); 95% intervals resample "
            f"{every['resampling_units']} {every['resampling_unit']}")


def main(cfg: DictConfig) -> None:
    """normlab-ablate (normlab.cli.ablate): the loss of `model_path` with the centring of its norms ablated, per site
    and at all at once, against the loss as trained, into `out` (conf/ablate.yaml)."""
    if OmegaConf.is_missing(cfg, "model_path") or not str(cfg.model_path).strip():
        raise AnalysisError("no model given: model_path=RUN_DIR, model_path=CHECKPOINT.ckpt or "
                            "model_path=HF_MODEL_DIR")
    path = Path(str(cfg.model_path))
    check_positive("seq_len", cfg.seq_len, "the model's context")
    if cfg.seq_len == 1:
        raise AnalysisError("seq_len=1 leaves no next token to predict: give at least 2")
    check_positive("probe.tokens", cfg.probe.tokens, "the whole split")
    check_positive("probe.batch_size", cfg.probe.batch_size)
    check_positive("bootstrap", cfg.bootstrap)
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or cfg.seed < 0:
        raise AnalysisError(f"seed={cfg.seed}: give a whole number >= 0 (it seeds the probe's windows and the "
                            "bootstrap)")
    check_positive("block_tokens", cfg.block_tokens)
    if not isinstance(cfg.null_directions, int) or isinstance(cfg.null_directions, bool) or cfg.null_directions < 0:
        raise AnalysisError(f"null_directions={cfg.null_directions}: give a whole number of random directions to "
                            "ablate along in place of 1 (0: no null)")
    loader.check_dtype(cfg.dtype, AnalysisError)
    device = loader.device_name(cfg.device, AnalysisError)
    if cfg.out is not None:
        check_out(Path(str(cfg.out)))
    subject = plan(path, cfg)  # checked before any model runs
    if len(subject.windows) == 0:
        raise AnalysisError(f"the probe holds no window of {cfg.seq_len} tokens for {path}: give a smaller seq_len")
    seq_len = subject.windows.shape[1]
    if cfg.block_tokens < seq_len:
        raise AnalysisError(f"block_tokens={cfg.block_tokens} is shorter than a window of {seq_len} tokens (seq_len): "
                            f"give block_tokens of at least {seq_len}")
    out = Path(str(cfg.out)) if cfg.out is not None else subject.out
    check_out(out)
    for warning in subject.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    # not normlab-train's keep_freed_memory (glibc's heap for big blocks): under it, this loop of forwards once grew a
    # CI machine's process by about the logits' size at each forward until it was killed; LOSS_CHUNK keeps it fast
    model = subject.load()
    names = pretrained.with_norm(subject.names, model, subject.layout)
    rows = ablation_rows(model, subject.layout, subject.windows, cfg.probe.batch_size, cfg.bootstrap, cfg.seed,
                         device, desc=f"{names['run']} step {names['step']}",
                         blocks=subject.starts // cfg.block_tokens, unit=f"blocks of {cfg.block_tokens} tokens",
                         null_directions=cfg.null_directions)
    rows = [{**names, **row} for row in rows]
    if not all(math.isfinite(r["delta"]) for r in rows):
        print("warning: some ablated losses are not finite (inf or nan in the CSV)", file=sys.stderr, flush=True)
    outputs.write_csv(out, CSV_COLUMNS, rows, COMMAND, written_by_ablate)
    print(summary(rows))
    first = rows[0]
    print(f"wrote {out} ({len(rows)} rows, {first['windows']} windows in {first['resampling_units']} "
          f"{first['resampling_unit']}, {first['tokens']:,} scored tokens)")
