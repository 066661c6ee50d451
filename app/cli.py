"""`eagle-panel`: the headless commands and the entry to the panel.

Exit status: 0 ok, 1 a stage failed (doctor: a blocking finding), 2 bad input
(config, run directory, arguments), 3 another launcher holds the run, 130 cancelled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from app import fmt
from pipeline import config as config_mod
from pipeline import runner
from pipeline.config import STAGE_NAMES, ConfigError
from pipeline.events import EventTail, last_event, tail_lines
from pipeline.rundir import RunDir, RunDirError, list_runs

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_BUSY, EXIT_CANCELLED = 1, 2, 3, 130


def _load_config(path: str | None) -> config_mod.Config:
    return config_mod.load(path or config_mod.default_config_path())


def _runs_dir(args) -> Path:
    if getattr(args, "runs_dir", None):
        return Path(args.runs_dir)
    try:
        return _load_config(args.config).runs_dir()
    except ConfigError:
        return config_mod.PROJECT_ROOT / "runs"


def resolve_run(args, name: str | None) -> RunDir:
    """RUN may be a path to a run directory or a run id under the runs dir;
    no RUN means the newest run."""
    if name:
        p = Path(name)
        if p.is_dir() and (p / "state.json").exists():
            return RunDir(p)
        return RunDir(_runs_dir(args) / name).require()
    runs = list_runs(_runs_dir(args))
    if not runs:
        raise RunDirError(f"no runs in {_runs_dir(args)}; start one with `eagle-panel run`.")
    return runs[0]


# -- commands ---------------------------------------------------------------

def cmd_run(args) -> int:
    cfg = _load_config(args.config)
    rd = runner.prepare_run(cfg, args.run)
    holder = runner.busy_launcher(rd)
    if holder is not None:
        print(f"{rd.id}: a launcher (pid {holder}) is already driving this run; "
              "nothing new was started.", file=sys.stderr)
        return EXIT_BUSY
    return _start(rd, runner.load_run_config(rd), args.stage, args.force, args.wait)


def cmd_resume(args) -> int:
    rd = resolve_run(args, args.run)
    if runner.busy_launcher(rd) is not None:
        print(f"{rd.id}: a launcher is already driving this run.", file=sys.stderr)
        return EXIT_BUSY
    return _start(rd, runner.load_run_config(rd), None, False, args.wait)


def _start(rd: RunDir, cfg, only, force, wait) -> int:
    state = runner.refresh(rd)
    steps = runner.plan(cfg, state, only, force)
    for step in steps:
        print(f"  {step.stage:8} {step.action:7} {step.why}")
        if step.action == "blocked":
            print(f"{rd.id}: cannot run {only}: {step.why}. Run the pipeline "
                  "without --stage first.", file=sys.stderr)
            return EXIT_BAD_INPUT
    if all(s.action == "skip" for s in steps):
        print(f"{rd.id}: everything is up to date; nothing to run (--force re-runs).")
        return 0
    proc = runner.start_driver(rd, only, force)
    print(f"{rd.id}: started (driver pid {proc.pid}) in {rd.path}")
    if not wait:
        print(f"  watch: eagle-panel status {rd.id}   logs: eagle-panel logs {rd.id} STAGE -f")
        return 0
    return watch(rd, proc)


def watch(rd: RunDir, proc=None, out=sys.stdout) -> int:
    """Stream progress until the driver ends; the exit status is the pipeline's."""
    tails = {s: EventTail(rd.events_path(s), rd.events_path(s).stat().st_size
                          if rd.events_path(s).exists() else 0) for s in STAGE_NAMES}
    last_progress: dict[str, float] = {}
    # Give the driver a moment to take the lock before judging it gone.
    started = time.monotonic()
    try:
        while True:
            for s, tail in tails.items():
                for ev in tail.poll():
                    _print_event(s, ev, last_progress, out)
            state = rd.read_state()
            driving = runner.driver_alive(state) or (proc is not None and proc.poll() is None)
            if not driving and time.monotonic() - started > 2:
                for s, tail in tails.items():
                    for ev in tail.poll():
                        _print_event(s, ev, last_progress, out)
                break
            time.sleep(0.3)
    except KeyboardInterrupt:
        print(f"\n{rd.id}: stopped watching; the pipeline goes on. "
              f"`eagle-panel cancel {rd.id}` stops it.", file=out)
        return EXIT_CANCELLED
    state = runner.refresh(rd)
    statuses = [state["stages"][s]["status"] for s in STAGE_NAMES]
    if "failed" in statuses:
        return EXIT_FAILED
    if "cancelled" in statuses:
        return EXIT_CANCELLED
    _print_summary(rd, state, out)
    return 0


