"""doctor's checks of the config's run directory, when it exists: the
versions its stages ran with against the installed ones, who can read it
(it holds the user's data), and the processes its ended stages left
running."""

from __future__ import annotations

from pipeline.doctor.findings import OK, WARN, Finding, check
from pipeline.doctor.inputs import Inputs
from pipeline.run.rundir import RunDir


@check(190)
def check_versions(x: Inputs) -> list[Finding]:
    """Resuming a run with other versions than it started with: its numbers
    would come from two stacks (pipeline.run.provenance)."""
    from pipeline.run import provenance
    from pipeline.stage_graph import STAGE_NAMES
    if not x.packages:
        return []
    rd = RunDir(x.cfg.runs_dir() / x.cfg.run.name)
    recorded = provenance.read_run(rd.path, STAGE_NAMES)
    if not recorded:
        return []
    changed = provenance.changed_versions(recorded, x.packages, x.env.get("python"),
                                          x.vllm.version if x.vllm is not None else None)
    if not changed:
        return [Finding("versions", OK, f"{rd.id}: the same versions as its stages ran with "
                        f"({', '.join(sorted(recorded))})")]
    return [Finding("versions", WARN, f"{rd.id} ran with other versions than are installed "
                    f"now: {'; '.join(changed)}", "resuming mixes results of both; `run --force` "
                    "re-runs from scratch, or restore the versions (status --json has them)")]


@check(200)
def check_privacy(x: Inputs) -> list[Finding]:
    """The run directory holds the user's data: others must not read it."""
    import stat
    rd = RunDir(x.cfg.runs_dir() / x.cfg.run.name)
    if not rd.path.exists():
        return [Finding("privacy", OK, f"{rd.path} will be created readable by you only"
                        + (" and your group" if x.cfg.run.shared else ""))]
    mode = rd.path.stat().st_mode
    if mode & (stat.S_IROTH | stat.S_IXOTH):
        return [Finding("privacy", WARN, f"{rd.path} can be read by other users "
                        f"(mode {stat.filemode(mode)}): its datasets, hidden states and "
                        "draft are your data", f"chmod 700 {rd.path}")]
    if mode & (stat.S_IRGRP | stat.S_IXGRP) and not x.cfg.run.shared:
        return [Finding("privacy", WARN, f"{rd.path} can be read by your group "
                        f"(mode {stat.filemode(mode)}) and [run] shared is false",
                        f"chmod 700 {rd.path}, or set [run] shared = true")]
    return [Finding("privacy", OK, f"{rd.path} is readable by you"
                    + (" and your group" if mode & stat.S_IRGRP else " only"))]


@check(220)
def check_survivors(x: Inputs) -> list[Finding]:
    """Processes the config's run's ended stages left running (a vLLM server
    whose EngineCore kept its GPU memory): each with its pid."""
    from pipeline.run.executor import Executor
    from pipeline.run.leftovers import survivor_lines
    rd = RunDir(x.cfg.runs_dir() / x.cfg.run.name)
    try:
        state = rd.read_state() if rd.is_run() else None
    except Exception:  # noqa: BLE001 - a damaged run is the readers' to name, not doctor's
        state = None
    # Survivors are local processes, and a Slurm job's rows are skipped whatever answers:
    # the local executor (no scheduler need be registered for doctor to say this)
    lines = survivor_lines(state, Executor().alive) if state else []
    return [Finding("processes", WARN, f"{rd.id}: {lines[0]}", lines[1])] if lines else []
