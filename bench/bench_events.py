"""Benchmark the event protocol and the CLI's status on a large run.

    python bench/bench_events.py [--events 1000000] [--latency-events 500]
                                 [--throughput-events 200000]

The smallest size (CI, a few seconds):
    python bench/bench_events.py --events 2000 --latency-events 20 --throughput-events 5000

Targets (issue 2): >= 100,000 events/s tailed on one core; write-to-seen
latency p99 <= 50 ms; `eagle-panel status` <= 0.5 s on a run with 1,000,000
events.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.run.events import ChangeWaiter, EventTail, EventWriter  # noqa: E402
from pipeline.run.rundir import RunDir  # noqa: E402
from tests.configs import write  # noqa: E402


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
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n)], env=env)
    lat = []
    while len(lat) < n:
        waiter.wait(poll_s)
        now = time.time()
        for ev in tail.poll():
            lat.append(now - ev["sent"])
    proc.wait()
    waiter.close()
    return lat


def make_big_run(tmp: Path, n: int) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "config.toml"
    write(cfg, {"run": {"name": "big", "runs_dir": "runs"}})
    rd = RunDir(tmp / "runs" / "big")
    rd.create(cfg.read_text(), tmp)
    w = EventWriter(rd.events_path("train"))
    w.emit("stage_started", stage="train", attempt=1, argv=[], devices=[])
    for i in range(n):
        if i % 1000 == 0:
            w.emit("progress", done=i, total=n, unit="steps", rate=100.0, eta_s=(n - i) / 100)
        w.emit("metric", step=i, epoch=0, split="train",
               values={"loss": 1.0 / (i + 1), "full_acc_0": 0.5, "full_acc_1": 0.3, "lr": 1e-4})
    w.close()
    with open(rd.log_path("train"), "wb") as f:
        f.write(b"x" * 100 + b"\n" * 1)
    rd.update_stage("train", status="succeeded", attempt=1, started_at=time.time() - 60,
                    ended_at=time.time(), exit_code=0)
    return tmp


def bench_status(tmp: Path) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "app.cli", "status", "big"], cwd=tmp, env=env,
                       check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--latency-events", type=int, default=500)
    ap.add_argument("--throughput-events", type=int, default=200_000,
                    help="events written then tailed for the events/s figures")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        w_rate, r_rate = bench_throughput(tmp, a.throughput_events)
        print(f"write: {w_rate:,.0f} events/s   tail: {r_rate:,.0f} events/s (target >= 100,000)")
        for poll in (0.2,):
            lat = sorted(bench_latency(tmp, a.latency_events, poll))
            p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99) - 1]
            kind = "inotify" if ChangeWaiter([tmp]).native else "polling"
            print(f"latency ({kind}, {poll}s timeout): p50 {p50 * 1000:.1f} ms  "
                  f"p99 {p99 * 1000:.1f} ms  max {lat[-1] * 1000:.1f} ms (target p99 <= 50 ms)")
        big = make_big_run(tmp / "big", a.events)
        size = (big / "runs/big/train/events.jsonl").stat().st_size
        times = bench_status(big)
        print(f"status on {a.events:,} events ({size / 1e6:.0f} MB): median "
              f"{statistics.median(times):.3f} s  max {max(times):.3f} s (target <= 0.5 s)")


if __name__ == "__main__":
    main()
