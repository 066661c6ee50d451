"""Benchmark the event protocol, and what reading a run costs as it grows.

    python bench/bench_events.py [--sizes 1000 1000000 10000000] [--rebuild-max 1000000]
                                 [--latency-events 500] [--throughput-events 200000]

The smallest sizes (CI, well under a minute):
    python bench/bench_events.py --sizes 1000 20000 --latency-events 20 --throughput-events 5000

For each size, a finished train stage with that many metric events (a loss
spike among them) and a progress event every 1,000; then:
- fold: the read model's checkpoint brought up to the end of the events
  (read_checkpoint.refresh: what the stage's supervisor does a few MB at a
  time while the stage runs, here all at once);
- `eagle-panel status`: 5 runs, median and max, and the peak RSS;
- the panel (headless, 100x30): from its start to its first correct screen
  (train's row "succeeded" at "N/N"), and its peak RSS;
  (status and the panel each after one unmeasured run: cold imports)
- `status` with the checkpoint deleted (the rebuild from the events, what a
  run from before the checkpoint costs), up to --rebuild-max events.
Then the ratio of the largest size's figures to the smallest's.

Targets (issues 2 and 57): >= 100,000 events/s written and tailed on one
core; write-to-seen latency p99 <= 50 ms; `status` <= 0.3 s at 1,000,000
events and within 1.5x of 1,000 at 10,000,000; the panel's first correct
screen within 1 s at <= 200 MB on 10,000,000 events.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.run import read_checkpoint  # noqa: E402
from pipeline.run.events import ChangeWaiter, EventTail, EventWriter  # noqa: E402
from pipeline.run.rundir import RunDir  # noqa: E402
from tests.configs import write  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def bench_throughput(tmp: Path, n: int) -> tuple[float, float]:
    path = tmp / "tp.jsonl"
    w = EventWriter(path)
    t0 = time.perf_counter()
    for i in range(n):
        w.emit("metric", step=i, epoch=0, split="train",
               values={"loss": 1.0 / (i + 1), "full_acc_0": 0.5, "lr": 1e-4})
    write_s = time.perf_counter() - t0
    w.close()
    tail = EventTail(path)
    t0 = time.perf_counter()
    got = 0
    while True:
        evs = tail.poll(max_bytes=4 << 20)
        if not evs:
            break
        got += len(evs)
    read_s = time.perf_counter() - t0
    assert got == n, got
    return n / write_s, n / read_s


WRITER = """
import sys, time, random
from pipeline.run.events import EventWriter
w = EventWriter(sys.argv[1]); n = int(sys.argv[2])
random.seed(0)
for i in range(n):
    time.sleep(random.uniform(0.001, 0.02))
    w.emit("progress", done=i, total=n, unit="x", sent=time.time())
"""


def bench_latency(tmp: Path, n: int, poll_s: float) -> list[float]:
    path = tmp / "lat.jsonl"
    path.touch()
    waiter = ChangeWaiter([tmp])
    tail = EventTail(path)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n)], env=ENV)
    lat = []
    while len(lat) < n:
        waiter.wait(poll_s)
        now = time.time()
        for ev in tail.poll():
            lat.append(now - ev["sent"])
    proc.wait()
    waiter.close()
    return lat


def make_big_run(tmp: Path, n: int) -> RunDir:
    """A finished train stage of n metric events, as a long training leaves it."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "config.toml"
    write(cfg, {"run": {"name": "big", "runs_dir": "runs"}})
    rd = RunDir(tmp / "runs" / "big")
    rd.create(cfg.read_text(), tmp)
    with EventWriter(rd.events_path("train")) as w:
        w.emit("stage_started", stage="train", attempt=1, argv=[], devices=[])
        for i in range(n):
            if i % 1000 == 0:
                w.emit("progress", done=i, total=n, unit="steps", rate=100.0, eta_s=(n - i) / 100)
            loss = 9.0 if i == n // 2 else 1.0 / (i + 1)   # a spike the chart must keep
            w.emit("metric", step=i, epoch=0, split="train",
                   values={"loss": loss, "full_acc_0": 0.5, "full_acc_1": 0.3, "lr": 1e-4})
        w.emit("progress", done=n, total=n, unit="steps")
        w.emit("stage_finished", status="succeeded", duration_s=60.0, summary={})
    rd.log_path("train").write_bytes(b"x" * 100 + b"\n")
    rd.update_stage("train", status="succeeded", attempt=1, started_at=time.time() - 60,
                    ended_at=time.time(), exit_code=0)
    return rd


# Peak RSS is read by the child at its exit (VmHWM, its own address space):
# wait4's ru_maxrss would also count the bench's own memory, which a
# vfork'd child inherits as its high-water mark up to its exec.
PEAK = """
import atexit, sys
def _peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            print("peak-rss-kib", line.split()[1], file=sys.stderr)
atexit.register(_peak)
"""
RUN_MODULE = PEAK + """
import runpy
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def status_once(cwd: Path) -> tuple[float, float]:
    """`eagle-panel status` on the big run: (seconds, peak RSS MiB)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", RUN_MODULE, "app.cli", "status", "big"],
                         cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate()
    return time.perf_counter() - t0, _peak_mib(p, err)


