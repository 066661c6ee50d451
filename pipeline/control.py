"""Start, resume and cancel runs: the one API the CLI and the panel call.

Everything here returns what happened (or raises a typed error); printing,
notifying and exit codes are the caller's. A run is driven by a detached
driver (pipeline.run.driver), so none of these calls keeps a stage alive.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import config as config_mod
from pipeline.cluster import slurm
from pipeline.config import Config, ConfigError
from pipeline.run import driver
from pipeline.run.driver import CancelResult, Step
from pipeline.run.rundir import RunDir, RunDirError, list_runs

# Grace times when a run's config cannot be read (config.py's defaults).
DEFAULT_GRACE = (config_mod.RuntimeSection.cancel_grace_s, config_mod.RuntimeSection.term_grace_s)


class Busy(Exception):
    """Another launcher is driving the run; nothing new was started."""

    def __init__(self, run: RunDir, pid: int):
        super().__init__(f"{run.id}: a launcher (pid {pid}) is already driving this run; "
                         "nothing new was started.")
        self.run, self.pid = run, pid


class Blocked(Exception):
    """The requested stage needs one that has not succeeded."""


@dataclass
class Started:
    run: RunDir
    steps: list[Step] = field(default_factory=list)
    driver: subprocess.Popen | None = None   # None: everything was up to date

    @property
    def nothing_to_do(self) -> bool:
        return self.driver is None


def runs_dir(config_path: str | None, override: str | None) -> Path:
    """Where runs live: --runs-dir, else the config's [run] runs_dir, else
    ./runs beside the project (an unreadable config must not hide the runs)."""
    if override:
        return Path(override)
    try:
        return load_config(config_path, gpu_check=False).runs_dir()
    except ConfigError:
        return config_mod.PROJECT_ROOT / "runs"


def load_config(path: str | None, gpu_check: bool = True) -> Config:
    kwargs = {} if gpu_check else {"gpu_count": None}
    return config_mod.load(path or config_mod.default_config_path(), **kwargs)


def resolve_run(folder: Path, name: str | None) -> RunDir:
    """RUN may be a path to a run directory or a run id under `folder`;
    no RUN means the newest run."""
    if name:
        p = Path(name)
        if p.is_dir() and (p / "state.json").exists():
            return RunDir(p)
        return RunDir(folder / name).require()
    runs = list_runs(folder)
    if not runs:
        raise RunDirError(f"no runs in {folder}; start one with `eagle-panel run`.")
    return runs[0]


def open_run(cfg: Config, run_id: str | None = None) -> RunDir:
    """Create (or reuse) the run directory with the config frozen into it
    (a scheduler that would refuse the jobs is said before, creating nothing)."""
    check_scheduler(cfg, run_id or cfg.run.name, cfg.runs_dir())
    return driver.prepare_run(cfg, run_id)


def check_scheduler(cfg: Config, run_id: str, runs_dir: Path) -> None:
    if cfg.cluster.scheduler == "slurm":
        try:
            slurm.preflight(cfg.cluster, runs_dir)
        except slurm.SlurmError as e:
            raise Blocked(f"{run_id}: {e}") from None


def start(rd: RunDir, only: str | None = None, force: bool = False,
          busy_wait: float = 3.0) -> Started:
    """Plan and start the run's driver (not started when everything is up
    to date). Raises Busy, or Blocked when `only` needs an unfinished stage."""
    holder = driver.busy_launcher(rd, wait=busy_wait)
    if holder is not None:
        raise Busy(rd, holder)
    cfg = driver.load_run_config(rd)
    check_scheduler(cfg, rd.id, rd.path.parent)
    steps = driver.plan(cfg, driver.reconcile(rd), only, force)
    blocked = [s for s in steps if s.action == "blocked"]
    if blocked:
        raise Blocked(f"{rd.id}: cannot run {only}: {blocked[0].why}. Run the pipeline "
                      "without --stage first.")
    if all(s.action == "skip" for s in steps):
        return Started(rd, steps)
    return Started(rd, steps, driver.start_driver(rd, only, force))


def resume(rd: RunDir, busy_wait: float = 3.0) -> Started:
    """Restart from the first stage that has not succeeded, with the run's
    frozen config; each stage resumes from its own finished work."""
    return start(rd, busy_wait=busy_wait)


def cancel_graces(rd: RunDir) -> tuple[float, float]:
    """(after SIGINT, after SIGTERM) from the run's frozen config."""
    try:
        cfg = driver.load_run_config(rd)
    except (ConfigError, RunDirError):
        return DEFAULT_GRACE
    return cfg.runtime.cancel_grace_s, cfg.runtime.term_grace_s


def cancel(rd: RunDir, stage: str | None = None, grace: float | None = None) -> list[CancelResult]:
    """SIGINT, then SIGTERM, then SIGKILL to the running stage's tree (or
    one stage's); no further stage starts when the whole run is cancelled."""
    default_grace, term = cancel_graces(rd)
    return driver.cancel_run(rd, stage, default_grace if grace is None else grace, term)
