"""The real Hydra configs compose, and bad input fails in one line with exit code 2 and leaves nothing."""

import math
import re

import pytest
import torch
from hydra.core.plugins import Plugins
from omegaconf import OmegaConf

from conftest import NORM_CONFIGS, compose_config, run_cli, written_before
from normlab.common.errors import ConfigError
from normlab.common.moved import current_config, current_overrides
from normlab.common.paths import CONF_DIR, PROJECT_ROOT
from normlab.training.checks import check_train_config
from normlab.training.pipeline import build_callbacks, build_model, build_run_directory, build_trainer
from normlab.training.rundir.config import check_saved_config
from normlab.training.rundir.directory import RunDirectory
from normlab.training.rundir.files import RunDirError
from normlab.training.runtime import PEAK_BF16_FLOPS


@pytest.mark.parametrize("model", ["tiny", "70m", "160m", "410m", "1b"])
@pytest.mark.parametrize("norm", NORM_CONFIGS)
def test_every_preset_and_norm_composes(model, norm):
    cfg = compose_config("train", [f"model={model}", f"norm={norm}"])
    assert cfg.model.name == model and cfg.norm.name == norm
    assert cfg.run_dir == f"{PROJECT_ROOT}/checkpoints/default/{model}-{norm}-seed0"


def test_run_dir_is_derived_from_the_config_and_overridable(tmp_path):
    cfg = compose_config("train", ["experiment=demo", "norm=rmsnorm", "seed=3"])
    assert cfg.run_dir == f"{PROJECT_ROOT}/checkpoints/demo/tiny-rmsnorm-seed3"
    assert compose_config("train", [f"run_dir={tmp_path}"]).run_dir == str(tmp_path)


def test_run_directory_names_every_setting_that_shapes_the_run():
    def run_dir(*overrides):
        return compose_config("train", ["experiment=demo", *overrides], with_hydra=True).run_dir

    base = f"{PROJECT_ROOT}/checkpoints/demo/tiny-rmsnorm-seed3"
    assert run_dir("norm=rmsnorm", "seed=3") == base
    # what only names, places, logs or speeds up a run stays out; numbers are written one way
    assert run_dir("norm=rmsnorm", "seed=3", "logger=csv", "runtime.compile=true", "trainer.devices=2",
                   "trainer.deterministic=true") == base
    assert run_dir("norm=rmsnorm", "seed=3", "optimizer.lr=1e-3") == run_dir("seed=3", "optimizer.lr=0.001",
                                                                            "norm=rmsnorm") == f"{base}-lr1e-3"
    assert run_dir("norm=rmsnorm", "seed=3", "model.lr=1e-3") == f"{base}-lr1e-3"  # the key of older commands
    assert run_dir("norm=rmsnorm", "seed=3", "trainer.max_steps=800", "optimizer.lr=3e-3") == \
        f"{base}-lr3e-3-max_steps800"
    # two keys of one last part: each by the ending that tells them apart; lists, deletions, options of a group
    assert run_dir("norm=rmsnorm", "seed=3", "data.batch_size=4", "probe.batch_size=8") == \
        f"{base}-data_batch_size4-probe_batch_size8"
    assert run_dir("norm=rmsnorm", "seed=3", "optimizer.betas=[0.9,0.95]", "~optimizer.lr", "data=hub") == \
        f"{base}-betas_0.9_0.95-data_hub-no_lr"
    # not finite: named as given (normlab-train refuses them, in one line)
    assert run_dir("norm=rmsnorm", "seed=3", "optimizer.lr=inf", "model.dropout=nan") == f"{base}-dropoutnan-lrinf"
    # long: the items that fit, and a hash of them all, so that every job of a sweep differs
    long = run_dir(
        "norm=rmsnorm", "seed=3", "checkpoints.every=50", "data=hub", "data.source.path=org/name",
        "trainer.max_steps=800", "trainer.val_check_interval=50",
    )
    assert long.startswith(f"{base}-data_hub-every50-max_steps800-path_org_name-h") and len(long) - len(base) <= 61
    assert long != run_dir(
        "norm=rmsnorm", "seed=3", "checkpoints.every=50", "data=hub", "data.source.path=org/other",
        "trainer.max_steps=800", "trainer.val_check_interval=50",
    )


