"""`eagle-panel`: the headless commands and the entry to the panel.

Options go before or after the command (`eagle-panel --config F run` and
`eagle-panel run --config F` are the same); without a command it opens the
panel, so the panel's options work on the bare command too.

Exit status: 0 ok, 1 a stage failed (doctor: a blocking finding), 2 bad input
(config, run directory, arguments), 3 another launcher holds the run, 4 the run
directory's disk is full, 130 cancelled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pipeline import __version__, control, fmt
from pipeline.config import ConfigError
from pipeline.run import executor, provenance, summaries
from pipeline.run.diskspace import EXIT_DISK_FULL, NEARLY_FULL, DiskFull, free_bytes
from pipeline.run.events import EventType, tail_lines
from pipeline.run.rundir import DONE, RunDir, RunDirError, Status, check_runs_dir, list_runs
from pipeline.run.snapshot import RunReader, read_run
from pipeline.stage_graph import STAGE_NAMES
from pipeline.vllm import startup

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_BUSY, EXIT_CANCELLED = 1, 2, 3, 130


def _runs_dir(args):
    return control.runs_dir(args.config, args.runs_dir)


def resolve_run(args, name: str | None) -> RunDir:
    return control.resolve_run(_runs_dir(args), name)


# -- commands ---------------------------------------------------------------

def cmd_run(args) -> int:
    cfg = control.load_config(args.config)
    if args.runs_dir is not None:   # a first run may make it; a file there is refused
        if not args.runs_dir:
            raise RunDirError("--runs-dir '': not a folder. Name the folder the runs go in.")
        where = Path(args.runs_dir)
        cfg.run.runs_dir = str(check_runs_dir(where, "--runs-dir").resolve())
    return _start(lambda: control.launch(cfg, args.run, args.stage, args.force,
                                         skip_checks=args.skip_checks), args.wait, _where(args))


def cmd_resume(args) -> int:
    rd = resolve_run(args, args.run)
    return _start(lambda: control.resume(rd, skip_checks=args.skip_checks), args.wait,
                  _where(args))


def _where(args) -> str:
    """The options that found this run, for the commands a hint suggests
    (from the project folder, without them, `status` would read another run)."""
    import shlex
    opts = [("--config", args.config), ("--runs-dir", args.runs_dir)]
    return "".join(f" {k} {shlex.quote(str(v))}" for k, v in opts if v)


def _start(begin, wait: bool, where: str = "") -> int:
    try:
        started = begin()
    except control.Busy as e:
        print(str(e), file=sys.stderr)
        return EXIT_BUSY
    except control.Blocked as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    except control.Refused as e:
        from pipeline import doctor
        print(doctor.as_text([f for f in e.findings if f.level != doctor.OK]), file=sys.stderr)
        print(f"{e}; nothing was started. Fix the config (`eagle-panel doctor` has the whole "
              "report), or launch anyway with --skip-checks.", file=sys.stderr)
        return EXIT_BAD_INPUT
    rd = started.run
    for step in started.steps:
        print(f"  {step.stage:10} {step.action:7} {step.why}")
    if started.nothing_to_do:
        print(f"{rd.id}: everything is up to date; nothing to run (--force re-runs).")
        return 0
    print(f"{rd.id}: started (driver pid {started.driver.pid}) in {rd.path}")
    if not wait:
        print(f"  watch: eagle-panel status {rd.id}{where}   "
              f"logs: eagle-panel logs {rd.id} STAGE -f{where}")
        return 0
    return watch(rd, started.driver, expected=[s.stage for s in started.steps
                                               if s.action == "run"], where=where)


def watch(rd: RunDir, proc=None, out=sys.stdout, expected: list[str] | None = None,
          where: str = "") -> int:
    """Stream progress until the driver ends; the exit status is the pipeline's
    (a driver that stopped before the `expected` stages ran is not a success).
    `where`: the options that found the run, repeated in the commands hinted."""
    reader = RunReader(rd)
    reader.read_all()   # what happened before: taken in, not printed
    last_progress: dict[str, tuple[float, float]] = {}   # stage -> (when, share done)
    reader.on_event = lambda s, ev: _print_event(s, ev, last_progress, out)
    # Give the driver a moment to take the lock before judging it gone.
    started = time.monotonic()
    try:
        while True:
            reader.poll()
            driving = reader.driver_pid() is not None or \
                (proc is not None and proc.poll() is None)
            if not driving and time.monotonic() - started > 2:
                reader.read_all()   # the last events, printed
                break
            time.sleep(0.3)
    except KeyboardInterrupt:
        print(f"\n{rd.id}: stopped watching; the pipeline goes on. "
              f"`eagle-panel cancel {rd.id}{where}` stops it.", file=out)
        return EXIT_CANCELLED
    snap = read_run(rd)   # (state.json as it is now: liveness checked again)
    statuses = [snap.stages[s].status for s in STAGE_NAMES]
    if Status.FAILED in statuses:
        return _disk_full(rd, out) if snap.failed_for_disk() else EXIT_FAILED
    if Status.CANCELLED in statuses:
        return EXIT_CANCELLED
    left = [s for s in expected or [] if snap.stages[s].status not in DONE]
    if left:
        code = proc.poll() if proc is not None else None
        if code == EXIT_DISK_FULL or free_bytes(rd.path) < NEARLY_FULL:
            return _disk_full(rd, out)
        print(f"{rd.id}: the launcher stopped before {left[0]} ran (see "
              f"{rd.path / 'driver.log'}); `eagle-panel resume {rd.id}{where}` continues.",
              file=out)
        return EXIT_FAILED
    for line in outcome_lines(snap):
        print(line, file=out)
    return 0


def _isatty(out) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _disk_full(rd: RunDir, out) -> int:
    """Say it here: the stage or the launcher may not have been able to."""
    full = DiskFull(rd.path)
    print(f"{rd.id}: {full}. {full.hint}", file=out, flush=True)
    return EXIT_DISK_FULL


# Off a terminal (a file, a pipe, CI's log) progress is printed the way pip
# and tqdm print there: a line when a tenth more is done or half a minute has
# passed, not one per event (a train stage makes hundreds).
PROGRESS_EVERY_S = {True: 1.0, False: 30.0}
PROGRESS_STEP = 0.1


def _print_event(stage: str, ev: dict, last_progress: dict, out) -> None:
    t = ev.get("type")
    if t == EventType.PROGRESS:
        now = time.monotonic()
        total, done = ev.get("total"), ev.get("done") or 0
        final = total and done == total
        tty = _isatty(out)
        at, share = last_progress.get(stage, (-1e9, -1.0))
        frac = done / total if total else None
        moved = frac is not None and not tty and frac - share >= PROGRESS_STEP
        if not (final or moved or now - at >= PROGRESS_EVERY_S[tty]):
            return
        last_progress[stage] = (now, frac if frac is not None else share)
        print(f"[{stage}] {fmt.progress_text(ev)}", file=out, flush=True)
    elif t in (EventType.WARNING, EventType.ERROR):
        hint = f" (hint: {ev['hint']})" if ev.get("hint") else ""
        print(f"[{stage}] {t.upper()}: {ev.get('message')}{hint}", file=out, flush=True)
    elif t == EventType.STAGE_STARTED:
        print(f"[{stage}] started (attempt {ev.get('attempt')})", file=out, flush=True)
    elif t == EventType.STAGE_FINISHED:
        brief = fmt.summary_text(stage, summaries.read(stage, ev.get("summary")))
        print(f"[{stage}] {ev.get('status')} in {fmt.duration(ev.get('duration_s'))}"
              + (f": {brief}" if brief else ""), file=out, flush=True)
    elif t == EventType.ARTIFACT:
        print(f"[{stage}] wrote {ev.get('kind')}: {ev.get('path')}", file=out, flush=True)
    elif t == EventType.SERVER:
        # a line per phase, per shard tenth and when it stalls: not per report
        key = (ev.get("phase"), (ev.get("done") or 0) * 10 // max(1, ev.get("total") or 1),
               bool(ev.get("stalled_s")))
        if last_progress.get((stage, "server", ev.get("server"))) != key:
            last_progress[(stage, "server", ev.get("server"))] = key
            print(f"[{stage}] {ev.get('label', 'vLLM server')} {ev.get('server')}: "
                  f"{startup.describe(ev)}", file=out, flush=True)


def outcome_lines(snap) -> list[str]:
    lines = fmt.outcome_lines(snap.stages["train"].summary, snap.stages["evaluate"].summary,
                              snap.stages["evaluate"].state, snap.run_id)
    loads = fmt.target_loads_line([(s.name, s.target_loads, s.loading_s,
                                    sum(a.seconds or 0.0 for a in s.attempts))
                                   for s in snap.stages.values()])
    return (lines or [""]) + [loads] if loads else lines


def status_rows(snap, now: float | None = None) -> list[dict]:
    """`status --json`'s stages: one row per stage of the snapshot."""
    now = time.time() if now is None else now
    rows = []
    for st in snap.stages.values():
        reason = st.reason
        if st.slurm_job and st.running:   # pending in the queue, or running: Slurm's words
            reason = reason or st.job or f"Slurm job {st.slurm_job}"
        rows.append({
            "stage": st.name, "status": st.status, "attempt": st.attempt,
            "duration_s": st.seconds(now), "exit_code": st.exit_code, "signal": st.signal,
            "pid": st.pid, "devices": list(st.devices), "fingerprint": st.state.get("fingerprint"),
            "reason": reason, "slurm_job": st.slurm_job,
            "progress": dict(st.progress.event) if st.progress and st.attempt else None,
            "attempts": [{"attempt": a.number, "status": a.status, "duration_s": a.seconds}
                         for a in st.attempts],
            "servers": [dict(v.event) for v in st.servers] if st.running else [],
            "kv_cache": dict(kv) if (kv := st.kv_cache()) else None,
            "summary": st.summary.to_json() if st.finished else {},
        })
    return rows