def _print_event(stage: str, ev: dict, last_progress: dict, out) -> None:
    t = ev.get("type")
    if t == "progress":
        now = time.monotonic()
        final = ev.get("total") and ev.get("done") == ev.get("total")
        if not final and now - last_progress.get(stage, 0) < 1.0:
            return
        last_progress[stage] = now
        print(f"[{stage}] {fmt.progress_text(ev)}", file=out, flush=True)
    elif t in ("warning", "error"):
        hint = f" (hint: {ev['hint']})" if ev.get("hint") else ""
        print(f"[{stage}] {t.upper()}: {ev.get('message')}{hint}", file=out, flush=True)
    elif t == "stage_started":
        print(f"[{stage}] started (attempt {ev.get('attempt')})", file=out, flush=True)
    elif t == "stage_finished":
        summary = ev.get("summary") or {}
        brief = ", ".join(f"{k}={v}" for k, v in summary.items()
                          if isinstance(v, (int, float, str)) and len(str(v)) < 80)
        print(f"[{stage}] {ev.get('status')} in {fmt.duration(ev.get('duration_s'))}"
              + (f": {brief}" if brief else ""), file=out, flush=True)
    elif t == "artifact":
        print(f"[{stage}] wrote {ev.get('kind')}: {ev.get('path')}", file=out, flush=True)


def _print_summary(rd: RunDir, state: dict, out) -> None:
    fin = last_event(rd.events_path("train"), ("stage_finished",))
    summary = (fin or {}).get("summary") or {}
    if summary.get("checkpoint"):
        print(f"\ntrained draft: {summary['checkpoint']}", file=out)
    if summary.get("acceptance_length") is not None:
        print(f"estimated acceptance length (greedy chain, validation): "
              f"{summary['acceptance_length']:.2f}", file=out)


def status_rows(rd: RunDir) -> tuple[dict, list[dict]]:
    state = runner.refresh(rd)
    now = time.time()
    rows = []
    for s in STAGE_NAMES:
        st = state["stages"][s]
        prog = last_event(rd.events_path(s), ("progress",)) if st["attempt"] else None
        rows.append({
            "stage": s, "status": st["status"], "attempt": st["attempt"],
            "duration_s": fmt.stage_duration(st, now), "exit_code": st.get("exit_code"),
            "signal": st.get("signal"), "pid": st.get("pid"), "devices": st.get("devices"),
            "fingerprint": st.get("fingerprint"), "reason": st.get("reason"),
            "progress": prog,
        })
    return state, rows


def cmd_status(args) -> int:
    rd = resolve_run(args, args.run)
    state, rows = status_rows(rd)
    driver = state.get("driver") or {}
    if args.json:
        json.dump({"run_id": rd.id, "path": str(rd.path),
                   "driver_pid": driver.get("pid") if runner.driver_alive(state) else None,
                   "stages": rows}, sys.stdout, indent=1, default=str)
        print()
        return 0
    drv = f"driver pid {driver['pid']}" if runner.driver_alive(state) else "no launcher running"
    print(f"run {rd.id}  ({rd.path})  {drv}")
    print(f"{'STAGE':8} {'STATUS':10} {'ATT':>3}  {'DURATION':>8}  {'EXIT':7} PROGRESS")
    for r in rows:
        exit_ = fmt.exit_text(r)
        print(f"{r['stage']:8} {r['status']:10} {r['attempt']:>3}  "
              f"{fmt.duration(r['duration_s']):>8}  {exit_:7} {fmt.progress_text(r['progress'])}")
        if r["reason"]:
            print(f"{'':8} note: {r['reason']}")
    return 0


