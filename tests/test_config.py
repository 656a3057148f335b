"""The real Hydra configs compose, and bad input fails in one line with exit code 2 and leaves nothing."""

import pytest

from conftest import FAST_TRAIN, compose_config, run_cli
from train.paths import PROJECT_ROOT


@pytest.mark.parametrize("model", ["tiny", "70m", "160m", "410m", "1b"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_every_preset_and_norm_composes(model, norm):
    cfg = compose_config("train", [f"model={model}", f"norm={norm}"])
    assert cfg.model.name == model and cfg.norm.name == norm
    assert cfg.run_dir == f"{PROJECT_ROOT}/checkpoints/default/{model}-{norm}-seed0"


def test_run_dir_is_derived_from_the_config_and_overridable(tmp_path):
    cfg = compose_config("train", ["experiment=demo", "norm=rmsnorm", "seed=3"])
    assert cfg.run_dir == f"{PROJECT_ROOT}/checkpoints/demo/tiny-rmsnorm-seed3"
    assert compose_config("train", [f"run_dir={tmp_path}"]).run_dir == str(tmp_path)


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


@pytest.mark.parametrize("tool", ["normlab-train", "normlab-describe"])
def test_unknown_preset_lists_the_valid_ones(tool, tmp_path):
    result = run_cli(tool, "model=7m", f"run_dir={tmp_path / 'run'}")
    one_line_error(result, "unknown model '7m'", "choose one of 160m, 1b, 410m, 70m, tiny")
    assert not (tmp_path / "run").exists()


def test_unknown_norm_in_a_sweep_lists_the_valid_ones(tmp_path):
    result = run_cli("normlab-train", "-m", "norm=layernorm,batchnorm", f"run_dir={tmp_path / 'run'}")
    one_line_error(result, "unknown norm 'batchnorm'", "layernorm, rmsnorm")


def test_heads_must_divide_the_width(tmp_path, prepared):
    result = run_cli("normlab-train", "model.n_head=5", f"run_dir={tmp_path / 'run'}", *FAST_TRAIN)
    one_line_error(result, "model.n_embd=64 is not divisible by model.n_head=5")
    assert not (tmp_path / "run").exists()


def test_missing_prepared_data_names_the_command_that_prepares_it(tmp_path):
    result = run_cli("normlab-train", f"data.dir={tmp_path / 'nothing'}", f"run_dir={tmp_path / 'run'}", *FAST_TRAIN)
    one_line_error(result, "data 'embedded' is not prepared", "normlab-prepare data=embedded")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("data", ["embedded", "openwebtext", "wikipedia", "hub", "files"])
def test_every_data_entry_composes_for_prepare_and_train(data):
    prep = compose_config("prepare", [f"data={data}"])
    train = compose_config("train", [f"data={data}"])
    assert prep.data.source == train.data.source
    assert train.data._target_ == "train.data.TokenDataModule" and train.data.dir.endswith(f"/data/{train.data.name}")
    if data == "wikipedia":
        assert prep.data.source.probe_tokens == 1_000_000 and prep.data.source.streaming
    if data == "openwebtext":
        assert prep.data.source.val_fraction == 0.0005 and prep.data.source.split_seed == 2357