def cmd_status(args) -> int:
    rd = resolve_run(args, args.run)
    rd.check_readable()   # a damaged file is named before anything is printed
    ex = executor.for_run(rd)
    snap = read_run(rd, ex)
    rows = status_rows(snap)
    state = {"stages": {name: dict(st.state) for name, st in snap.stages.items()}}
    if args.json:
        json.dump({"run_id": rd.id, "path": str(rd.path), "driver_pid": snap.driver_pid,
                   "stages": rows, "outcome": snap.outcome(),
                   "provenance": provenance.read_run(rd.path, STAGE_NAMES),
                   "survivors": _survivors(rd, state)},
                  sys.stdout, indent=1, default=str)
        print()
        return 0
    drv = f"driver pid {snap.driver_pid}" if snap.driver_pid else "no launcher running"
    print(f"run {rd.id}  ({rd.path})  {drv}")
    print(f"{'STAGE':10} {'STATUS':10} {'ATT':>3}  {'DURATION':>8}  {'EXIT':7} PROGRESS")
    for r in rows:
        exit_ = fmt.exit_text(r)
        print(f"{r['stage']:10} {r['status']:10} {r['attempt']:>3}  "
              f"{fmt.duration(r['duration_s']):>8}  {exit_:7} "
              f"{fmt.progress_text(r['progress'], r['status'] == Status.RUNNING)}")
        if r["reason"]:
            print(f"{'':10} note: {r['reason']}")
        for ev in r["servers"]:
            print(f"{'':10} {ev.get('label', 'vLLM server')} {ev.get('server')}: "
                  f"{startup.describe(ev)}")
            if ev.get("stalled_s"):
                print(f"{'':12} last log line: {ev.get('last_line', '')[-150:]}")
    for line in outcome_lines(snap):
        print(line)
    from pipeline.run.leftovers import survivor_lines
    for line in survivor_lines(state, ex.alive):   # (nothing is stopped here)
        print(f"warning: {line}")
    return 0


