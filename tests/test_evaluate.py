"""normlab-eval on a tiny LN and a tiny RMS run, trained and evaluated once by the real commands (one -m sweep
each): a local lm-eval task built from the embedded corpus (a last-word cloze) runs through the real harness, and
its scores are those of normlab's own model; perplexity_<data> is exp of the mean cross-entropy on the held-out
windows (and training's validation loss on the same tokens); results.csv and results.md keep earlier rows; a harness
task whose dataset is not cached fails offline in one line; the run's wandb run gets the results; normlab-report
pairs LN and RMS."""

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conftest import EMBEDDED, compose_config, run_cli, run_of
from normlab.data.tokenizer import gpt2
from normlab.interop.evaluate import main
from normlab.study.report import report
from normlab.study.report.groups import Declared
from normlab.training.loader import load_model

NORMS = ("layernorm", "rmsnorm")
CLOZE_DOCS = 10
HELD_OUT_TOKENS = 1024  # FAST_TRAIN's data.val_tokens: the tokens of training's validation
NEWEST = "checkpoints/step-0000006.ckpt"


def cloze_task(folder: Path) -> list[dict]:
    """A LAMBADA-style task in `folder`: lines of the embedded corpus's held-out text, context = all but the last
    word, target = the last word; scored by loglikelihood with acc and perplexity."""
    text = gpt2().decode(np.fromfile(EMBEDDED / "val.bin", dtype=np.uint16)[:3000].tolist())
    lines = [line.split() for line in text.splitlines() if len(line.split()) >= 6][:CLOZE_DOCS]
    docs = [{"context": " ".join(words[:-1]), "target": words[-1]} for words in lines]
    folder.mkdir()
    (folder / "cloze.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / "cloze.yaml").write_text(f"""\
task: embedded_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'cloze.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + target}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
""")
    return docs


def offline_caches(root: Path) -> dict:
    """Hugging Face caches of this test only, and no network: what a compute node of a cluster sees."""
    return {"HF_HOME": str(root / "hf"), "HF_DATASETS_CACHE": str(root / "hf" / "datasets"),
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def evaluated(sweep, tmp_path_factory) -> Path:
    """<root>/runs/<norm>: a copy of the session's run of each norm (seed 0), evaluated by one normlab-eval sweep over
    both runs (the local task through the harness, and perplexity_embedded)."""
    root = tmp_path_factory.mktemp("evaluate")
    for norm in NORMS:
        shutil.copytree(run_of(sweep, norm), root / "runs" / norm)
    cloze_task(root / "tasks")
    runs = ",".join(str(root / "runs" / norm) for norm in NORMS)
    result = run_cli("normlab-eval", "-m", f"model_path={runs}", "tasks=[embedded_cloze,perplexity_embedded]",
                     f"include_path=[{root / 'tasks'}]", f"perplexity.tokens={HELD_OUT_TOKENS}", "batch_size=4",
                     f"paths.output_dir={root / 'out'}", env=offline_caches(root))
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def results(folder: Path) -> list[dict]:
    with open(folder / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def value(rows: list[dict], task: str, metric: str, step: int = 6) -> dict:
    (row,) = [r for r in rows if (r["task"], r["metric"], r["step"]) == (task, metric, str(step))]
    return row


@torch.no_grad()
def target_loglikelihood(model, doc: dict) -> tuple[float, bool]:
    """log p(" " + target | context) by normlab's model, and whether every target token is its argmax."""
    encoding = gpt2()
    context = encoding.encode_ordinary(doc["context"])
    target = encoding.encode_ordinary(doc["context"] + " " + doc["target"])[len(context):]
    ids = torch.tensor([context + target])
    logprobs = F.log_softmax(model(ids[:, :-1]).float(), -1)[0, len(context) - 1:]
    targets = torch.tensor(target)
    chosen = logprobs.gather(1, targets[:, None]).sum().item()
    return chosen, bool((logprobs.argmax(-1) == targets).all())


@pytest.mark.parametrize("norm", NORMS)
def test_the_harness_scores_each_target_as_normlabs_own_model_does(evaluated, norm):
    run = evaluated / "runs" / norm
    rows = results(run / "eval")
    model = load_model(run / NEWEST).eval()
    docs = [json.loads(line) for line in (evaluated / "tasks" / "cloze.jsonl").read_text().splitlines()]
    scores = [target_loglikelihood(model, doc) for doc in docs]
    perplexity, acc = value(rows, "embedded_cloze", "perplexity"), value(rows, "embedded_cloze", "acc")
    assert float(perplexity["value"]) == pytest.approx(math.exp(-np.mean([ll for ll, _ in scores])), rel=1e-4)
    assert float(acc["value"]) == pytest.approx(np.mean([greedy for _, greedy in scores]))
    assert perplexity["count"] == acc["count"] == str(CLOZE_DOCS) and acc["num_fewshot"] == "0"
    assert {(r["run"], r["norm"], r["seed"], r["source"]) for r in rows} == {
        (norm, norm, "0", str((run / NEWEST).resolve()))}


@pytest.mark.parametrize("norm", NORMS)
def test_held_out_perplexity_is_exp_of_the_mean_cross_entropy_and_trainings_validation_loss(evaluated, norm):
    run = evaluated / "runs" / norm
    rows = results(run / "eval")
    model = load_model(run / NEWEST).eval()
    tokens = torch.from_numpy(np.fromfile(EMBEDDED / "val.bin", dtype=np.uint16)[: HELD_OUT_TOKENS + 1].astype(int))
    windows = tokens.unfold(0, 129, 128)  # the tiny model's context: 128 tokens predicted per window
    with torch.no_grad():
        loss = F.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()).item()
    row = value(rows, "perplexity_embedded", "loss")
    assert float(row["value"]) == pytest.approx(loss, rel=1e-5) and row["count"] == str(HELD_OUT_TOKENS)
    assert float(value(rows, "perplexity_embedded", "perplexity")["value"]) == pytest.approx(math.exp(loss), rel=1e-5)
    with open(run / "metrics.csv", newline="") as f:
        validation = [float(r["val/loss"]) for r in csv.DictReader(f) if r["val/loss"]]
    assert float(row["value"]) == pytest.approx(validation[-1], rel=1e-5)  # after step 6, on the same tokens


