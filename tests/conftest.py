import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

import preloaded
from normlab.common.compose import compose
from normlab.common.moved import MOVED_TARGETS
from normlab.common.paths import CONF_DIR, DATA_DIR
from normlab.data import bigram

# Two test workers share the machine's cores, and each process they start runs torch with a thread per core: libgomp's
# threads spin while they wait for work (its default), taking the other worker's CPU time (measured: two tiny trainings
# side by side took 22-34 s each, 16 s with passive waiting). Set before anything imports torch (which loads libgomp);
# every process a test starts inherits it, Slurm jobs included (sbatch passes the environment on).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BIN = Path(sys.executable).parent
EMBEDDED = DATA_DIR / "embedded"

# Small enough for a few CPU seconds per run; real configs, real data, real Lightning.
FAST_TRAIN = [
    "model.n_layer=2",
    "data.batch_size=2",
    "data.val_tokens=1024",
    "trainer.max_steps=6",
    "trainer.val_check_interval=2",
    "checkpoints.every=2",
    "checkpoints.dense_until=4",
    "checkpoints.sparse_every=6",
    "logger=csv",
    "probe.tokens=4096",  # 32 windows of the held-out 88K tokens: the probe at every checkpoint costs 20x less
    "probe.null_directions=8",  # the null's percentile exercised, without the cost of the default's 200 directions
]


# A run's config as normlab wrote it before classes and keys moved (common/moved.py read backwards), for the tests that
# old run directories and checkpoints still resume, load and group with new ones


def written_before(config: dict) -> dict:
    """The saved `config` (nested dicts and lists) with each moved class named by its place before normlab had
    subpackages, the peak learning rate also as model.lr (of which optimizer.lr was a copy), and the checkpoint
    schedule as the callback callbacks.scheduled_checkpoints (with copies of run_dir and trainer settings)."""
    old = named_before_the_move({k: v for k, v in config.items() if k != "checkpoints"})
    old["model"] = {**old["model"], "lr": old["optimizer"]["lr"]}
    callback = {"_target_": "normlab.run_dir.RunDirectory", "path": old["run_dir"], **config["checkpoints"],
                "max_steps": old["trainer"]["max_steps"], "val_check_interval": old["trainer"]["val_check_interval"]}
    old["callbacks"] = {"scheduled_checkpoints": callback, **old["callbacks"]}
    return old


def named_before_the_move(config):
    if isinstance(config, dict):
        return {k: earlier_target(v) if k == "_target_" else named_before_the_move(v) for k, v in config.items()}
    if isinstance(config, list):
        return [named_before_the_move(v) for v in config]
    return config


def earlier_target(target):
    for old, new in MOVED_TARGETS.items():
        if isinstance(target, str) and target.startswith(new):
            return old + target.removeprefix(new)
    return target


# `make test` runs the suite on 3 pytest-xdist workers (on 2 cores: a worker waiting for Slurm or a signal leaves
# its core to the others), a file per worker at a time (--dist loadfile: a file's module fixtures are built once,
# and the Slurm tests share the one-node cluster in turn), the files in the order of this list
# (--no-loadscope-reorder: else xdist orders them by their number of tests, which put the Slurm file, the longest
# with 8 tests, among the last). The files that take a minute or more go first, longest first, so that no long file
# starts last while the other workers have nothing left to do; the longest first of all, one per worker (a worker
# is given its next file while its current file's last two tests run). The others follow.
LONGEST_FIRST = ["test_slurm.py", "test_faults.py", "test_distributed.py", "test_train.py", "test_errors.py",
                 "test_package.py", "test_analysis_errors.py", "test_convert.py", "test_plan.py", "test_evaluate.py",
                 "test_hub_sources.py", "test_install.py", "test_report.py", "test_export.py",
                 "test_norms_of_your_own.py", "test_bench.py", "test_cli.py", "test_prepare.py", "test_outputs.py",
                 "test_scale.py", "test_run_dir.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within each file and among the other files is kept


# Every norm of conf/norm/*.yaml: the one list of norms that the tests take (a norm added there is tested everywhere)
NORM_CONFIGS = sorted(p.stem for p in (CONF_DIR / "norm").glob("*.yaml"))


def norm_layer(name: str, dim: int = 8):
    """The layer of the norm config `name`, as a model builds it (its norm.layer), at width `dim`."""
    from hydra.utils import instantiate

    return instantiate(compose_config("train", [f"norm={name}"]).norm.layer)(dim)


def compose_config(config_name: str = "train", overrides: list[str] = (), with_hydra: bool = False):
    """The config as the command line composes it (the resolvers registered, old keys read as they are now)."""
    return compose(config_name, overrides, with_hydra)


# A command that a test starts spends its first 5 CPU seconds importing torch, torch._dynamo and torchmetrics (the
# last two through Lightning): half of a FAST_TRAIN run, most of a bad-input case. start_cli (run_cli waits for its
# end) forks the commands from a server that has imported those once per test worker (multiprocessing's forkserver).
# Each command is still a process of its own (its pid, exit status, output, signal handlers, environment and working
# directory), which imports Lightning, Hydra's app and normlab itself, in the order a fresh process does (Lightning
# sets up its logging at import according to what Hydra set up before). A command whose environment differs from the
# server's in a variable that the preloaded libraries may read at import (READ_AT_IMPORT), or a test that asks for
# fresh=True (what a process prints from its very start), gets a fresh process; NORMLAB_TEST_FRESH_PROCESSES=1 gives
# every command one.
PRELOADED = ["preloaded", "torch", "torch._dynamo", "torchmetrics"]
READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA", "HF_", "HUGGINGFACE", "TRANSFORMERS",
                  "TOKENIZERS", "MALLOC_", "LD_", "PYTHON")
