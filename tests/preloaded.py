"""The body of a command that conftest.run_cli forks from its preloading server (multiprocessing's forkserver): it
does in the new process what the console script does in a fresh one, with the output in files as a pipe would have
it, and exits as the interpreter would (non-daemon threads joined, atexit handlers run, streams flushed)."""

import atexit
import importlib.metadata
import os
import sys
import threading
import traceback


def run_command(tool: str, argv0: str, args: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    if "datasets" in sys.modules:  # it would have read HF_DATASETS_* from the server's environment, not the command's
        raise RuntimeError("the preloading server imported datasets: conftest.NOT_READ_AT_IMPORT must go")
    os.environ.clear()
    os.environ.update(env)
    # where an interpreter started with it puts PYTHONPATH: after the script's folder (a user's own norm module)
    sys.path[1:1] = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    sys.argv = [argv0, *args]
    (entry_point,) = importlib.metadata.entry_points(group="console_scripts", name=tool)
    try:
        code = entry_point.load()()
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 (what the interpreter does with an exception nothing caught)
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