def test_results_md_shows_every_row_and_a_rerun_keeps_the_rows_of_other_tasks_and_steps(evaluated, tmp_path):
    run = evaluated / "runs" / "layernorm"
    markdown = (run / "eval" / "results.md").read_text()
    for row in results(run / "eval"):
        line = f"| layernorm | layernorm | 0 | 6 | {row['task']} | {row['metric']} | {float(row['value']):.4f} |"
        assert line in markdown
    out = Path(shutil.copytree(run / "eval", tmp_path / "eval"))
    before = results(out)

    def evaluate(tokens: int) -> list[dict]:
        main(compose_config("eval", [f"model_path={run / 'checkpoints/step-0000004.ckpt'}", f"out={out}",
                                     "tasks=[perplexity_embedded]", f"perplexity.tokens={tokens}", "device=cpu"]))
        return results(out)

    after = evaluate(256)
    assert after[: len(before)] == before and len(after) == len(before) + 2
    assert {(r["step"], r["metric"], r["count"]) for r in after[len(before):]} == {("4", "loss", "256"),
                                                                                  ("4", "perplexity", "256")}
    again = evaluate(512)  # the same checkpoint, task and metrics: its rows replaced
    assert again[: len(before)] == before and len(again) == len(after)
    assert {r["count"] for r in again[len(before):]} == {"512"}
    assert "| 4 | perplexity_embedded | loss |" in (out / "results.md").read_text()


def test_a_harness_task_not_in_the_cache_fails_offline_in_one_line_naming_it(evaluated, tmp_path):
    run = evaluated / "runs" / "layernorm"
    result = run_cli("normlab-eval", f"model_path={run}", "tasks=[lambada_openai]", f"out={tmp_path / 'out'}",
                     env=offline_caches(tmp_path))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("normlab-eval: error: task lambada_openai: its dataset is not in the datasets cache "
                           f"{tmp_path / 'hf' / 'datasets'} and cannot be downloaded here"), line
    assert "login node" in line and "limit=1" in line
    assert not (tmp_path / "out").exists()


