"""A stand-in stage for the runner's tests: a real process whose behaviour
is chosen by STAGEKIT in its environment (per stage via [stages.X.env]).

  ok | sleep:S | sleep_once:S | gate (until <stage dir>/gate exists) | fail:CODE |
  fail_once | sigkill | ignore_term:S | grandchild:S |
  events:N | flood:S | graceful:S (writes graceful.ready once its SIGINT handler is in;
  exits 130 on SIGINT after writing graceful.marker)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from pipeline.run.events import EventWriter
from pipeline.run.rundir import RunDir

# What a stage running vLLM's engine in its own process leaves in its log when vLLM
# fails: the cause behind vLLM's prefix, a wrapper that only points at it, the end.
VLLM_CRASH = ["(EngineCore_DP0 pid=12) INFO 11-29 10:00:00 [core.py:1] loading",
              "(EngineCore_DP0 pid=12) ERROR 11-29 10:00:01 [core.py:2] KV cache too small",
              "(APIServer pid=3) ERROR 11-29 10:00:02 [api.py:3] EngineDeadError: see above",
              "shutting down"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--config", required=True)
    a = ap.parse_args()
    stage = os.environ["EAGLE_PANEL_STAGE"]
    rd = RunDir(a.run_dir)
    ev = EventWriter(rd.events_path(stage))
    if os.environ.get("STAGEKIT_COUNT"):
        with open(os.environ["STAGEKIT_COUNT"], "a") as f:
            f.write(f"{stage} {os.getpid()}\n")
    action, _, arg = os.environ.get("STAGEKIT", "ok").partition(":")
    print(f"stagekit {stage}: {action} {arg}", flush=True)
    t0 = time.time()
    if action == "sleep_once":  # sleeps on the first attempt only
        action = "sleep" if os.environ.get("EAGLE_PANEL_ATTEMPT") == "1" else "ok"
        arg = arg if action == "sleep" else ""
    if action == "sleep":
        total = float(arg)
        steps = max(1, int(total / 0.1))
        for i in range(steps):
            time.sleep(total / steps)
            ev.emit("progress", done=i + 1, total=steps, unit="steps")
    elif action == "gate":   # runs until the test writes <stage dir>/gate: a point it controls
        gate = rd.stage_dir(stage) / "gate"
        while not gate.exists():
            time.sleep(0.02)
    elif action == "fail":
        print("stagekit: failing on purpose", file=sys.stderr, flush=True)
        ev.error("failing on purpose", hint="this is a test stage")
        return int(arg or 1)
    elif action == "fail_once":
        marker = rd.stage_dir(stage) / "failed_once"
        if not marker.exists():
            marker.write_text("x")
            ev.error("first attempt fails on purpose")
            return 1
    elif action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "vllm_crash":   # dies as a stage running vLLM in its process: vLLM's log
        for line in VLLM_CRASH:    # lines, and no error event of its own
            print(line, flush=True)
        return 1
    elif action == "ignore_term":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (rd.stage_dir(stage) / "ignore_term.ready").write_text("signals ignored")
        time.sleep(float(arg))
    elif action == "grandchild":
        # A child in a session of its own (like vLLM's workers) that also
        # ignores SIGTERM, plus a plain grandchild in our group.
        # The pid file is written then renamed: tests wait for it to exist and
        # read it at once, so a plain write can be seen empty (CI did, under load).
        code = ("import os,signal,time,sys;signal.signal(signal.SIGTERM,signal.SIG_IGN);"
                "signal.signal(signal.SIGINT,signal.SIG_IGN);t=sys.argv[1]+'.tmp';"
                "open(t,'w').write(str(os.getpid()));os.replace(t,sys.argv[1]);"
                "time.sleep(600)")
        marker = rd.stage_dir(stage) / "grandchild.pid"
        subprocess.Popen([sys.executable, "-c", code, str(marker)], start_new_session=True)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        while not marker.exists():
            time.sleep(0.02)
        time.sleep(float(arg))
    elif action == "flood":  # 2,000 log lines/s and 50 metric events/s (panel benchmark)
        end, step = time.time() + float(arg), 0
        while time.time() < end:
            t = time.time()
            sys.stdout.write("".join(f"step {step} line {k} loss={1.0 / (step + 1):.4f} "
                                     "some more text to make a realistic log line\n"
                                     for k in range(40)))
            sys.stdout.flush()
            ev.emit("metric", step=step, epoch=0, split="train",
                    values={"loss": 3.0 / (1 + step / 500), "loss_0": 1.0 / (1 + step / 500),
                            "full_acc_0": min(0.9, step / 5000), "lr": 1e-4})
            ev.emit("progress", done=step, total=10 ** 6, unit="steps", rate=50.0)
            step += 1
            time.sleep(max(0.0, 0.02 - (time.time() - t)))
    elif action == "events":
        for i in range(int(arg)):
            ev.emit("metric", step=i, epoch=0, split="train",   # a loss and an accuracy curve
                    values={"loss": 1.0 / (i + 1), "full_acc_0": i / (i + 20)})
    elif action == "graceful":
        def stop(*_):
            (rd.stage_dir(stage) / "graceful.marker").write_text("saved")
            ev.emit("stage_finished", status="cancelled", duration_s=time.time() - t0, summary={})
            sys.exit(130)
        signal.signal(signal.SIGINT, stop)
        (rd.stage_dir(stage) / "graceful.ready").write_text("handler installed")
        time.sleep(float(arg))
    ev.emit("stage_finished", status="succeeded", duration_s=time.time() - t0,
             summary={"action": action})
    return 0


if __name__ == "__main__":
    sys.exit(main())