def test_a_run_name_is_typed_back_unquoted_and_an_earlier_runs_name_is_kept(tmp_path):
    """Hydra reads a run directory's name back as the same path without quotes (model_path=, runs=); a run made
    under the earlier naming (-model.lr=0.001) keeps its directory, so that the same command resumes it, also with
    the moved keys by their names now (optimizer.lr, checkpoints.*)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def run_dir(*overrides):
        return compose_config("train", ["experiment=demo", f"paths.output_dir={tmp_path}", *overrides],
                              with_hydra=True).run_dir

    for name in (run_dir("optimizer.lr=3e-4", "trainer.max_steps=150"), run_dir("optimizer.betas=[0.9,0.95]"),
                 run_dir("data=hub", "data.source.path=org/name", "checkpoints.every=50",
                         "model.n_layer=4", "trainer.max_steps=800", "data.batch_size=4")):
        (override,) = OverridesParser.create().parse_overrides([f"model_path={name}"])
        assert override.value() == name
    earlier = tmp_path / "demo" / "tiny-layernorm-seed0-model.lr=0.001,trainer.max_steps=150"
    earlier.mkdir(parents=True)
    assert run_dir("model.lr=1e-3", "trainer.max_steps=150") == str(earlier)
    assert run_dir("optimizer.lr=1e-3", "trainer.max_steps=150") == str(earlier)
    (tmp_path / "demo" / "tiny-layernorm-seed0-lr1e-3-max_steps150").mkdir()  # both exist: the new name
    assert run_dir("model.lr=1e-3", "trainer.max_steps=150").endswith("seed0-lr1e-3-max_steps150")
    earlier = tmp_path / "demo" / "tiny-layernorm-seed0-callbacks.scheduled_checkpoints.every=50,optimizer.lr=0.001"
    earlier.mkdir()
    assert run_dir("checkpoints.every=50", "optimizer.lr=1e-3") == str(earlier)


def test_the_learning_rate_is_the_optimizers_set_per_size_and_model_lr_of_old_commands_sets_it():
    for model, lr in [("tiny", 3e-3), ("70m", 1e-3), ("410m", 3e-4)]:
        cfg = compose_config("train", [f"model={model}"])
        assert cfg.optimizer.lr == lr and "lr" not in cfg.model
    assert compose_config("train", ["model=70m", "optimizer.lr=2e-4"]).optimizer.lr == 2e-4
    old = compose_config("train", ["model=70m", "model.lr=2e-4"])
    assert old.optimizer.lr == 2e-4 and "lr" not in old.model
    assert current_overrides(["-m", "model.lr=1e-3,3e-3", "callbacks.scheduled_checkpoints.every=50",
                              "+callbacks.scheduled_checkpoints.extra_steps=[5]", "~callbacks.scheduled_checkpoints",
                              "model.n_layer=2", "callbacks.angles.every=2"]) == [
        "-m", "optimizer.lr=1e-3,3e-3", "checkpoints.every=50", "+checkpoints.extra_steps=[5]", "~checkpoints",
        "model.n_layer=2", "callbacks.angles.every=2"]


def test_a_model_key_that_is_no_field_of_gptconfig_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        build_model(compose_config("train", ["+model.n_layers=2"]))
    assert str(refused.value) == ("unknown key model.n_layers (added with +?): model takes block_size, dropout, "
                                  "n_embd, n_head, n_layer, name, tie_embeddings, vocab_size")
    cfg = compose_config("train")
    OmegaConf.set_struct(cfg, False)
    cfg.model.lr = 1e-3  # as an old saved config holds it; every reader migrates it first (common/moved.py)
    with pytest.raises(ConfigError, match=r"^unknown key model\.lr "):
        build_model(cfg)


@pytest.mark.parametrize("override", ["~checkpoints", "checkpoints=null", "~callbacks.scheduled_checkpoints"])
def test_the_run_directory_cannot_be_removed_by_an_override(override):
    with pytest.raises(ConfigError, match=r"^checkpoints cannot be removed: it configures the run directory"):
        check_train_config(compose_config("train", [override]))


@pytest.mark.parametrize("override", ["callbacks.angles=null", "~callbacks.angles"])
def test_a_callback_set_to_null_is_off_as_one_removed(prepared, override):
    names = [type(c).__name__ for c in build_callbacks(compose_config("train", [override]))]
    assert "AngleCallback" not in names and "NonFiniteGuard" in names and "NoneType" not in names
    assert "AngleCallback" in [type(c).__name__ for c in build_callbacks(compose_config("train"))]


def test_the_run_directory_is_no_callback_and_an_old_config_files_callback_of_it_is_refused(tmp_path):
    cfg = compose_config("train", ["~callbacks", f"run_dir={tmp_path}"])  # without any callback: still there
    check_train_config(cfg)
    run = build_run_directory(cfg)
    assert RunDirectory.of(build_trainer(cfg, [], accumulate=1, run=run)) is run
    cfg = compose_config("train")
    OmegaConf.update(cfg, "callbacks.scheduled_checkpoints", {"every": 50}, force_add=True)  # an experiment file's
    with pytest.raises(ConfigError, match=r"^callbacks.scheduled_checkpoints is now checkpoints \(every, "):
        check_train_config(cfg)


def test_a_config_saved_before_the_keys_moved_reads_as_one_saved_now(tmp_path):
    """What resuming (run_config.check_saved_config), the commands that load a model (loader.saved_config) and the
    report (tests/test_report.py) read of an old run's config.yaml: the same as of a new run's."""
    cfg = compose_config("train", [f"run_dir={tmp_path}", "model.n_layer=2"])
    new = OmegaConf.to_container(cfg, resolve=True)
    old = written_before(new)
    assert current_config(old) == new
    del old["branch"]["moments"]  # written before branch.moments: a branch's optimizer started afresh
    assert current_config(old) == new
    del old["branch"]  # written before branches: its keys, at None and False since, are what it had
    OmegaConf.save(OmegaConf.create(old), tmp_path / "config.yaml")
    check_saved_config(tmp_path, cfg)
    cfg.checkpoints.every = 50
    with pytest.raises(RunDirError, match=r"holds checkpoints of another config \(checkpoints.every: 100 -> 50, "):
        check_saved_config(tmp_path, cfg)


def test_demo_experiment_sweeps_both_norms_on_the_tiny_model():
    cfg = compose_config("train", ["experiment=demo"], with_hydra=True)
    assert cfg.model.name == "tiny" and cfg.data.name == "embedded"
    assert cfg.hydra.sweeper.params.norm == "layernorm,rmsnorm"


def one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_describe_rejects_an_unknown_preset_in_one_line():
    result = run_cli("normlab-describe", "model=7m")
    one_line_error(result, "unknown model '7m'", "choose one of 160m, 1b, 410m, 70m, 9m, tiny")


@pytest.mark.parametrize("data", ["embedded", "openwebtext", "wikipedia", "hub", "files"])
def test_every_data_entry_composes_for_prepare_and_train(data):
    prep = compose_config("prepare", [f"data={data}"])
    train = compose_config("train", [f"data={data}"])
    assert prep.data.source == train.data.source
    assert train.data._target_ == "normlab.data.datamodule.TokenDataModule"
    assert train.data.dir.endswith(f"/data/{train.data.name}")
    if data == "wikipedia":
        assert prep.data.source.probe_tokens == 1_000_000 and prep.data.source.streaming
    if data == "openwebtext":
        assert prep.data.source.val_fraction == 0.0005 and prep.data.source.split_seed == 2357


# -- check_train_config: every setting checked before anything is written (the real command: tests/test_errors.py)

ON_THIS_MACHINE = ["trainer.accelerator=cpu", "trainer.devices=1"]  # the paper experiments ask for 4 GPUs


def test_every_config_of_conf_passes_the_checks():
    choices = [[f"{group}={p.stem}"] for group in ("norm", "data", "optimizer", "logger", "strategy")
               for p in sorted((CONF_DIR / group).glob("*.yaml"))]
    choices += [[f"experiment={p.stem}", *ON_THIS_MACHINE] for p in sorted((CONF_DIR / "experiment").glob("*.yaml"))]
    choices += [["trainer=gpu", *ON_THIS_MACHINE], ["trainer.precision=16-mixed", "norm=dyt", "norm.layer.alpha_init=1",
                                                     "optimizer.fused=null", "trainer.gradient_clip_val=null"]]
    for overrides in choices:
        check_train_config(compose_config("train", overrides))


class UnannotatedNorm(torch.nn.Module):
    """A norm of a user's own, without annotations: its defaults' types are checked."""

    def __init__(self, dim, scale=1.0, centred=True, label=None):
        super().__init__()

    def forward(self, x):  # the contract, which check_train_config also checks, runs it
        return x


USERS_NORM = ["norm.name=unannotated", "norm.layer._target_=test_config.UnannotatedNorm",
              "~norm.layer.eps", "~norm.layer.bias"]


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay=-1: give a number >= 0 (0: no decay)"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas=[0.9, 1.5]: give two numbers from 0 to below 1, e.g. [0.9, 0.95]"),
    (["optimizer.betas=0.9"], "optimizer.betas=0.9: give two numbers from 0 to below 1, e.g. [0.9, 0.95]"),
    (["optimizer.eps=0"], "optimizer.eps=0: give a number > 0"),
    (["optimizer.fused=maybe"], "optimizer.fused=maybe: give true, false or null"),
    (["+optimizer.amsgrad=1"], "optimizer.amsgrad=1: give true or false"),
    (["optimizer._target_=torch.optim.SGD", "~optimizer.betas", "~optimizer.eps", "+optimizer.momentum=1.5"],
     "optimizer.momentum=1.5: give a number from 0 to below 1 (0: none)"),
    (["optimizer._target_=torch.optim.SGD", "~optimizer.betas", "~optimizer.eps", "+optimizer.nesterov=maybe"],
     "optimizer.nesterov=maybe: give true or false"),
    (["norm=dyt", "norm.layer.alpha_init=abc"], "norm.layer.alpha_init=abc: give a number"),
    (["norm=dyt", "norm.layer.alpha_init=null"], "norm.layer.alpha_init=null: give a number"),
    (["norm.layer.bias=maybe"], "norm.layer.bias=maybe: give true or false"),
    (["norm=rmsnorm", "norm.layer.bias=1"], "norm.layer.bias=1: give true or false"),
    (["norm.layer.eps=null"], "norm.layer.eps=null: give a number"),
    (["norm.name=torch_layernorm", "norm.layer._target_=torch.nn.LayerNorm", "+norm.layer.elementwise_affine=maybe"],
     "norm.layer.elementwise_affine=maybe: give true or false"),
    ([*USERS_NORM, "+norm.layer.scale=abc"], "norm.layer.scale=abc: give a number"),
    ([*USERS_NORM, "+norm.layer.scale=null"], "norm.layer.scale=null: give a number"),
    ([*USERS_NORM, "+norm.layer.centred=maybe"], "norm.layer.centred=maybe: give true or false"),
    (["trainer.precision=bf16"], "trainer.precision=bf16: give bf16-mixed (the same, written out)"),
    (["trainer.precision=32"], "trainer.precision=32: give 32-true (the same, written out)"),
    (["trainer.precision=16-true"], "trainer.precision=16-true: give one of 32-true, bf16-mixed, 16-mixed, 64-true "
                                    "(float32 weights, with bf16 or fp16 autocast for the mixed ones; float64)"),
    (["trainer.precision=16-mixed", "strategy=fsdp"], "trainer.precision=16-mixed with the sharded trainer.strategy "
     "normlab.training.strategies.BlockFSDP: the gradient scaler checks each shard's gradients alone; use bf16-mixed, "
     "or strategy=ddp"),
    (["+trainer.gradient_clip_algorithm=max"], "trainer.gradient_clip_algorithm=max: give norm, value or null (norm)"),
    (["data.num_workers=1.5"], "data.num_workers=1.5: give a whole number"),
    (["callbacks.throughput.peak_flops=abc"], "callbacks.throughput.peak_flops=abc: give a number or null"),
    (["+trainer.enable_progress_bar=yes"], "trainer.enable_progress_bar=yes: give true, false or null"),
    (["norm=dyt", "norm.sites.mlp.alpha_init=abc"], "norm.sites.mlp.alpha_init=abc: give a number"),
    (["norm=dyt", "+norm.sites.final.beta=1"], "unknown key norm.sites.final.beta (added with +?): "
     "normlab.model.norms.DyT has no parameter 'beta'; remove it, or check its spelling"),
    (["norm=dyt", "norm.sites=3"], "norm.sites must map a site kind (attention, mlp, final) to settings of "
     "norm.layer, e.g. {attention: {alpha_init: 0.8}}"),
    (["analysis.primary=loss"], "analysis.primary=loss: give centring, bias or interaction, or null"),
    (["analysis.final_validations=0"], "analysis.final_validations=0: give a positive whole number"),
])
def test_a_setting_of_the_wrong_type_or_range_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as refused:
        check_train_config(compose_config("train", overrides))
    assert str(refused.value) == message


def test_a_users_norm_without_annotations_takes_what_its_defaults_take():
    check_train_config(compose_config("train", [*USERS_NORM, "+norm.layer.scale=2", "+norm.layer.label=3"]))


# -- Slurm: the paper's batch scripts and Hydra's submitit launcher, per paper size

PAPER_GPUS = {"paper_70m": 4, "paper_160m": 4, "paper_410m": 2, "paper_1b": 4}
PAPER_HARDWARE = {"paper_70m": "A6000", "paper_160m": "A6000", "paper_410m": "A100", "paper_1b": "A100"}


def slurm_minutes(limit: str) -> int:
    """A time limit in any of sbatch's formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, clock = limit.split("-") if "-" in limit else (0, limit)
    fields = [int(f) for f in clock.split(":")]
    if "-" in limit or len(fields) == 3:
        hours, minutes, seconds = fields + [0] * (3 - len(fields))
    else:
        hours, (minutes, seconds) = 0, fields + [0] * (2 - len(fields))
    return int(days) * 24 * 60 + hours * 60 + minutes + math.ceil(seconds / 60)