# ...but for HF_DATASETS_* (HF_DATASETS_OFFLINE: the data tests), which only `datasets` reads: the preloaded
# libraries import transformers and huggingface_hub, not datasets (preloaded.run_command checks it)
NOT_READ_AT_IMPORT = ("HF_DATASETS_", "PYTHONPATH")  # PYTHONPATH: preloaded.run_command puts it on sys.path
COMMANDS = multiprocessing.get_context("forkserver")
COMMANDS.set_forkserver_preload(PRELOADED)
server_env: dict[str, str] = {}  # the environment the server started with
TIMEOUT = 600  # seconds a command may take


def read_at_import(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and not k.startswith(NOT_READ_AT_IMPORT)}


class Command:
    """A command that start_cli started: a process of its own, with Popen's pid, poll, returncode, send_signal, kill
    and communicate. Its stdout and stderr go to files, read when it has ended: a pipe that nobody reads while the
    test waits for the run's files could fill up and stall the command."""

    def __init__(self, tool: str, args: list[str], env: dict, cwd: str, fresh: bool):
        self.args = [str(BIN / tool), *args]
        self._out = tempfile.TemporaryDirectory()
        self._stdout, self._stderr = Path(self._out.name) / "stdout", Path(self._out.name) / "stderr"
        if fresh:
            with open(self._stdout, "w") as stdout, open(self._stderr, "w") as stderr:
                self._popen = subprocess.Popen(self.args, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
            self.pid = self._popen.pid
        else:
            self._process = COMMANDS.Process(target=preloaded.run_command, args=(
                tool, self.args[0], args, env, cwd, str(self._stdout), str(self._stderr)))
            self._process.start()
            self.pid = self._process.pid
            self._popen = None

    def poll(self) -> int | None:
        """The exit status once ended (-N: killed by signal N), else None."""
        return self._popen.poll() if self._popen else self._process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float = TIMEOUT) -> tuple[str, str]:
        """Waits for the end (TimeoutExpired after `timeout` s, the command still running): (stdout, stderr)."""
        if self._popen:
            self._popen.wait(timeout)
        else:
            self._process.join(timeout)
            if self._process.exitcode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        output = self._stdout.read_text(), self._stderr.read_text()
        self._out.cleanup()
        return output


def start_cli(tool: str, *args: str, env: dict | None = None, cwd: Path | None = None, fresh: bool = False) -> Command:
    """Starts the installed command `tool` with `args` (WANDB_MODE=offline; `env` on top of the test's environment,
    None removing a variable), forked from the preloading server unless it needs a fresh process."""
    full_env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    fresh = (fresh or read_at_import(full_env) != read_at_import(server_env or os.environ)
             or os.environ.get("NORMLAB_TEST_FRESH_PROCESSES") == "1")
    if not fresh and not server_env:  # this command starts the server, with the worker's environment
        server_env.update(os.environ)
    return Command(tool, list(args), full_env, str(cwd or os.getcwd()), fresh)