def _survivors(rd: RunDir, state: dict) -> list[dict]:
    from pipeline.run.leftovers import survivors
    return survivors(state, executor.for_run(rd).alive)


def cmd_cancel(args) -> int:
    if args.grace is not None and not 0 <= args.grace < 1e9:   # (nan fails both)
        print(f"eagle-panel: cancel --grace {args.grace}: give the seconds to wait after "
              "SIGINT, 0 or more.", file=sys.stderr)
        return EXIT_BAD_INPUT
    rd = resolve_run(args, args.run)
    results = control.cancel(rd, args.stage, args.grace)
    if not any(r.was_running for r in results):
        print(f"{rd.id}: nothing running" + (f" in {args.stage}" if args.stage else "") + ".")
        return 0
    code = 0
    for r in results:
        if r.stage is None:
            print(f"{rd.id}: the launch under way was stopped before any stage started.")
            continue
        if not r.was_running:
            print(f"{r.stage}: not running")
            continue
        st = rd.read_state()["stages"][r.stage]
        print(f"{r.stage}: {st['status']} (sent {', '.join(r.signals) or 'nothing'})")
        for pid, name in r.survivors:
            code = EXIT_FAILED
            print(f"  could not stop pid {pid}: {name}", file=sys.stderr)
    return code


def cmd_logs(args) -> int:
    rd = resolve_run(args, args.run)
    path = rd.log_path(args.stage)
    if args.server is not None:
        logs = dict(rd.server_logs(args.stage))
        if args.server not in logs:
            print(f"eagle-panel: {rd.id}: {args.stage} has no log of server {args.server!r}"
                  + (f" (its servers: {', '.join(logs)})" if logs else
                     " (it has started no vLLM server)"), file=sys.stderr)
            return EXIT_BAD_INPUT
        path = logs[args.server]
    # only a plain file inside the run: never a link to another user's file
    if rd.readable(path, "the log") is None:
        st = rd.read_state()["stages"][args.stage]
        print(f"eagle-panel: {path}: no log" + (" yet: " if args.follow else ": ")
              + (f"{args.stage} has not run in {rd.id}" if not st["attempt"] else
                 "it was removed") + (" (waiting for it)" if args.follow else "."),
              file=sys.stderr)
        if not args.follow:
            return EXIT_BAD_INPUT
    lines, size = tail_lines(path, args.lines)
    out = sys.stdout.buffer
    for line in lines:
        out.write(line + b"\n")
    out.flush()
    if not args.follow:
        return 0
    return _follow(rd, path, size, out)


