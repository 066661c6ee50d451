"""A run's state.json checked against what still runs.

`observe` is the readers' (the panel, `status`, watchers): the state as it
is, in memory only. `reconcile` is the launchers' (control before it plans,
the driver while it waits): the same, recorded, and what the gone stages
left running stopped. Both ask whether a stage runs of the run's executor
(pipeline.run.executor), given explicitly or looked up for the run, never
guessed: a Slurm run read without Slurm's executor raises.
"""

from __future__ import annotations

import time

from pipeline.run.diskspace import DiskFull
from pipeline.run.events import EventType, last_event
from pipeline.run.executor import ALIVE, GONE, UNKNOWN, Executor, driver_alive, for_run, unverifiable
from pipeline.run.rundir import RunDir, Status
from pipeline.stage_graph import STAGE_NAMES


def _being_launched(st: dict, launching: bool) -> bool:
    """Marked running, not started yet (no supervisor, no job), by a live launcher."""
    return launching and st.get("supervisor_pid") is None and not st.get("slurm_job")


def not_alive(state: dict, ex: Executor) -> dict[str, str]:
    """Stages marked running that are not (verifiably) alive: stage -> GONE
    or UNKNOWN. A stage whose supervisor pid is not written yet is being
    launched right now, as long as the launcher doing it is alive."""
    launching = driver_alive(state)
    out = {}
    for s, st in state["stages"].items():
        if st["status"] == Status.RUNNING and not _being_launched(st, launching):
            how = ex.liveness(st)
            if how != ALIVE:
                out[s] = how
    return out


def observe(rd: RunDir, ex: Executor | None = None) -> dict:
    """The run's state as it is, for readers: a stage marked running whose
    processes are all gone (the machine rebooted, someone killed the
    supervisor) is shown as what `reconcile` will record; one whose identity
    cannot be verified as "unknown", with the command that clears it; a
    succeeded stage whose outputs are gone as "outputs missing". Nothing is
    written and nothing is stopped: any number of panels and users may look
    at a run without changing it."""
    ex = ex or for_run(rd)
    state = rd.read_state()
    found = not_alive(state, ex)
    dead = [s for s, how in found.items() if how == GONE]
    if dead:
        _mark_gone(rd, state, dead, ex)
    for s in (s for s, how in found.items() if how == UNKNOWN):
        st = state["stages"][s]
        st.update(status=Status.UNKNOWN, reason=f"{unverifiable(st)}: it cannot be told from "
                  "an unrelated process, so nothing of it is signalled. `eagle-panel resume "
                  f"{rd.id}` (or `eagle-panel cancel {rd.id} --stage {s}`) records it as "
                  "ended and stops only what carries its token.")
    mark_missing(rd, state)
    return state


def mark_missing(rd: RunDir, state: dict) -> None:
    """A succeeded stage whose out/ folder is gone is shown (and planned) as
    "outputs missing", in memory only: `resume` re-runs it."""
    for s, st in state["stages"].items():
        why = rd.outputs_missing(s) if st["status"] == Status.SUCCEEDED and s in STAGE_NAMES \
            else None
        if why:
            st.update(status=Status.MISSING, reason=f"succeeded (attempt {st['attempt']}), but "
                      f"its outputs are gone ({why}); `eagle-panel resume {rd.id}` re-runs it")


def reconcile(rd: RunDir, ex: Executor | None = None) -> dict:
    """What `observe` sees, recorded in state.json, and what the gone stages
    left running stopped. Only launchers call it: they hold, or are about
    to take, the run. The unknown stages are recorded as ended too (nothing
    of theirs can be verified to run; their token's processes are stopped,
    nothing else)."""
    ex = ex or for_run(rd)
    state = rd.read_state()
    dead = list(not_alive(state, ex))
    if not dead:
        mark_missing(rd, state)
        return state
    try:
        with rd.mutate_state() as state:
            dead = list(not_alive(state, ex))   # again, under the state lock
            _mark_gone(rd, state, dead, ex)
    except DiskFull:
        # Nothing can be recorded on a full disk: show it as it is, unsaved.
        state = rd.read_state()
        _mark_gone(rd, state, dead, ex, why="the run directory's disk is full")
    _stop_orphans([state["stages"][s] for s in dead
                   if not state["stages"][s].get("slurm_job")])
    mark_missing(rd, state)
    return state


def _mark_gone(rd: RunDir, state: dict, dead: list[str], ex: Executor, why: str = "") -> None:
    for s in dead:
        st = state["stages"][s]
        if ex.liveness(st) == UNKNOWN:
            st.update(status=Status.CANCELLED if st.get("cancel_requested") else Status.FAILED,
                      ended_at=st.get("ended_at") or time.time(),
                      reason=f"recorded as ended: {unverifiable(st)}, so it could not be "
                             "verified to run (only processes carrying its token were stopped)")
            continue
        said = _last_word(rd, s)
        if said in (Status.SUCCEEDED, Status.SKIPPED):
            # Its supervisor was killed, the stage went on and finished:
            # its own last event says so; nothing to redo.
            st.update(status=said, ended_at=st.get("ended_at") or time.time(),
                      reason="recorded from the stage's own last event (its supervisor "
                             "was gone)")
            continue
        how = why or ex.describe(st) or "machine restart or supervisor killed"
        st.update(status=Status.CANCELLED if st.get("cancel_requested") else Status.FAILED,
                  ended_at=st.get("ended_at") or time.time(),
                  reason=f"the stage and its supervisor are gone without recording an exit "
                         f"({how})")


def _last_word(rd: RunDir, stage: str) -> str | None:
    ev = last_event(rd.events_path(stage), (EventType.STAGE_STARTED, EventType.STAGE_FINISHED))
    return ev.get("status") if ev and ev.get("type") == EventType.STAGE_FINISHED else None


def _stop_orphans(stages: list[dict]) -> None:
    """What a stage gone without its supervisor left running (a vLLM server,
    its renamed EngineCore and workers): found by the attempt's token and
    its supervisor's session (never by a process group, which may have been
    reused; pipeline.run.leftovers), stopped."""
    from pipeline.run.leftovers import stop_attempt
    for st in stages:
        if st.get("token"):
            stop_attempt(st, term_grace=2.0, kill_grace=2.0)
