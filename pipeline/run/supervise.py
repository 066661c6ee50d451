"""The stage supervisor: a small process in the stage's own session.

It starts the stage, records its pid, waits for it and writes the exit code or
signal into state.json. It lives in a new session of its own, so closing the
panel, losing SSH or killing the launcher does not touch it, and the stage's
end is recorded even when nobody is watching.

    python -m pipeline.run.supervise --run-dir R --stage S \
        [--log-prefix REGEX --log-pointer REGEX] -- ARGV...

The two regexes are how the stage's log lines look (a stage that runs vLLM
in its own process logs vLLM's lines): handed down by the driver, which
knows vLLM (pipeline.vllm.log_shape), so this floor does not.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from pipeline.run.diskspace import EXIT_DISK_FULL, DiskFull
from pipeline.run.events import EventType, EventWriter, last_event, tail_lines
from pipeline.run.exit_reasons import PLAIN, LogShape, explain_exit, quote_error
from pipeline.run.leftovers import start_ticks, stop_attempt
from pipeline.run.proctree import SUPERVISOR_VAR, TOKEN_VAR
from pipeline.run.read_checkpoint import Keeper
from pipeline.run.rundir import RunDir, Status, proc_start_ticks, signal_name
from pipeline.run.summaries import Summary


def _classify(code: int, cancel_requested: bool, events_path) -> tuple[str, int | None, str | None]:
    exit_code = code if code >= 0 else None
    sig = signal_name(-code) if code < 0 else None
    if code == 0:
        finished = last_event(events_path, (EventType.STAGE_STARTED, EventType.STAGE_FINISHED))
        said = finished.get("status") if finished and \
            finished.get("type") == EventType.STAGE_FINISHED else None
        if said == Status.SKIPPED:
            return Status.SKIPPED, exit_code, sig
        if not cancel_requested or said == Status.SUCCEEDED:
            return Status.SUCCEEDED, exit_code, sig
    return (Status.CANCELLED if cancel_requested else Status.FAILED), exit_code, sig


@dataclass
class Ending:
    """How the stage ended: its exit code (negative: the signal) and what is recorded."""
    code: int
    status: str
    exit_code: int | None
    signal: str | None


def supervise(rd: RunDir, stage: str, argv: list[str], shape: LogShape = PLAIN) -> int:
    # The supervisor must outlive a cancel (which signals the stage's group,
    # not ours) and a hang-up of the terminal that started it.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)

    st = rd.read_state()["stages"][stage]
    env = os.environ.copy()
    env[TOKEN_VAR] = st["token"]
    env.pop(SUPERVISOR_VAR, None)   # the supervisor's mark is its own (pipeline.run.proctree)
    events = EventWriter(rd.events_path(stage))
    events.emit(EventType.STAGE_STARTED, stage=stage, attempt=st["attempt"], argv=argv,
                devices=st["devices"])
    t0 = time.time()
    try:
        # Own process group (inside our session): cancel signals the group.
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=lambda: (os.setpgid(0, 0), _restore_signals()),
        )
    except OSError as e:
        return _could_not_start(rd, stage, argv, events, e)
    keeper = Keeper(rd, stage).start()   # the read model's checkpoint, while it runs

    try:
        # Ourselves too, where the driver started us: its own record of our pid
        # comes after its Popen returns, which on a loaded machine can be after
        # this write, and a reader between them would see a stage with no
        # supervisor.
        me = {} if os.environ.get("SLURM_JOB_ID") else {   # (a node's pid: not the driver's)
            k: v for k, v in _own_session(st).items() if k.startswith("supervisor_")
            and v is not None}
        row = rd.update_stage(stage, pid=child.pid, pgid=child.pid,
                              create_time=proc_start_ticks(child.pid), **me)
        if row.get("cancel_requested"):
            # a cancel came before this record and found no pid to signal: the
            # stage is asked to stop as that cancel would have (its SIGINT)
            os.killpg(child.pid, signal.SIGINT)
    except DiskFull:
        pass   # still waited for and stopped below; we are its recorded supervisor
    except ProcessLookupError:
        pass   # (the stage has ended already)
    code, usage = _wait(child)

    # Anything the stage left behind (a vLLM server in a process group of its
    # own, its renamed EngineCore and workers, grandchildren) must not keep
    # GPU memory or files busy: by token, by the stage's group, by our session.
    survivors = stop_attempt(_own_session(st), pgid=child.pid)
    cancel_requested = rd.read_state()["stages"][stage].get("cancel_requested", False)
    ending = Ending(code, *_classify(code, cancel_requested, rd.events_path(stage)))
    reason = None
    if survivors:
        reason = f"processes still alive after SIGKILL: {survivors}"
    _say_finished(rd, stage, events, ending, t0, shape)
    events.close()
    keeper.stop()
    rd.update_stage(stage, status=ending.status, exit_code=ending.exit_code, signal=ending.signal,
                    ended_at=time.time(), reason=reason,
                    max_rss_kb=usage.ru_maxrss if usage is not None else None)
    return 0


def _own_session(st: dict) -> dict:
    """The attempt as the sweep sees it: this supervisor as the session
    leader (the driver starts it in a session of its own; where something
    else did, e.g. a Slurm job, there is no session to sweep)."""
    me = os.getpid()
    if os.getsid(0) != me:
        return {**st, "supervisor_pid": None, "supervisor_create_time": None}
    return {**st, "supervisor_pid": me, "supervisor_create_time": start_ticks(me)}


def _could_not_start(rd: RunDir, stage: str, argv: list[str], events: EventWriter,
                     e: OSError) -> int:
    print(f"eagle-panel: cannot start {argv[0]}: {e}", file=sys.stderr, flush=True)
    events.error(f"cannot start the stage: {e}", hint="check [runtime] python in config.toml")
    events.emit(EventType.STAGE_FINISHED, status=Status.FAILED, duration_s=0.0,
                summary=Summary(error=str(e)).to_json())
    rd.update_stage(stage, status=Status.FAILED, exit_code=127, ended_at=time.time(),
                    reason=f"could not start: {e}")
    return 127


def _wait(child: subprocess.Popen):
    """Wait for the stage: (its exit code, also set as its returncode; its
    resource usage, None when it was reaped elsewhere)."""
    # wait4 also gives the stage's peak RSS, recorded for the panel and benchmarks.
    while True:
        try:
            _, wstatus, usage = os.wait4(child.pid, 0)
            break
        except ChildProcessError:
            wstatus, usage = None, None
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(wstatus) if wstatus is not None else (child.returncode or 0)
    child.returncode = code
    return code, usage


def _say_finished(rd: RunDir, stage: str, events: EventWriter, ending: Ending,
                  t0: float, shape: LogShape) -> None:
    """The stage's stage_finished event when it did not write one itself (and
    the error from its log when it failed without saying why)."""
    finished = last_event(rd.events_path(stage), (EventType.STAGE_STARTED, EventType.STAGE_FINISHED))
    if finished and finished.get("type") == EventType.STAGE_FINISHED:
        return
    own_error = last_event(rd.events_path(stage), (EventType.STAGE_STARTED, EventType.ERROR))
    if ending.status == Status.FAILED and not (own_error and own_error["type"] == EventType.ERROR):
        events.error(f"stage {stage} {explain_exit(ending.code)}; from its log:\n"
                     f"{quote_error(attempt_log(rd, stage), shape=shape)}",
                     hint=f"see {rd.log_path(stage)}; `eagle-panel resume` continues from here")
    events.emit(EventType.STAGE_FINISHED, status=ending.status,
                duration_s=round(time.time() - t0, 3),
                summary=Summary(exit_code=ending.exit_code, signal=ending.signal).to_json(),
                source="supervisor")


def attempt_log(rd: RunDir, stage: str) -> list[str]:
    """The end of the stage's log, from this attempt's header on."""
    raw, _ = tail_lines(rd.log_path(stage), 300)
    lines = [b.decode(errors="replace") for b in raw]
    start = max((i for i, ln in enumerate(lines) if ln.startswith("===== eagle-panel:")),
                default=-1)
    return lines[start + 1:]


def _restore_signals():
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.run.supervise")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--stage", required=True)
    ap.add_argument("--log-prefix", default=PLAIN.prefix, help="the stage log's line prefix")
    ap.add_argument("--log-pointer", default=PLAIN.pointer,
                    help="its wrapper errors that only point at the cause")
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.argv[1:] if a.argv and a.argv[0] == "--" else a.argv
    try:
        return supervise(RunDir(a.run_dir), a.stage, cmd, LogShape(a.log_prefix, a.log_pointer))
    except DiskFull as e:
        # The exit cannot be recorded: state.json keeps "running" with our
        # pid, which `status` and resume read as a stage gone without a word.
        with contextlib.suppress(OSError):
            print(f"eagle-panel: {a.stage}: {e}. {e.hint}", file=sys.stderr, flush=True)
        return EXIT_DISK_FULL


if __name__ == "__main__":
    sys.exit(main())