def _follow(rd: RunDir, path, offset: int, out) -> int:
    """`logs -f`: what is appended, checked again on every read (the file
    may be replaced by a link meanwhile)."""
    try:
        while True:
            try:
                rd.readable(path, "the log")
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(1 << 20)
            except FileNotFoundError:
                data = b""
            if data:
                offset += len(data)
                out.write(data)
                out.flush()
            else:
                time.sleep(0.3)
    except KeyboardInterrupt:
        return 0


def cmd_runs(args) -> int:
    runs = list_runs(_runs_dir(args))
    if not runs:
        print(f"no runs in {_runs_dir(args)}")
        return 0
    code = 0
    for rd in runs:
        try:
            state = rd.read_state()
            summary = " ".join(f"{s}:{state['stages'][s]['status']}" for s in STAGE_NAMES)
            created = time.strftime("%Y-%m-%d %H:%M", time.localtime(state.get("created_at", 0)))
        except (RunDirError, OverflowError, OSError, ValueError) as e:
            # listed with the others (they are fine), named, and exit 2
            summary, created, code = f"(unreadable: {e})", "?", EXIT_BAD_INPUT
        print(f"{rd.id:24} {created}  {summary}")
    return code


def cmd_doctor(args) -> int:
    from pipeline import doctor
    # GPU presence is one of doctor's findings, not a reason to refuse the config.
    try:
        cfg = control.load_config(args.config)
    except ConfigError as e:
        if not args.json:
            raise
        # --json is read by programs: the bad config is a finding, still JSON
        print(doctor.as_json([doctor.Finding("config", doctor.BLOCK, str(e),
                                             "fix the config, then run doctor again")]))
        return EXIT_BAD_INPUT
    findings, plans = doctor.examine(cfg)
    print(doctor.as_json(findings, plans) if args.json else doctor.as_text(findings))
    return EXIT_FAILED if doctor.blocking(findings) else 0