def test_slurm_minutes_reads_every_sbatch_format():
    assert [slurm_minutes(t) for t in ["90", "90:30", "24:00:00", "1-0", "1-12:30", "3-00:00:00"]] == \
        [90, 91, 1440, 1440, 2190, 4320]


@pytest.mark.parametrize("experiment", PAPER_GPUS)
def test_paper_batch_scripts_fit_24_hours_requeue_themselves_and_leave_partition_and_account_to_the_site(experiment):
    script = (PROJECT_ROOT / "slurm" / f"{experiment}.sbatch").read_text()
    options = dict(re.findall(r"^#SBATCH[ \t]+(-{1,2}[\w-]+)(?:[= \t]+(\S+))?", script, flags=re.MULTILINE))
    assert slurm_minutes(options["--time"]) <= 24 * 60
    signal, lead_seconds = options["--signal"].split("@")
    assert signal in ("SIGUSR1", "USR1") and int(lead_seconds) >= 60  # a step and a save of last.ckpt fit
    assert "--requeue" in options and options["--open-mode"] == "append"  # a requeued job appends to its log
    assert not {"--partition", "-p", "--account", "-A"} & set(options)
    gpus = compose_config("train", [f"experiment={experiment}"]).trainer.devices
    assert gpus == PAPER_GPUS[experiment]
    assert int(options["--ntasks-per-node"]) == gpus and options["--gres"] == f"gpu:{gpus}"
    assert 'source "${SLURM_SUBMIT_DIR:-.}/slurm/env.sh"' in script
    assert f"srun --kill-on-bad-exit=1 normlab-train experiment={experiment} " in script