def run_cli(tool: str, *args: str, env: dict | None = None, cwd: Path | None = None,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """start_cli's command run to its end (killed after TIMEOUT s): its exit status, stdout and stderr."""
    command = start_cli(tool, *args, env=env, cwd=cwd, fresh=fresh)
    try:
        stdout, stderr = command.communicate(TIMEOUT)
    except subprocess.TimeoutExpired:
        command.kill()
        command.communicate()
        raise
    return subprocess.CompletedProcess(command.args, command.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def prepared() -> Path:
    """The embedded corpus, prepared by the real `normlab-prepare` (once per checkout, whichever pytest-xdist
    worker asks first: the others wait for it; again where an earlier normlab prepared it without the bigram bar)."""
    with FileLock(EMBEDDED.parent / ".embedded.lock"):
        meta = EMBEDDED / "meta.json"
        if not meta.is_file() or bigram.KEY not in json.loads(meta.read_text()):
            result = run_cli("normlab-prepare", "data=embedded")
            assert result.returncode == 0, result.stderr
    return EMBEDDED


@pytest.fixture
def prepared_copy(prepared, tmp_path) -> Path:
    """A private copy of the prepared corpus that a test may damage."""
    return Path(shutil.copytree(prepared, tmp_path / "embedded"))


def once_per_session(tmp_path_factory, name: str, command: Callable[[Path], subprocess.CompletedProcess]) -> Path:
    """`command(folder)` run once in this pytest session (folder: <session>/`name`), by the pytest-xdist worker that
    asks first while the others wait for it (the pattern of pytest-xdist's docs: a lock in the folder that holds
    every worker's temporary folders); returns the folder, which the workers share."""
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session = session.parent  # each worker's base folder lies in the session's; without xdist it is its own
    out, outcome = session / name, session / f"{name}.outcome.json"
    with FileLock(session / f"{name}.lock"):
        if not outcome.is_file():  # a failure is recorded too: the next worker reports it rather than retrying
            result = command(out)
            outcome.write_text(json.dumps({"returncode": result.returncode, "stderr": result.stderr[-3000:]}))
    recorded = json.loads(outcome.read_text())
    assert recorded["returncode"] == 0, recorded["stderr"]
    return out


# The run directories' tag: the FAST_TRAIN overrides (last key parts and values, sorted), the items that fit, and a hash
# of them all
TAG = "-batch_size2-dense_until4-every2-max_steps6-hfbd9b5ac"


@pytest.fixture(scope="session")
def sweep(prepared, tmp_path_factory) -> Path:
    """`normlab-train -m norm=layernorm,rmsnorm seed=0,1`: four runs, back to back, with Hydra's basic launcher;
    trained once per session for every file that needs a finished tiny run of FAST_TRAIN. Shared: a test reads
    these runs, and changes only a copy (shutil.copytree) of one."""

    def train(out: Path) -> subprocess.CompletedProcess:
        return run_cli("normlab-train", "-m", "norm=layernorm,rmsnorm", "seed=0,1", "experiment_name=t",
                       f"paths.output_dir={out}", *FAST_TRAIN)

    return once_per_session(tmp_path_factory, "sweep", train) / "t"


def run_of(sweep: Path, norm: str, seed: int = 0) -> Path:
    return sweep / f"tiny-{norm}-seed{seed}{TAG}"


DOCS = [
    f"Document {i}: " + " ".join(["The quick brown fox jumps over the lazy dog."] * (i % 7 + 1)) + f" Café №{i} 🦊"
    for i in range(60)
]


@pytest.fixture(scope="session")
def local_corpus(tmp_path_factory) -> Path:
    """DOCS in two local jsonl files, prepared by the real `normlab-prepare data=files` (10% held out)."""
    root = tmp_path_factory.mktemp("corpus")
    for part in range(2):
        with open(root / f"part{part}.jsonl", "w") as f:
            for i in range(part * 30, part * 30 + 30):
                f.write(json.dumps({"id": i, "body": DOCS[i]}) + "\n")
    out = root / "prepared"
    result = run_cli("normlab-prepare", *local_corpus_config(out), env={"HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def local_corpus_config(prepared: Path) -> list[str]:
    """The overrides that describe the local corpus prepared in `prepared` (for prepare and train)."""
    root = prepared.parent
    return [
        "data=files",
        "data.name=local",
        f"data.dir={prepared}",
        "data.source.text_column=body",
        f"data.source.files=[{root}/part0.jsonl,{root}/part1.jsonl]",
        "data.source.val_fraction=0.1",
    ]


# -- the one-node Slurm cluster that `make test` starts (slurm/local_cluster.sh)


def cluster_ready() -> bool:
    return shutil.which("sbatch") is not None and subprocess.run(["sinfo"], capture_output=True).returncode == 0


needs_slurm = pytest.mark.skipif(
    not cluster_ready() and not os.environ.get("CI"),
    reason="no Slurm cluster here: run `bash slurm/local_cluster.sh` (root) first",
)


def state(job: str) -> str:
    """The job's state and reason as squeue shows them ("PENDING BeginTime"), "" once it has ended. A busy slurmctld
    can fail a query (a socket time-out, with no output): that is asked again, never read as the job's end."""
    for _ in range(30):
        result = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True)
        if result.returncode == 0:
            return result.stdout.strip()
        if "Invalid job id" in result.stderr:  # ended longer ago than MinJobAge
            return ""
        time.sleep(1)
    raise AssertionError(f"squeue failed 30 times for job {job}: {result.stderr.strip()}")


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)