def _peak_mib(p: subprocess.Popen, err: bytes) -> float:
    """The child's peak RSS (MiB) from its last words, or exit naming what it said."""
    lines = err.decode(errors="replace").splitlines()
    if p.returncode or not lines or not lines[-1].startswith("peak-rss-kib "):
        raise SystemExit(f"{p.args[3:]} exited {p.returncode}: {err.decode()[-2000:]}")
    return int(lines[-1].split()[1]) / 1024


PANEL = PEAK + """
import time
from pathlib import Path
from app.panel import PanelApp
from pipeline.run.rundir import RunDir
from pipeline.telemetry import Telemetry
from tests.helpers import screen_text
from widgets.bars import count
n = int(sys.argv[2])
shown = f"{count(n)} steps"   # a succeeded stage's row says what it did (no bar)

async def first_screen():
    app = PanelApp(RunDir(Path(sys.argv[1])), telemetry=Telemetry(simulate=8, host=False))
    deadline = time.monotonic() + 300
    async with app.run_test(size=(100, 30)) as pilot:
        while time.monotonic() < deadline:
            text = screen_text(app)
            row = next((ln for ln in text.splitlines() if ln.lstrip().startswith("train ")), "")
            if "succeeded" in row and shown in row:
                print("shown", flush=True)
                return
            await pilot.pause(0.02)
    sys.exit(f"the panel never showed train succeeded at {shown}: " + repr(text))

import asyncio
asyncio.run(first_screen())
"""


def panel_once(rd: RunDir, n: int) -> tuple[float, float]:
    """The panel from its start to its first correct screen: (seconds, peak RSS MiB)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", PANEL, str(rd.path), str(n)], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if p.stdout.readline() != b"shown\n":   # the first correct screen
        sys.exit(f"panel: {p.stderr.read().decode()[-2000:]}")
    shown = time.perf_counter() - t0
    _, err = p.communicate()
    return shown, _peak_mib(p, err)


def measure(tmp: Path, n: int, rebuild_max: int) -> dict:
    rd = make_big_run(tmp / f"n{n}", n)
    row = {"events": n, "mb": rd.events_path("train").stat().st_size / 1e6}
    t0 = time.perf_counter()
    read_checkpoint.refresh(rd, "train")   # (the supervisor's Keeper, at once)
    row["fold_s"] = time.perf_counter() - t0
    # each measured after one unmeasured run: the first pays for cold imports
    runs = [status_once(rd.path.parent.parent) for _ in range(6)][1:]
    row["status_s"] = statistics.median(t for t, _ in runs)
    row["status_max_s"] = max(t for t, _ in runs)
    row["status_mb"] = max(m for _, m in runs)
    row["panel_s"], row["panel_mb"] = [panel_once(rd, n) for _ in range(2)][1]
    row["rebuild_s"] = None
    if n <= rebuild_max:
        read_checkpoint.path_of(rd, "train").unlink()
        row["rebuild_s"], _ = status_once(rd.path.parent.parent)
    return row


def report(rows: list[dict]) -> None:
    print(f"{'events':>12} {'MB':>7} {'fold s':>7} {'status s (max)':>15} {'RSS MiB':>8} "
          f"{'panel s':>8} {'RSS MiB':>8} {'no-ckpt status s':>17}")
    for r in rows:
        rebuild = f"{r['rebuild_s']:.2f}" if r["rebuild_s"] is not None else "-"
        print(f"{r['events']:>12,} {r['mb']:>7.0f} {r['fold_s']:>7.1f} "
              f"{r['status_s']:>7.3f} ({r['status_max_s']:.3f}) {r['status_mb']:>8.0f} "
              f"{r['panel_s']:>8.2f} {r['panel_mb']:>8.0f} {rebuild:>17}")
    big, small = rows[-1], rows[0]
    print(f"largest / smallest ({big['events']:,} / {small['events']:,} events): status "
          f"{big['status_s'] / small['status_s']:.2f}x, panel {big['panel_s'] / small['panel_s']:.2f}x "
          "(target <= 1.5x)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 1_000_000, 10_000_000],
                    help="events in the big run, one run per size, smallest first")
    ap.add_argument("--rebuild-max", type=int, default=1_000_000,
                    help="time `status` without the checkpoint up to this size")
    ap.add_argument("--latency-events", type=int, default=500)
    ap.add_argument("--throughput-events", type=int, default=200_000,
                    help="events written then tailed for the events/s figures")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        w_rate, r_rate = bench_throughput(tmp, a.throughput_events)
        print(f"write: {w_rate:,.0f} events/s   tail: {r_rate:,.0f} events/s (target >= 100,000)")
        lat = sorted(bench_latency(tmp, a.latency_events, 0.2))
        p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99) - 1]
        kind = "inotify" if ChangeWaiter([tmp]).native else "polling"
        print(f"latency ({kind}, 0.2s timeout): p50 {p50 * 1000:.1f} ms  "
              f"p99 {p99 * 1000:.1f} ms  max {lat[-1] * 1000:.1f} ms (target p99 <= 50 ms)",
              flush=True)
        rows = []
        for n in sorted(a.sizes):
            rows.append(measure(tmp, n, a.rebuild_max))
            print(f"  measured {n:,} events", flush=True)
            shutil.rmtree(tmp / f"n{n}")   # (10M events: 1.7 GB of disk)
        report(rows)


if __name__ == "__main__":
    main()
