"""The real Hydra configs compose, and bad input fails in one line with exit code 2 and leaves nothing."""

import pytest

from conftest import compose_config, run_cli
from normlab.paths import PROJECT_ROOT


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


def test_run_directory_names_every_setting_that_shapes_the_run():
    def run_dir(*overrides):
        return compose_config("train", ["experiment=demo", *overrides], with_hydra=True).run_dir

    base = f"{PROJECT_ROOT}/checkpoints/demo/tiny-rmsnorm-seed3"
    assert run_dir("norm=rmsnorm", "seed=3") == base
    # what only names, places, logs or speeds up a run stays out; numbers are written one way
    assert run_dir("norm=rmsnorm", "seed=3", "logger=csv", "runtime.compile=true", "trainer.devices=2") == base
    assert run_dir("norm=rmsnorm", "seed=3", "model.lr=1e-3") == run_dir("seed=3", "model.lr=0.001", "norm=rmsnorm") \
        == f"{base}-model.lr=0.001"
    assert run_dir("norm=rmsnorm", "seed=3", "trainer.max_steps=800", "model.lr=3e-3") == \
        f"{base}-model.lr=0.003,trainer.max_steps=800"
    # long or unsafe in a file name: shortened, with a hash of the whole, so that every job of a sweep differs
    long = run_dir(
        "norm=rmsnorm", "seed=3", "callbacks.scheduled_checkpoints.every=50", "data=hub", "data.source.path=org/name"
    )
    assert long.startswith(f"{base}-every=50,data=hub,path=org_name-") and len(long.rsplit("-", 1)[1]) == 8
    assert long != run_dir(
        "norm=rmsnorm", "seed=3", "callbacks.scheduled_checkpoints.every=50", "data=hub", "data.source.path=org/other"
    )


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
    one_line_error(result, "unknown model '7m'", "choose one of 160m, 1b, 410m, 70m, tiny")


@pytest.mark.parametrize("data", ["embedded", "openwebtext", "wikipedia", "hub", "files"])
def test_every_data_entry_composes_for_prepare_and_train(data):
    prep = compose_config("prepare", [f"data={data}"])
    train = compose_config("train", [f"data={data}"])
    assert prep.data.source == train.data.source
    assert train.data._target_ == "normlab.data.TokenDataModule" and train.data.dir.endswith(f"/data/{train.data.name}")
    if data == "wikipedia":
        assert prep.data.source.probe_tokens == 1_000_000 and prep.data.source.streaming
    if data == "openwebtext":
        assert prep.data.source.val_fraction == 0.0005 and prep.data.source.split_seed == 2357