def submitit_params(launcher: str, experiment: str, *overrides: str) -> dict:
    """The settings the submitit launcher passes to submitit, resolved as at a -m launch: Hydra instantiates the
    launcher from the composed config, so that its interpolations resolve against the job's config."""
    cfg = compose_config("train", [f"hydra/launcher={launcher}", f"experiment={experiment}", *overrides], True)
    return Plugins.instance().instantiate_launcher(hydra_context=None, task_function=None, config=cfg).params


@pytest.mark.parametrize("launcher,gb_per_gpu", [("slurm_a100", 100), ("slurm_a6000", 50)])
@pytest.mark.parametrize("experiment", PAPER_GPUS)
def test_submitit_launcher_is_sized_by_the_experiment_and_takes_partition_and_account_from_the_environment(
    launcher, gb_per_gpu, experiment, monkeypatch
):
    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    monkeypatch.delenv("SBATCH_ACCOUNT", raising=False)
    params = submitit_params(launcher, experiment)
    gpus = PAPER_GPUS[experiment]
    assert params["tasks_per_node"] == params["gpus_per_node"] == gpus and params["nodes"] == 1
    assert params["mem_per_gpu"] == f"{gb_per_gpu}G" and params["mem_gb"] is None
    assert params["timeout_min"] == 24 * 60 and params["signal_delay_s"] >= 60
    assert params["partition"] is None and params["account"] is None
    assert params["setup"] == ["source slurm/env.sh"]
    assert params["submitit_folder"] == f"{PROJECT_ROOT}/checkpoints/{experiment}/.submitit/%j"

    monkeypatch.setenv("SBATCH_PARTITION", "gpu-long")
    monkeypatch.setenv("SBATCH_ACCOUNT", "lab")
    params = submitit_params(launcher, experiment, "trainer.num_nodes=2", "trainer.devices=8")
    assert (params["partition"], params["account"], params["nodes"], params["tasks_per_node"]) == \
        ("gpu-long", "lab", 2, 8)
    assert submitit_params(launcher, experiment, "hydra.launcher.partition=debug")["partition"] == "debug"


@pytest.mark.parametrize("experiment", PAPER_GPUS)
def test_submitit_launcher_requeues_a_paper_run_enough_times_to_finish_it(experiment):
    """Jobs of 24 h, requeued at each time-out up to max_num_timeout times: enough for the run at a modest 20% MFU
    on its paper hardware (FLOPs per token x tokens / the GPUs' dense bf16 peak)."""
    launcher = {"A100": "slurm_a100", "A6000": "slurm_a6000"}[PAPER_HARDWARE[experiment]]
    cfg = compose_config("train", [f"hydra/launcher={launcher}", f"experiment={experiment}"], with_hydra=True)
    with torch.device("meta"):
        flops_per_token = build_model(cfg).flops_per_token()
    tokens = cfg.trainer.max_steps * cfg.global_batch_size * cfg.model.block_size
    peak = PEAK_BF16_FLOPS[PAPER_HARDWARE[experiment]] * cfg.trainer.devices * cfg.trainer.num_nodes
    hours = flops_per_token * tokens / (0.2 * peak) / 3600
    launch = cfg.hydra.launcher
    assert 2 < hours < (launch.max_num_timeout + 1) * launch.timeout_min / 60
