"""Start, resume and cancel runs: the one API the CLI and the panel call.

Everything here returns what happened (or raises a typed error); printing,
notifying and exit codes are the caller's. A run is driven by a detached
driver (pipeline.drive.driver, started as `python -m pipeline.control drive`),
so none of these calls keeps a stage alive.

This module sits above run/, cluster/ and extract/: it registers Slurm's
executor (pipeline.cluster.slurm.SlurmScheduler) with pipeline.run.executor,
which run/ asks whether a stage still runs and never imports cluster/ for,
and the run-level services with the driver (the shared vLLM server of
regenerate and extract, pipeline.extract.shared_server). Every process that
launches, drives or reads a run imports this module.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import config as config_mod
from pipeline.cluster import slurm
from pipeline.config import Config, ConfigError
from pipeline.drive import driver
from pipeline.drive.driver import CancelResult, Step
from pipeline.extract import shared_server
from pipeline.run import executor
from pipeline.run.reconcile import reconcile
from pipeline.run.rundir import RunDir, RunDirError, check_run_id, check_runs_dir, list_runs
from pipeline.stage_graph import STAGE_NAMES

executor.register(slurm.SlurmScheduler())
driver.SERVICES.append(shared_server.Service)

# Grace times when a run's config cannot be read (config.py's defaults).
DEFAULT_GRACE = (config_mod.RuntimeSection.cancel_grace_s, config_mod.RuntimeSection.term_grace_s)


class Busy(Exception):
    """Another launcher is driving the run; nothing new was started."""

    def __init__(self, run: RunDir, pid: int):
        super().__init__(f"{run.id}: a launcher (pid {pid}) is already driving this run; "
                         "nothing new was started.")
        self.run, self.pid = run, pid


class Blocked(Exception):
    """The requested stage needs one that has not succeeded, or the
    scheduler would refuse the jobs."""


class Refused(Exception):
    """doctor's launch checks found something blocking; nothing was created
    or started. `findings` are all of the checks' findings."""

    def __init__(self, run_id: str, findings: list):
        n = sum(f.level == "blocking" for f in findings)
        super().__init__(f"{run_id}: not launched: doctor found {n} blocking problem(s)")
        self.findings = findings


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
    ./runs beside the project (an unreadable default config must not hide the
    runs; one named with --config is an error: never another config's runs)."""
    if override is not None:
        # named on the command line: it must be a folder that is there
        if not override or not Path(override).is_dir():
            raise RunDirError(f"--runs-dir {override!r}: not a folder"
                              + ("" if not override or Path(override).exists() else
                                 " (it does not exist)") + ". Name the folder the runs are in.")
        return Path(override)
    try:
        return check_runs_dir(load_config(config_path).runs_dir())
    except ConfigError:
        if config_path is not None:
            raise   # a config named on purpose that cannot be read: never another one's runs
        return config_mod.PROJECT_ROOT / "runs"


def load_config(path: str | None) -> Config:
    """The config at `path`; None: ./config.toml, else the bundled one. A
    named path is that file or an error, never a fallback (`--config ""`
    must not act on the bundled config's runs)."""
    return config_mod.load(config_mod.default_config_path() if path is None else path)


def resolve_run(folder: Path, name: str | None) -> RunDir:
    """RUN may be a path to a run directory or a run id under `folder`;
    no RUN means the newest run."""
    if name is not None:
        if not name.strip():
            raise RunDirError(f"RUN {name!r} is empty: give a run's id (`eagle-panel runs` "
                              "lists them), or leave it out for the newest run.")
        p = Path(name)
        if p.is_dir() and (p / "state.json").exists():
            return RunDir(p).require()
        if "/" in name or name.startswith("."):
            raise RunDirError(f"{name}: no such run directory (a path must be a run's folder, "
                              "an id a plain name). `eagle-panel runs` lists the runs.")
        return RunDir(folder / check_run_id(name, "RUN")).require()
    runs = list_runs(folder)
    if not runs:
        raise RunDirError(f"no runs in {folder}; start one with `eagle-panel run`.")
    return runs[0]


def check_scheduler(cfg: Config, run_id: str, runs_dir: Path) -> None:
    if cfg.cluster.scheduler == "slurm":
        try:
            slurm.preflight(cfg.cluster, runs_dir)
        except slurm.SlurmError as e:
            raise Blocked(f"{run_id}: {e}") from None


def check_launch(cfg: Config, run_id: str, skip_checks: bool = False) -> list:
    """doctor's launch checks (pipeline.doctor.launch_checks(): from the config
    and the target's config.json, no probes). Raises Refused when one blocks,
    unless `skip_checks`; returns the blocking findings that were skipped."""
    from pipeline import doctor
    findings = doctor.launch_findings(cfg)
    blocking = [f for f in findings if f.level == doctor.BLOCK]
    if blocking and not skip_checks:
        raise Refused(run_id, findings)
    return blocking


def launch(cfg: Config, run_id: str | None = None, only: str | None = None,
           force: bool = False, skip_checks: bool = False, busy_wait: float = 3.0) -> Started:
    """`run`: check the config, then create (or reuse) the run directory with
    the config frozen into it, then start. A check that refuses (the
    scheduler's, doctor's) creates and changes nothing."""
    # before anything is created: `--run ../../x` must not make a folder
    rid = check_run_id(run_id, "--run") if run_id is not None else cfg.run.name
    check_runs_dir(cfg.runs_dir())
    check_scheduler(cfg, rid, cfg.runs_dir())
    skipped = check_launch(cfg, rid, skip_checks)
    return _start(driver.prepare_run(cfg, run_id), cfg, only, force, busy_wait, skipped)


def start(rd: RunDir, only: str | None = None, force: bool = False,
          busy_wait: float = 3.0, skip_checks: bool = False) -> Started:
    """Plan and start the run's driver with its frozen config (not started
    when everything is up to date). Raises Busy, Refused, or Blocked when
    `only` needs an unfinished stage."""
    rd.check_readable()   # damage is named here, not met by the detached driver
    cfg = driver.load_run_config(rd)
    check_scheduler(cfg, rd.id, rd.path.parent)
    skipped = check_launch(cfg, rd.id, skip_checks)
    return _start(rd, cfg, only, force, busy_wait, skipped)


def _start(rd: RunDir, cfg: Config, only: str | None, force: bool, busy_wait: float,
           skipped: list) -> Started:
    ex = executor.for_run(rd)   # the one executor this start asks whether a stage runs
    lock, holder = driver.claim(rd, wait=busy_wait, ex=ex)
    if lock is None:
        raise Busy(rd, holder)
    try:
        state = reconcile(rd, ex)
        from pipeline.run.leftovers import stop_survivors
        stop_survivors(state, ex.alive)   # what ended attempts left running: stopped
        steps = driver.plan(cfg, state, only, force)
        blocked = [s for s in steps if s.action == "blocked"]
        if blocked:
            raise Blocked(f"{rd.id}: cannot run {only}: {blocked[0].why}. Run the pipeline "
                          "without --stage first.")
        if all(s.action == "skip" for s in steps):
            return Started(rd, steps)
        if skipped:
            driver.say_in_log(rd, "launched with --skip-checks over doctor's blocking "
                              "findings: " + "; ".join(f"{f.area}: {f.message}" for f in skipped))
        return Started(rd, steps, driver.start_driver(rd, only, force, lock_fd=lock))
    finally:
        os.close(lock)   # (the driver holds it now, where one was started)


def resume(rd: RunDir, busy_wait: float = 3.0, skip_checks: bool = False) -> Started:
    """Restart from the first stage that has not succeeded, with the run's
    frozen config; each stage resumes from its own finished work."""
    return start(rd, busy_wait=busy_wait, skip_checks=skip_checks)


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


def main(argv=None) -> int:
    """`python -m pipeline.control drive --run-dir R`: the detached driver
    (driver.start_driver starts it). Its entry point is here, not in run/,
    so that the driver asks a Slurm run's jobs of Slurm's executor."""
    ap = argparse.ArgumentParser(prog="python -m pipeline.control")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive", help="run the pipeline of a run directory "
                                     "(detached by `eagle-panel run`)")
    d.add_argument("--run-dir", required=True)
    d.add_argument("--stage", choices=STAGE_NAMES)
    d.add_argument("--force", action="store_true")
    d.add_argument("--lock-fd", type=int, help="the run's launcher lock, taken by the launcher")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return driver.drive(RunDir(a.run_dir).require(), a.stage, a.force, a.lock_fd)


if __name__ == "__main__":
    sys.exit(main())
