"""The report on wandb: its verdict's tables (as wandb.Table, from the same objects as summary.md's) and every figure,
logged to a run of the study's project (job_type report), so that the dashboard that holds the training curves holds
the verdict. Offline unless the user is logged in (WANDB_API_KEY, or wandb login's entry in ~/.netrc) or WANDB_MODE
says otherwise; the offline run lies in the report's folder (wandb/), for `wandb sync`."""

import netrc
import os
from pathlib import Path

from normlab.study.report.render import Table, wandb_table

HOST = "api.wandb.ai"


def logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(HOST) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    """WANDB_MODE where it is set, else online for a logged-in user and offline for anyone else."""
    return os.environ.get("WANDB_MODE") or ("online" if logged_in() else "offline")


def project_of(configs: list[dict]) -> str:
    """The project the runs logged to (the first run's logger.wandb.project), else normlab's default."""
    for config in configs:
        project = ((config.get("logger") or {}).get("wandb") or {}).get("project")
        if project:
            return str(project)
    return "normlab"


def log_report(folder: Path, tables: list[Table], project: str, name: str) -> str | None:
    """The tables and the PNG figures of `folder` to a new run `name` of `project`, written under folder/wandb;
    the mode it logged in, or None where WANDB_MODE=disabled."""
    import wandb

    mode = wandb_mode()
    if mode == "disabled":
        return None
    run = wandb.init(project=project, name=name, job_type="report", dir=str(folder), mode=mode,
                     settings=wandb.Settings(quiet=True, silent=True))
    logged = {f"report/{table.name}": wandb_table(table) for table in tables}
    logged |= {f"report/figures/{png.stem}": wandb.Image(str(png)) for png in sorted(folder.glob("*.png"))}
    run.log(logged)
    run.finish()
    wandb.teardown()  # the service flushes and stops: the run's files are whole when this returns
    for link in [p for p in (folder / "wandb").rglob("*") if p.is_symlink()]:  # latest-run, debug.log: conveniences
        link.unlink()  # that would read as files the report did not write (outputs.not_written)
    return mode
