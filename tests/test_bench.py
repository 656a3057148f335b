"""normlab-bench end to end, every section at a tiny size: the table it prints is the one it writes, with a
ratio in each row, and the framework's model ends with the plain loop's weights."""

import re

from conftest import run_cli


def test_every_section_writes_its_rows(prepared, tmp_path):
    out = tmp_path / "bench.md"
    result = run_cli("normlab-bench", "--rows", "256", "--repeats", "1", "--steps", "6", "--scale", "1",
                     "--model", "tiny", "--seq-len", "64", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    table = out.read_text()
    assert table in result.stdout
    assert table.startswith("normlab-bench framework norms step prepare angles: torch ")
    rows = dict(re.findall(r"^\| (.+?) \| (.+) \|$", table, re.M)[1:])  # after the header row
    norm_rows = [k for k in rows if k.startswith("norm forward+backward")]
    assert len(norm_rows) == 8 and all(
        "d=512" in k or "d=768" in k or "d=1024" in k or "d=2048" in k for k in norm_rows
    )
    assert all(re.match(r"RMSNorm / LayerNorm \d+\.\d\d \(target <= 1\)", rows[k]) for k in norm_rows)
    assert re.match(r"\d\.\d{3} \(target <= 1\)", rows["training step RMS / LN (70m (2 layers), 4x256 tokens, cpu)"])
    framework = next(v for k, v in rows.items() if k.startswith("normlab-train / plain PyTorch loop"))
    assert framework.endswith("(target >= 0.97); identical batches and weights after 6 steps")
    assert sum(k.startswith("prepare ") and "tokens/s" in v for k, v in rows.items()) == 2
    assert any(k.startswith("angle probe pass / plain forward (tiny") for k in rows)
    assert any(k.startswith("angle probe peak memory") for k in rows)
