"""A hub source (conf/data/hub.yaml) and what its repository holds: a dataset repository on the Hugging Face hub, or
a local copy of one (data.source.path=DIR, as `hf download --repo-type dataset REPO --local-dir DIR` leaves it).

The repository's files are listed before anything is read, and no loading script is ever run (datasets >= 4 runs
none):
- data files that datasets reads without a script (parquet, arrow, json, csv, text: what a script-free conversion
  leaves), with no script beside them, are read by datasets.load_dataset, as any dataset;
- else the archives that data.source.archives names (OpenWebText's original layout, read by data/archives.py), fetched
  with huggingface_hub into its cache (a finished archive is never fetched again);
- a repository with a loading script and neither of those, or with nothing of either, is refused in one line that
  says what was expected, what was found and the way out.
"""

import os
import re
import socket
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig

from normlab.common.errors import DataError
from normlab.common.progress import Progress

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# Files that datasets reads with one of its packaged builders, compressed or not
DATA_FILE = re.compile(r"\.(parquet|arrow|jsonl?|csv|tsv|txt)(\.(gz|bz2|xz|zst|lz4))?$", re.IGNORECASE)
DATA_FORMATS = "parquet, arrow, json, csv or text"
PARQUET_CONVERSION = "refs/convert/parquet"


def offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARIABLES)


def offline_hint(name: str) -> str:
    return (f"prepare it on a machine with network (a login node): `normlab-prepare data={name}`, then copy "
            f"data/{name}/ here; with {' or '.join(OFFLINE_VARIABLES)}=1 a dataset already in the Hugging Face cache "
            "is used without network")


def reachable(timeout: float = 5.0) -> bool:
    """One TCP connection to the hub, so that no network fails in seconds instead of after retries."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Repo:
    """A dataset repository's files (hidden ones left out), on the hub or in a local folder."""

    path: str
    revision: str | None
    files: tuple[str, ...]
    folder: Path | None = None  # a local copy; None: on the hub

    @property
    def where(self) -> str:
        if self.folder is not None:
            return f"the folder {self.folder}"
        return f"'{self.path}' on the Hugging Face hub" + (f" (revision {self.revision})" if self.revision else "")

    def scripts(self) -> list[str]:
        return [f for f in self.files if "/" not in f and f.endswith(".py")]

    def archives(self, pattern: str | None) -> list[str]:
        return sorted(f for f in self.files if pattern and fnmatch(f, pattern))

    def data_files(self, pattern: str | None) -> list[str]:
        return [f for f in self.files if DATA_FILE.search(f) and f not in self.archives(pattern)]


@dataclass(frozen=True)
class Located:
    """How a hub source is read: its archives (local paths, in order), or datasets.load_dataset's arguments."""

    archives: list[Path] | None = None
    load_args: dict | None = None


def locate(name: str, source: DictConfig) -> Located:
    """How to read the hub source `source` of data `name` (see the module), its archives fetched if that is its
    layout. Offline, a hub repository cannot be listed: its archives are taken from the Hugging Face cache where
    they all are, else datasets reads it from its own cache (or says it cannot)."""
    pattern = source.get("archives")
    repo = list_repo(name, source)
    if repo is None:
        cached = cached_archives(name, source, pattern) if pattern else None
        return Located(archives=cached) if cached else Located(load_args=load_args(source))
    data, archives, scripts = repo.data_files(pattern), repo.archives(pattern), repo.scripts()
    if data and not scripts:
        return Located(load_args=load_args(source, repo))
    if archives:
        if repo.folder is not None:
            return Located(archives=[repo.folder / a for a in archives])
        return Located(archives=fetch(repo, archives))
    raise DataError(unreadable(name, repo, pattern))


