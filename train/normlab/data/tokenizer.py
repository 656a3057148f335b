"""GPT-2 BPE (tiktoken's r50k ranks) that also works on machines without network.

Resolution order: an explicit ranks file (tokenizer_ranks_file=PATH), the project's copy
(data/tokenizer/gpt2.tiktoken), tiktoken's own cached download; then, when preparing data, the ranks
file extracted from the PyPI sdist of openai-whisper (which ships the same file, checked by hash), and
last tiktoken's online download. Every file is checked against the sha256 tiktoken itself expects.
"""

import base64
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tiktoken

from normlab.common.errors import NormlabError, TokenizerError
from normlab.common.paths import DATA_DIR, DOWNLOADS_DIR

NAME = "gpt2"
VOCAB_SIZE = 50257
EOT = 50256
# sha256 of the GPT-2 (r50k_base) ranks file, the hash tiktoken itself checks its download against.
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
RANKS_FILE = DATA_DIR / "tokenizer" / "gpt2.tiktoken"
TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
# The regex GPT-2 splits text with before merging (tiktoken's r50k pattern).
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

WHISPER_SDIST = "openai-whisper==20250625"
FETCH_HINT = f"pip download --no-deps --no-binary :all: {WHISPER_SDIST} -d {DOWNLOADS_DIR}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def encoding_from_ranks(path: Path) -> tiktoken.Encoding:
    data = path.read_bytes()  # parsed here: tiktoken's loader would leave a cache copy in /tmp
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise TokenizerError(
            f"{path} is not the GPT-2 ranks file (sha256 mismatch): delete it and run `normlab-prepare`"
        )
    ranks = {
        base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)
    }
    return tiktoken.Encoding(
        name=NAME,
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )


def local_ranks_file(ranks_file: Path | None = None) -> Path | None:
    """A GPT-2 ranks file on this machine: `ranks_file`, else the project's copy, else tiktoken's cache."""
    if ranks_file is not None:
        if not Path(ranks_file).is_file():
            raise TokenizerError(f"tokenizer ranks file {ranks_file} does not exist")
        return Path(ranks_file)
    cache = (
        os.environ.get("TIKTOKEN_CACHE_DIR")
        or os.environ.get("DATA_GYM_CACHE_DIR")
        or Path(tempfile.gettempdir()) / "data-gym-cache"
    )
    cached = Path(cache) / hashlib.sha1(TIKTOKEN_URL.encode()).hexdigest()  # where tiktoken keeps its download
    for path in (RANKS_FILE, cached):
        if path.is_file() and sha256_file(path) == RANKS_SHA256:
            return path
    return None


def gpt2(ranks_file: Path | None = None) -> tiktoken.Encoding:
    """The GPT-2 encoding from a local ranks file (see local_ranks_file), else from tiktoken's download.
    All hold the same ranks (checked by hash), so the choice changes no token."""
    path = local_ranks_file(ranks_file)
    if path is not None:
        return encoding_from_ranks(path)
    try:
        return tiktoken.get_encoding(NAME)
    except Exception as e:  # tiktoken raises requests' errors, or ValueError on a bad cache
        raise TokenizerError(
            f"no GPT-2 tokenizer available offline ({type(e).__name__}): on a machine with network run "
            f"`{FETCH_HINT}` and then `normlab-prepare`, or copy data/tokenizer/ here, or pass "
            "tokenizer_ranks_file=PATH"
        ) from None


def fetch_sdist(requirement: str, downloads: Path) -> Path:
    """Download a source archive from the package registry (once) and return its path."""
    name, version = requirement.split("==")

    def found() -> list[Path]:  # sdists are named with _ (new) or - (old)
        return sorted(downloads.glob(f"{name.replace('-', '_')}-{version}.tar.gz")) or sorted(
            downloads.glob(f"{name}-{version}.tar.gz")
        )

    if found():
        return found()[0]
    downloads.mkdir(parents=True, exist_ok=True)
    print(f"downloading {requirement} (source archive) into {downloads}", file=sys.stderr)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        requirement,
        "-d",
        str(downloads),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode or not found():
        raise NormlabError(
            f"could not download {requirement} from the package registry (no network?): on a machine with "
            f"network run `{' '.join(cmd[1:])}` and copy {downloads} here"
        )
    return found()[0]


def install_ranks_file(downloads: Path = DOWNLOADS_DIR) -> Path:
    """Put the GPT-2 ranks file at RANKS_FILE, extracted from the openai-whisper sdist (downloaded
    from the package registry unless it is already in `downloads`)."""
    if RANKS_FILE.is_file() and sha256_file(RANKS_FILE) == RANKS_SHA256:
        return RANKS_FILE
    archive = fetch_sdist(WHISPER_SDIST, downloads)
    with tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken")), None)
        if member is None:
            raise TokenizerError(f"{archive} holds no whisper/assets/gpt2.tiktoken: delete it and retry")
        data = tar.extractfile(member).read()
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise TokenizerError(f"the gpt2.tiktoken in {archive} has an unexpected hash: delete the archive and retry")
    RANKS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=RANKS_FILE.parent, delete=False) as tmp:
        tmp.write(data)
    os.chmod(tmp.name, 0o644)
    Path(tmp.name).replace(RANKS_FILE)
    return RANKS_FILE