def test_the_runs_own_wandb_run_gets_the_results_unless_disabled(evaluated, tmp_path, monkeypatch):
    run = Path(shutil.copytree(evaluated / "runs" / "rmsnorm", tmp_path / "rmsnorm"))
    config = OmegaConf.load(run / "config.yaml")
    config.logger.wandb = {"project": "normlab", "name": "tiny-rmsnorm-seed0", "group": "demo"}
    OmegaConf.save(config, run / "config.yaml")
    for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    evaluate = ["tasks=[perplexity_embedded]", f"perplexity.tokens={HELD_OUT_TOKENS}", "device=cpu"]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    main(compose_config("eval", [f"model_path={run}", *evaluate]))
    assert not (run / "wandb").exists()
    monkeypatch.setenv("WANDB_MODE", "offline")
    main(compose_config("eval", [f"model_path={run}", *evaluate]))
    run_id = (run / "run_id").read_text().strip()
    (offline,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    (table,) = (offline / "files" / "media" / "table" / "eval").glob("results_*.table.json")
    logged = json.loads(table.read_text())
    rows = [dict(zip(logged["columns"], data)) for data in logged["data"]]
    expected = {(r["task"], r["metric"]): float(r["value"]) for r in results(run / "eval")}
    assert {(r["task"], r["metric"]): r["value"] for r in rows} == pytest.approx(expected)
    assert b"eval/perplexity_embedded/loss" in (offline / f"run-{run_id}.wandb").read_bytes()  # the summary


def test_the_report_pairs_ln_and_rms_on_every_task_and_metric(evaluated, tmp_path):
    report([evaluated / "runs"], tmp_path / "report", declared=Declared(learning_check="off"))  # runs of 6 steps
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "### Evaluation (normlab-eval), uncentred − centred, paired by seed" in summary
    ln, rms = (results(evaluated / "runs" / norm / "eval") for norm in NORMS)
    for task, metric in [("embedded_cloze", "acc"), ("embedded_cloze", "perplexity"), ("perplexity_embedded", "loss"),
                         ("perplexity_embedded", "perplexity")]:
        difference = float(value(rms, task, metric)["value"]) - float(value(ln, task, metric)["value"])
        assert (f"| rmsnorm − layernorm (the bias differs too) | {task} | {metric} | 1 (0) | 6/6 | {difference:+.4f} "
                f"| {difference:+.4f} | no interval: one pair | — |") in summary


@pytest.mark.parametrize("setting, message", [
    ("tasks=[]", "no task given: tasks=[lambada_openai,hellaswag] (harness tasks) and perplexity_<data> "
                 "(held-out perplexity)"),
    ("tasks=[perplexity_nothing]", "task perplexity_nothing: data/nothing is not prepared (no "),
    ("perplexity.tokens=64", "perplexity.tokens=64 is less than one window of the model's context (128 tokens): give "
                             "at least that many, or null for the whole split"),
    ("limit=0", "limit=0: give a whole number from 1, or null for all examples"),
    ("include_path=[/nothing]", "include_path: /nothing is not a folder: give folders of task YAML files"),
    ("model_path=/nothing", "/nothing does not exist: give a .ckpt or a run directory"),
    ("tasks=[no_such_task]", "unknown task 'no_such_task': lm-eval ls tasks lists the harness's tasks; tasks of your "
                             "own: include_path=[FOLDER_OF_YAMLS]; held-out perplexity: perplexity_<data>"),
])
def test_bad_input_is_refused_before_anything_runs_or_is_written(evaluated, tmp_path, setting, message):
    from normlab.interop.evaluate import EvalError

    overrides = [f"model_path={evaluated / 'runs' / 'layernorm'}", "tasks=[perplexity_embedded]", f"out={tmp_path}/out",
                 setting]
    with pytest.raises(EvalError) as raised:
        main(compose_config("eval", overrides))
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()