def cmd_cancel(args) -> int:
    rd = resolve_run(args, args.run)
    try:
        cfg = runner.load_run_config(rd)
        grace, term = cfg.runtime.cancel_grace_s, cfg.runtime.term_grace_s
    except ConfigError:
        grace, term = 30.0, 10.0
    if args.grace is not None:
        grace = args.grace
    results = runner.cancel_run(rd, args.stage, grace, term)
    if not any(r.was_running for r in results):
        print(f"{rd.id}: nothing running" + (f" in {args.stage}" if args.stage else "") + ".")
        return 0
    code = 0
    for r in results:
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
    lines, size = tail_lines(path, args.lines)
    out = sys.stdout.buffer
    for line in lines:
        out.write(line + b"\n")
    out.flush()
    if not args.follow:
        return 0
    offset = size
    try:
        while True:
            try:
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
    for rd in runs:
        try:
            state = rd.read_state()
            summary = " ".join(f"{s}:{state['stages'][s]['status']}" for s in STAGE_NAMES)
            created = time.strftime("%Y-%m-%d %H:%M", time.localtime(state.get("created_at", 0)))
        except RunDirError as e:
            summary, created = f"(unreadable: {e})", "?"
        print(f"{rd.id:24} {created}  {summary}")
    return 0


def cmd_doctor(args) -> int:
    from pipeline import doctor
    # GPU presence is one of doctor's findings, not a reason to refuse the config.
    cfg = config_mod.load(args.config or config_mod.default_config_path(), gpu_count=None)
    findings = doctor.diagnose(cfg)
    print(doctor.as_json(findings) if args.json else doctor.as_text(findings))
    return EXIT_FAILED if doctor.blocking(findings) else 0


def cmd_ui(args) -> int:
    try:
        from app.panel import run_panel
    except ImportError as e:
        print(f"the panel is not available: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_panel(args)


# -- argument parsing ---------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="eagle-panel",
        description="Run and watch the EAGLE-3 draft training pipeline. "
                    "Without a command, opens the panel.")
    ap.add_argument("--config", help="pipeline config (default: ./config.toml, else the bundled one)")
    ap.add_argument("--runs-dir", help="where runs live (default: [run] runs_dir of the config)")
    sub = ap.add_subparsers(dest="command")

    p = sub.add_parser("run", help="start the pipeline (or one stage); returns at once unless --wait")
    p.add_argument("--run", help="run id (default: [run] name); an existing run is continued")
    p.add_argument("--stage", choices=STAGE_NAMES, help="run only this stage")
    p.add_argument("--force", action="store_true", help="re-run even up-to-date stages, from scratch")
    p.add_argument("--wait", action="store_true", help="stream progress; exit with the pipeline's status")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="stages, status, attempt, duration, exit, last progress")
    p.add_argument("run", nargs="?", help="run id or path (default: the newest run)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("resume", help="restart from the first stage that has not succeeded")
    p.add_argument("run", nargs="?")
    p.add_argument("--wait", action="store_true")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("cancel", help="stop the running stage: SIGINT, then SIGTERM, then SIGKILL")
    p.add_argument("run", nargs="?")
    p.add_argument("--stage", choices=STAGE_NAMES, help="only this stage (default: the pipeline)")
    p.add_argument("--grace", type=float, help="seconds to wait after SIGINT "
                                               "(default: [runtime] cancel_grace_s)")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("logs", help="a stage's log")
    p.add_argument("run", nargs="?", help="run id or path (default: the newest run)")
    p.add_argument("stage", choices=STAGE_NAMES)
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("runs", help="list runs, newest first")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("doctor", help="check the environment, GPUs, target model, vLLM "
                                      "compatibility, KV-cache and disk plans; exit 1 if blocked")
    p.add_argument("--json", action="store_true", help="machine-readable findings")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("ui", help="open the panel")
    p.add_argument("run", nargs="?")
    p.add_argument("--simulate-gpus", type=int, default=0, metavar="N",
                   help="show N simulated GPUs (demo / machines without GPUs)")
    p.add_argument("--interval", type=float, default=1.0,
                   help="GPU sampling interval in seconds (at least 0.5)")
    p.add_argument("--refresh", type=float, default=2.0,
                   help="seconds between redraws of the GPU rows (history keeps every sample)")
    p.set_defaults(func=cmd_ui)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    # `eagle-panel logs STAGE` (no RUN): argparse would take STAGE as RUN.
    if len(argv) >= 1 and "logs" in argv:
        i = argv.index("logs")
        rest = [a for a in argv[i + 1:] if not a.startswith("-")]
        if len(rest) == 1 and rest[0] in STAGE_NAMES:
            argv = argv[:i + 1] + ["", *argv[i + 1:]]
    args = ap.parse_args(argv)
    if not args.command:
        args.run, args.simulate_gpus, args.interval, args.refresh = None, 0, 1.0, 2.0
        args.func = cmd_ui
    try:
        return args.func(args)
    except (ConfigError, RunDirError) as e:
        print(f"eagle-panel: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