def cmd_export(args) -> int:
    from pipeline.export import ExportError, export
    if args.to == "":
        print("eagle-panel: export --to '': name the folder to write.", file=sys.stderr)
        return EXIT_BAD_INPUT
    rd = resolve_run(args, args.run)
    try:
        to = export(rd, args.checkpoint, Path(args.to) if args.to is not None else None)
    except ExportError as e:
        print(f"eagle-panel: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported to {to} (model card: {to / 'README.md'})")
    print(f"publish it: hf upload <user>/<repo> {to}")
    return 0


def cmd_compare(args) -> int:
    from pipeline import compare
    if len(args.runs) < 1:
        print("eagle-panel: compare: name the runs to compare (ids or paths; "
              "`eagle-panel runs` lists them).", file=sys.stderr)
        return EXIT_BAD_INPUT
    rows = [compare.row(resolve_run(args, name)) for name in args.runs]
    print(compare.as_json(rows) if args.json else compare.table(rows))
    return 0


def cmd_watch(args) -> int:
    """A serving vLLM's speculative decoding (pipeline/watch/report.py)."""
    from pipeline.watch import measured, report, scrape
    try:
        target = scrape.target(args.url, args.api_key_env)
        m = measured.from_run(resolve_run(args, args.run)) if args.run else \
            measured.from_export(Path(args.draft)) if args.draft else None
    except (scrape.WatchInputError, measured.MeasuredError) as e:
        print(f"eagle-panel watch: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    log = Path(args.log) if args.log else None
    if log is not None:   # a log that cannot be written is said now, not at the first drift
        try:
            with open(log, "a"):
                pass
        except OSError as e:
            print(f"eagle-panel watch: --log {log}: {e.strerror or e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.once or args.lines or args.json:
        return report.run(target, args.watch_interval, m, args.once, args.json, sys.stdout,
                          sys.stderr, log=log)
    from app.watch_app import run_watch
    return run_watch(target, args.watch_interval, m, log)


def cmd_ui(args) -> int:
    try:
        from app.panel import run_panel
    except ImportError as e:
        print(f"the panel is not available: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_panel(args)


# -- argument parsing ---------------------------------------------------------

def _common() -> argparse.ArgumentParser:
    """Options every command takes, before or after the command: given in
    both places they must not overwrite each other, hence SUPPRESS."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", default=argparse.SUPPRESS,
                   help="pipeline config (default: ./config.toml, else the bundled one)")
    p.add_argument("--runs-dir", default=argparse.SUPPRESS,
                   help="where runs live (default: [run] runs_dir of the config)")
    return p


def _in_range(kind: type, low: float, high: float, name: str):
    """An argparse type for a number the panel takes, in [low, high]
    (argparse then says "invalid <name> value: '-3'", exit 2)."""
    def parse(text: str):
        value = kind(text)
        if not low <= value <= high:   # (nan fails both)
            raise ValueError(text)
        return value
    parse.__name__ = name
    return parse


def _panel_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--simulate-gpus", type=_in_range(int, 0, 1024, "GPU count (0 to 1024)"),
                   default=argparse.SUPPRESS, metavar="N",
                   help="show N simulated GPUs (demo / machines without GPUs)")
    p.add_argument("--interval", type=_in_range(float, 0.5, 3600, "interval (0.5 to 3600 s)"),
                   default=argparse.SUPPRESS,
                   help="GPU sampling interval in seconds (default 1, at least 0.5)")
    p.add_argument("--refresh", type=_in_range(float, 0.5, 3600, "refresh (0.5 to 3600 s)"),
                   default=argparse.SUPPRESS,
                   help="seconds between redraws of the GPU rows (default 2; history keeps "
                        "every sample)")
    return p


SKIP_CHECKS = ("launch even when doctor's launch checks block (said in the run's driver.log); "
               "for experts who know better")
DEFAULTS = {"config": None, "runs_dir": None, "simulate_gpus": 0, "interval": 1.0,
            "refresh": 2.0, "run": None}


def _count(text: str) -> int:
    """A line count for -n: a whole number, 0 or more (argparse names the option)."""
    n = int(text)
    if n < 0:
        raise ValueError(text)
    return n


_count.__name__ = "line count"   # argparse's "invalid line count value: '-5'"


def build_parser() -> argparse.ArgumentParser:
    common, panel = _common(), _panel_options()
    ap = argparse.ArgumentParser(
        prog="eagle-panel", parents=[common, panel],
        description="Run and watch the EAGLE-3 draft training pipeline. "
                    "Without a command, opens the panel.",
        epilog="Exit status: 0 ok, 1 a stage failed (doctor: a blocking finding), 2 bad "
               "input, 3 another launcher is driving the run, 4 the run directory's disk is "
               "full, 130 cancelled.")
    ap.add_argument("--version", action="version", version=f"eagle-panel {__version__}")
    sub = ap.add_subparsers(dest="command")

    def command(name, func, help_):
        p = sub.add_parser(name, parents=[common], help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    _launch_commands(command)
    _reading_commands(command)
    p = sub.add_parser("ui", parents=[common, panel], help="open the panel",
                       description="open the panel")
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.set_defaults(func=cmd_ui)
    return ap


RUN_HELP = "run id or path (default: the newest run)"


def _launch_commands(command) -> None:
    """run, resume and cancel: the commands that start or stop stages."""
    p = command("run", cmd_run, "start the pipeline (or one stage); returns at once unless --wait")
    p.add_argument("--run", help="run id (default: [run] name); an existing run is continued")
    p.add_argument("--stage", choices=STAGE_NAMES, help="run only this stage")
    p.add_argument("--force", action="store_true", help="re-run even up-to-date stages, from scratch")
    p.add_argument("--wait", action="store_true",
                   help="stream progress; exit with the pipeline's status")
    p.add_argument("--skip-checks", action="store_true", help=SKIP_CHECKS)

    p = command("resume", cmd_resume, "restart from the first stage that has not succeeded")
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--wait", action="store_true",
                   help="stream progress; exit with the pipeline's status")
    p.add_argument("--skip-checks", action="store_true", help=SKIP_CHECKS)

    p = command("cancel", cmd_cancel, "stop the running stage: SIGINT, then SIGTERM, then SIGKILL")
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--stage", choices=STAGE_NAMES, help="only this stage (default: the pipeline)")
    p.add_argument("--grace", type=float, help="seconds to wait after SIGINT "
                                               "(default: [runtime] cancel_grace_s)")


def _reading_commands(command) -> None:
    """The commands that read runs and the machine and change nothing."""
    p = command("status", cmd_status, "stages, status, attempt, duration, exit, last progress")
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--json", action="store_true")

    p = command("logs", cmd_logs, "a stage's log, or one of its vLLM servers' (--server K)")
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("stage", choices=STAGE_NAMES)
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("-n", "--lines", type=_count, default=50)
    p.add_argument("--server", metavar="K", help="the log of the stage's vLLM server K "
                   "(0, 1, ...; NODE/K on several nodes) instead of the stage's own")

    command("runs", cmd_runs, "list runs, newest first")

    p = command("doctor", cmd_doctor, "check the environments, GPUs, target model, vLLM "
                                      "compatibility, KV-cache and disk plans; exit 1 if blocked")
    p.add_argument("--json", action="store_true", help="machine-readable findings")

    p = command("export", cmd_export, "the measured draft as a folder to ship: the files vLLM "
                                      "served, d2t/t2d, a README.md model card; uploads nothing")
    p.add_argument("run", nargs="?", help=RUN_HELP)
    p.add_argument("--checkpoint", metavar="N", help="a measured checkpoint (default: the one "
                                                     "evaluate chose)")
    p.add_argument("--to", metavar="DIR", help="where (default: <run>/export/<checkpoint>)")

    p = command("watch", cmd_watch, "a panel on a serving vLLM's speculative decoding, from "
                                    "its /metrics: acceptance per draft position over the last "
                                    "minute, 10 minutes and hour, tokens/s, requests, KV cache, "
                                    "beside what evaluate measured, and a drift rule; read-only")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--run", help="the run whose measured draft the server serves")
    which.add_argument("--draft", metavar="PATH", help="an `eagle-panel export` folder the "
                                                       "server serves")
    p.add_argument("--api-key-env", metavar="VAR", help="the environment variable holding the "
                                                        "server's API key (never the key itself)")
    p.add_argument("--interval", dest="watch_interval", default=5.0, metavar="S",
                   type=_in_range(float, 0.5, 3600, "interval (0.5 to 3600 s)"),
                   help="seconds between reads (default 5)")
    p.add_argument("--once", action="store_true", help="print one interval, then exit")
    p.add_argument("--lines", action="store_true", help="print each interval until Ctrl-C "
                                                       "(no panel)")
    p.add_argument("--json", action="store_true", help="print JSON, an object per interval "
                                                      "(no panel)")
    p.add_argument("--log", metavar="FILE", help="append the drift rule's events to FILE "
                                                 "(JSON lines); nothing else is written")

    p = command("compare", cmd_compare, "runs side by side: algorithm, draft size, train time, "
                                        "disk, validation loss, vLLM's acceptance, decode speed")
    p.add_argument("runs", nargs="*", metavar="RUN", help="run ids or paths")
    p.add_argument("--json", action="store_true", help="the figures as JSON")


NEWEST = "\0"


def parse_args(argv: list[str]) -> argparse.Namespace:
    # `eagle-panel logs STAGE` (no RUN): argparse would take STAGE as RUN.
    if "logs" in argv:
        i = argv.index("logs")
        rest, after = [], argv[i + 1:]
        takes_value = ("-n", "--lines", "--server", "--config", "--runs-dir")
        for j, a in enumerate(after):
            if not a.startswith("-") and not (j and after[j - 1] in takes_value):
                rest.append(i + 1 + j)
        if len(rest) == 1 and argv[rest[0]] in STAGE_NAMES:
            # a RUN no shell can pass (NUL) just before the stage, read back as "the
            # newest": argparse fills both from one run of positionals (after
            # `--config F` too), never RUN from the stage; an empty RUN stays refused
            argv = argv[:rest[0]] + [NEWEST, *argv[rest[0]:]]
    args = build_parser().parse_args(argv)
    if getattr(args, "run", None) == NEWEST:
        args.run = None
    for key, value in DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    if not args.command:
        args.func = cmd_ui
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, RunDirError) as e:
        print(f"eagle-panel: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DiskFull as e:
        print(f"eagle-panel: {e}. {e.hint}", file=sys.stderr)
        return EXIT_DISK_FULL
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