def list_repo(name: str, source: DictConfig) -> Repo | None:
    """The files of the repository at data.source.path: a local folder, else a hub repository at
    data.source.revision (None offline, where a hub repository cannot be listed)."""
    path, revision = str(source.path), source.get("revision")
    folder = Path(path).expanduser()
    if folder.is_dir():
        if revision:
            raise DataError(f"data.source.path={path} is a local folder, and data.source.revision={revision} names a "
                            "version on the hub: leave the revision out (null) for a local copy")
        files = (p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
        return Repo(path, None, tuple(sorted(f.as_posix() for f in files
                                             if not any(part.startswith(".") for part in f.parts))), folder.resolve())
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        raise DataError(f"data.source.path={path}: no such folder, and not a dataset's name on the hub (org/name): "
                        "give a local copy of the dataset's repository or its name")
    if offline():
        return None
    if not reachable():
        raise DataError(f"the Hugging Face hub is unreachable (no network?) for '{path}': {offline_hint(name)}")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        files = HfApi().list_repo_files(path, repo_type="dataset", revision=revision)
    except RevisionNotFoundError:
        raise DataError(f"'{path}' on the Hugging Face hub has no revision {revision!r}: give a branch, tag or commit "
                        f"of it as data.source.revision ({PARQUET_CONVERSION}: the hub's parquet conversion)") from None
    except RepositoryNotFoundError:
        raise DataError(f"no dataset '{path}' on the Hugging Face hub that this machine may read (private or gated "
                        "ones need `hf auth login`): check data.source.path") from None
    except Exception as e:  # httpx's connection errors and time-outs, the hub's HTTP errors
        raise DataError(f"cannot list the files of '{path}' on the Hugging Face hub ({type(e).__name__}): "
                        f"{offline_hint(name)}") from None
    return Repo(path, revision, tuple(sorted(f for f in files if not any(p.startswith(".") for p in f.split("/")))))


def load_args(source: DictConfig, repo: Repo | None = None) -> dict:
    """datasets.load_dataset's arguments for the source's data files. A local copy of one configuration's folder
    without the dataset card that declares it (data.source.name=20231101.en, its parquet files copied alone) is read
    as that folder."""
    args = dict(path=str(source.path), name=source.get("name"), split=source.split,
                streaming=source.get("streaming", False))
    if source.get("revision"):
        args["revision"] = source.revision
    if (repo is not None and repo.folder is not None and args["name"] and "README.md" not in repo.files
            and (repo.folder / args["name"]).is_dir()):
        args.update(name=None, data_dir=args["name"])
    return args


def fetch(repo: Repo, archives: list[str]) -> list[Path]:
    """The archives downloaded into the Hugging Face cache (HF_HOME), several at a time, with their progress; those
    already there are not downloaded again."""
    from huggingface_hub import snapshot_download

    bars: list[Progress] = []

    class FetchProgress(Progress):  # closed at the end of the fetch: huggingface_hub leaves its byte bars open
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    print(f"fetching {len(archives)} archives of {repo.where} into the Hugging Face cache", flush=True)
    try:
        folder = snapshot_download(repo.path, repo_type="dataset", revision=repo.revision, allow_patterns=archives,
                                   tqdm_class=FetchProgress)
    except Exception as e:  # connection lost, disk full, the hub's HTTP errors
        raise DataError(f"fetching the archives of {repo.where} failed ({type(e).__name__}: {e}): run the prepare "
                        "again, which fetches only the archives still missing".splitlines()[0]) from None
    finally:
        for bar in bars:
            bar.close()
    return [Path(folder) / a for a in archives]


def cached_archives(name: str, source: DictConfig, pattern: str) -> list[Path] | None:
    """Offline: the archives of a hub source in the Hugging Face cache, when every one of them is there (the
    cache's listing of the repository says which), else None when none are."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(str(source.path), repo_type="dataset", revision=source.get("revision"),
                                        allow_patterns=pattern, local_files_only=True))
    except IncompleteSnapshotError:
        raise DataError(f"the Hugging Face cache holds only some of the archives of '{source.path}' (a fetch cut "
                        f"short): run `normlab-prepare data={name}` with network, which fetches the rest") from None
    except LocalEntryNotFoundError:
        return None
    return sorted(p for p in folder.rglob("*") if fnmatch(p.relative_to(folder).as_posix(), pattern)) or None


def unreadable(name: str, repo: Repo, pattern: str | None) -> str:
    """Why the repository cannot be read, and the way out."""
    scripts, data = repo.scripts(), repo.data_files(pattern)
    if scripts:
        beside = f", beside data files ({', '.join(data[:3])}{', ...' if len(data) > 3 else ''})" if data else ""
        return (f"{repo.where} holds a loading script ({scripts[0]}){beside}, which datasets no longer runs: "
                f"{way_out(repo)}")
    expected = f"data files ({DATA_FORMATS})" + (f" or archives matching {pattern}" if pattern else "")
    found = ", ".join(repo.files[:5]) + (f" and {len(repo.files) - 5} more files" if len(repo.files) > 5 else "")
    return (f"{repo.where} holds no {expected}; it holds {found or 'no files'}: give data.source.path a dataset "
            f"repository, or a copy of one, with its data files")


def way_out(repo: Repo) -> str:
    """What to do with a repository that has only a loading script: the hub's parquet conversion of it where the hub
    has one, else the data as local files."""
    files = ("prepare its data as local files: `normlab-prepare data=files 'data.source.files=[...]'` "
             "(docs/data.md)")
    if repo.folder is None:
        from huggingface_hub import HfApi

        try:
            converted = any(ref.ref == PARQUET_CONVERSION
                            for ref in HfApi().list_repo_refs(repo.path, repo_type="dataset").converts)
        except Exception:  # the refs cannot be read: the way out names the conversion as a possibility
            return f"try the hub's parquet conversion, data.source.revision={PARQUET_CONVERSION}, or {files}"
        if converted:
            return f"read the hub's parquet conversion of it instead: data.source.revision={PARQUET_CONVERSION}"
        return f"the hub has no parquet conversion of it: {files}"
    return (f"read the hub's parquet conversion of it where it has one (data.source.path=ORG/NAME "
            f"data.source.revision={PARQUET_CONVERSION}), or {files}")
