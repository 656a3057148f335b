"""normlab-bench end to end, every section at a tiny size: the table it prints is the one it writes, with a
ratio in each row, and the framework's model ends with the plain loop's weights."""

import re

import pytest

from conftest import run_cli


def test_every_section_writes_its_rows(prepared, tmp_path):
    out = tmp_path / "bench.md"
    result = run_cli("normlab-bench", "rows=256", "repeats=1", "steps=6", "scale=1", "model=tiny", "seq_len=64",
                     "null_directions=16", "precision_steps=4", "profile_steps=2", f"out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    table = out.read_text()
    assert table in result.stdout
    assert table.startswith("normlab-bench framework norms step gains precision prepare angles profile: torch ")
    rows = dict(re.findall(r"^\| (.+?) \| (.+) \|$", table, re.M)[1:])  # after the header row
    norm_rows = [k for k in rows if k.startswith("norm forward+backward")]
    assert len(norm_rows) == 8 and all(
        "d=512" in k or "d=768" in k or "d=1024" in k or "d=2048" in k for k in norm_rows
    )
    assert all(re.match(r"rmsnorm / layernorm \d+\.\d\d \(target <= 1\); dyt / layernorm \d+\.\d\d; against torch's "
                        r"layer_norm: layernorm \d+\.\d\d, rmsnorm \d+\.\d\d, dyt \d+\.\d\d; torch's rms_norm / "
                        r"layer_norm \d+\.\d\d$", rows[k]) for k in norm_rows)
    assert re.match(r"\d\.\d{3} \(target <= 1\)",
                    rows["training step rmsnorm / layernorm (70m (2 layers), 4x64 tokens, cpu)"])
    assert re.match(r"\d+\.\d{3}; layernorm [\d,]+ tokens/s, dyt [\d,]+ tokens/s$",
                    rows["training step dyt / layernorm (70m (2 layers), 4x64 tokens, cpu)"])
    gains = "(70m, layernorm, 4x64 tokens, cpu)"
    assert re.match(r"[\d,.]+ ms/step, [\d,]+ tokens/s$", rows[f"gains: all settings on {gains}"])
    for setting in ("head padded to 128 rows", "loss in chunks"):  # compilation's variants: on a GPU only
        assert re.match(r"\d+\.\d{3} x the step time with it on; [\d,]+ tokens/s$",
                        rows[f"gains: without {setting} {gains}"])
    assert not any("compiled" in k for k in rows if k.startswith("gains"))
    precision = "(tiny (4 layers), layernorm, 4x64 tokens, cpu, 4 steps)"
    assert re.match(r"first \d+\.\d{4}, last \d+\.\d{4}$", rows[f"precision: float32 losses {precision}"])
    for label in ("bf16", "fp16"):
        found = re.match(r"absolute loss difference: largest (\d\.\d{4}), median \d\.\d{4}, last \d\.\d{4}; last loss",
                         rows[f"precision: {label} autocast against float32 {precision}"])
        assert float(found[1]) < 0.05  # the same training, rounded otherwise
    framework = next(v for k, v in rows.items() if k.startswith("normlab-train / plain PyTorch loop"))
    assert framework.endswith("(target >= 0.98); identical batches and weights after 6 steps")
    assert sum(k.startswith("prepare ") and "tokens/s" in v for k, v in rows.items()) == 3
    assert any(k.startswith("read OpenWebText-shaped archives") and "MB/s of text" in v for k, v in rows.items())
    archives = next(v for k, v in rows.items() if k.startswith("prepare them (data=openwebtext"))
    found = re.search(r"peak disk ([\d,]+) MB beside the archives \(([\d,]+) MB of tokens", archives)
    disk, tokens = (int(n.replace(",", "")) for n in found.groups())
    assert tokens <= disk <= 3 * tokens + 1  # the documents' file and a split's beside it, not a copy per process
    assert any(k.startswith("angle probe pass / plain forward (tiny") for k in rows)
    assert any(k.startswith("angle probe pass with 16 null directions / plain forward (tiny") for k in rows)
    assert any(k.startswith("angle probe peak memory") for k in rows)
    profile = next(v for k, v in rows.items() if k.startswith("profile: 2-layer d=512 layernorm"))
    assert re.match(r"[\d,.]+ ms/step; in operators' own time [\d,.]+ ms \(\d+%\); outside them", profile)
    assert (tmp_path / "bench-profile.json").stat().st_size > 10_000  # the Chrome trace, beside the table
    assert sum(k.startswith("profile top ") for k in rows) == 10


@pytest.mark.parametrize("args, message", [
    (["sections=[norms,warp]"], "unknown section 'warp' in sections: choose from framework, norms, step, gains, "
                                "precision, prepare, angles, profile, preflight, e.g. sections=[norms,step]"),
    (["step_model=7b"], "step_model=7b: "),
    (["preflight_batch=max"], "preflight_batch=max: give preset"),
    (["sections=[]"], "no section in sections: choose from framework"),
    (["repeats=0"], "repeats=0: give a positive whole number"),
    (["norms=[layernorm,batchnorm]"], "norms=['layernorm', 'batchnorm']: "),
    (["model=7m"], "unknown model '7m': choose one of 160m, 1b, 410m, 70m, 9m, tiny (conf/model/)"),
    (["--rows", "256"], "unrecognized arguments: --rows"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, message, tmp_path):
    result = run_cli("normlab-bench", *args, f"out={tmp_path}/bench.md")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("normlab-bench: error: ") and message in line
    assert not list(tmp_path.iterdir())
