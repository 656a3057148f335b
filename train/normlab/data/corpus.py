"""A prepared corpus read back (the files train/normlab/data/prepare.py writes): its meta.json and token files
checked against the model that will read them, the probe set of the angle statistics, and the windows drawn across
a probe split for the ablation (draw_windows). Without Lightning, so that the commands that only read a corpus
(normlab-angles, -ablate, -eval) start without importing it."""

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from normlab.common.errors import ConfigError, DataError
from normlab.data import tokenizer
from normlab.data.prepare import META_FILE

SCAN_CHUNK = 1 << 26  # tokens read at a time when a file is scanned


def scan(path: Path) -> tuple[int, int]:
    """The largest token of a file and its position, read in chunks (a progress bar for big files)."""
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    largest, where = 0, 0
    chunks = range(0, len(tokens), SCAN_CHUNK)
    for start in tqdm(chunks, desc=f"checking {path.name}", unit="chunk", disable=len(chunks) < 8):
        chunk = np.asarray(tokens[start : start + SCAN_CHUNK])
        if chunk.size and chunk.max() > largest:
            largest, where = int(chunk.max()), start + int(chunk.argmax())
    return largest, where


def verify_prepared(dir: Path, name: str, source: dict | None, vocab_size: int, splits, checksums: bool) -> dict:
    """Check prepared token files against their metadata and the model; one clear error per problem."""
    hint = f"run `normlab-prepare data={name}`"
    meta_path = dir / META_FILE
    if not meta_path.is_file():
        raise DataError(f"data '{name}' is not prepared ({meta_path} is missing): {hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except OSError as e:
        raise DataError(f"cannot read {meta_path} ({e.strerror}): check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{meta_path} is not valid JSON: {hint} again") from None
    malformed = check_meta(meta)
    if malformed:
        raise DataError(f"{meta_path} is malformed ({malformed}): {hint} again")
    if source is not None and not same_source(meta.get("source"), source):
        raise DataError(f"{dir} was prepared from another source than conf/data/{name}.yaml: {hint} again")
    tok = meta["tokenizer"]
    if tok["ranks_sha256"] != tokenizer.RANKS_SHA256 or tok["vocab_size"] != vocab_size:
        raise DataError(
            f"{meta_path}: tokenized with {tok['name']} ({tok['vocab_size']} tokens), but the model expects "
            f"GPT-2 with vocab_size={vocab_size}: {hint} again, or set model.vocab_size"
        )
    for split in splits:
        if split not in meta["splits"]:
            raise DataError(
                f"{meta_path} has no '{split}' split (it has {', '.join(meta['splits'])}): {hint} with the "
                "right data= entry"
            )
        info, path = meta["splits"][split], dir / meta["splits"][split]["file"]
        if not path.is_file():
            raise DataError(f"{path} is missing: {hint}")
        if path.stat().st_size != 2 * info["tokens"]:
            raise DataError(
                f"{path} holds {path.stat().st_size // 2} tokens, its metadata says {info['tokens']}: "
                f"the file is truncated or replaced, {hint} again"
            )
        try:
            largest, where = scan(path)
            if checksums and tokenizer.sha256_file(path) != info["sha256"]:
                raise DataError(f"{path} does not match the sha256 in {meta_path}: the file is corrupt, {hint} again")
        except OSError as e:
            raise DataError(f"cannot read {path} ({e.strerror}): check its permissions") from None
        if largest >= vocab_size:
            raise DataError(
                f"{path} holds token {largest} at position {where}, outside the vocabulary of {vocab_size}: "
                f"the file is corrupt, {hint} again"
            )
    return meta


def same_source(recorded, configured: dict) -> bool:
    """Whether a corpus was prepared from the configured source. A key that the configuration leaves null and an
    older meta.json lacks (data.source.revision, .archives: added later) is the same source."""
    if not isinstance(recorded, dict):
        return False
    return recorded == {k: v for k, v in configured.items() if k in recorded or v is not None}


def check_meta(meta) -> str | None:
    """What is missing from a meta.json (as written by train/normlab/data/prepare.py), or None."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    for key, kind in (("tokenizer", dict), ("splits", dict)):
        if not isinstance(meta.get(key), kind):
            return f"no '{key}' object"
    missing = [k for k in ("name", "vocab_size", "ranks_sha256") if k not in meta["tokenizer"]]
    if missing:
        return f"tokenizer without {', '.join(missing)}"
    for split, info in meta["splits"].items():
        if not isinstance(info, dict) or any(k not in info for k in ("file", "tokens")):
            return f"split '{split}' without file or tokens"
    return None


def load_probe(
    dir: str, split: str, tokens: int | None, seq_len: int, vocab_size: int = tokenizer.VOCAB_SIZE
) -> torch.Tensor:
    """The probe set: the first `tokens` tokens (None: all) of a prepared split, as [windows, seq_len]."""
    dir = Path(dir)
    if tokens is not None and (not isinstance(tokens, int) or tokens < seq_len):
        raise ConfigError(
            f"probe.tokens={tokens} is less than one sequence of the model's context ({seq_len} "
            "tokens): give at least that many, or null for the whole probe set"
        )
    meta = verify_prepared(dir, dir.name, None, vocab_size, (split,), checksums=False)
    available = meta["splits"][split]["tokens"] // seq_len * seq_len
    if tokens is not None and tokens > available:
        raise DataError(
            f"the probe set {dir / meta['splits'][split]['file']} holds {available:,} tokens in windows of "
            f"{seq_len}, fewer than the {tokens:,} asked: lower probe.tokens, or prepare a larger probe set"
        )
    n = (available if tokens is None else tokens) // seq_len
    data = np.fromfile(dir / meta["splits"][split]["file"], dtype=np.uint16, count=n * seq_len)
    return torch.from_numpy(data.astype(np.int64)).view(n, seq_len)


def draw_windows(slots: int, count: int | None, seed: int) -> torch.Tensor:
    """Which of a split's `slots` non-overlapping windows (slot i: tokens i * seq_len to (i + 1) * seq_len) a probe
    of `count` windows scores: a seeded random subset spread over the whole split, sorted by position (None, or as
    many as there are: all of them). The same for every call with the same arguments, so every model scored on the
    same probe, seq_len and seed is scored on the same windows."""
    if count is None or count >= slots:
        return torch.arange(slots)
    chosen = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:count]
    return chosen.sort().values
