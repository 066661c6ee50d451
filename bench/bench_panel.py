"""Benchmark the panel as a user runs it: a real terminal (a pty), 8
simulated GPUs at 1 Hz, a stage writing 2,000 log lines/s and 50 metric
events/s.

    python bench/bench_panel.py [--duration 120] [--size 80x24]

The smallest size (CI, ~25 s: start-up, one 5 s window, 20 key presses):
    python bench/bench_panel.py --duration 5

Reports: CPU (% of one core) and RSS over time, bytes written to the
terminal per second in steady state, key press to screen update latency
(p50/p95), and the loss chart's redraw time with 100,000 points.
Targets (issue 4): CPU <= 5% avg, RSS <= 200 MB and flat, key p95 <= 100 ms,
chart <= 50 ms, <= 2,000 B/s at 80x24.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


TAIL = bytearray()  # the terminal's last bytes: a crashed panel's traceback is there


class PanelDied(Exception):
    pass


def read(fd) -> int:
    try:
        data = os.read(fd, 65536)
    except OSError:  # EIO: the panel exited
        raise PanelDied(TAIL[-6000:].decode(errors="replace")) from None
    TAIL.extend(data)
    del TAIL[:-65536]
    return len(data)


def drain(fd, seconds: float) -> int:
    """Read the terminal for `seconds`; returns bytes read."""
    n, end = 0, time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return n
        r, _, _ = select.select([fd], [], [], left)
        if r:
            n += read(fd)


def key_latency(fd, keys, settle=0.4) -> list[float]:
    """Time from writing a key to the first byte of the screen's answer."""
    out = []
    for k in keys:
        drain(fd, settle)
        t0 = time.perf_counter()
        os.write(fd, k.encode())
        r, _, _ = select.select([fd], [], [], 2.0)
        if r:
            read(fd)
            out.append(time.perf_counter() - t0)
    return out


def chart_ms() -> float:
    import numpy as np

    from widgets.loss_chart import plot
    x = np.arange(100_000, dtype=float)
    series = [(f"loss_{i}", x, 3 * np.exp(-x / (20_000 + 5000 * i)) + 0.05 * np.random.rand(len(x)))
              for i in range(3)]
    t0 = time.perf_counter()
    for _ in range(20):
        plot(series, 80, 14, smooth=True)
    return (time.perf_counter() - t0) / 20 * 1000


def main():
    import psutil
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--size", default="80x24")
    ap.add_argument("--simulate", type=int, default=8,
                    help="simulated GPUs; 0 = the machine's real GPUs through NVML")
    ap.add_argument("--view", default="train-log",
                    choices=["train-log", "quiet-log", "gpus", "training"],
                    help="what is on screen: the flooding stage's log (worst case), a quiet "
                         "stage's log, the GPU tab or the training curves")
    a = ap.parse_args()
    cols, rows = map(int, a.size.split("x"))
    from tests.conftest import stagekit_config
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
        tmp = Path(d)
        stagekit_config(tmp, {"train": f"flood:{a.duration + 60}"})
        env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        subprocess.run([sys.executable, "-m", "app.cli", "run"], cwd=tmp, env=env, check=True,
                       capture_output=True)
        pid, fd = pty.fork()
        if pid == 0:
            os.chdir(tmp)
            sim = ["--simulate-gpus", str(a.simulate)] if a.simulate else []
            os.execvpe(sys.executable, [sys.executable, "-m", "app.cli", "ui", *sim], env)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        proc = psutil.Process(pid)
        drain(fd, 5)                      # start-up
        if a.view == "train-log":
            os.write(fd, b"\x1b[B\x1b[B\x1b[B")  # select train: its flooding log is shown
        elif a.view == "gpus":
            os.write(fd, b"2")
        elif a.view == "training":
            os.write(fd, b"4")
        drain(fd, 5)
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        nbytes, rss = 0, []
        while time.monotonic() - t0 < a.duration:
            nbytes += drain(fd, min(10.0, a.duration))
            rss.append(proc.memory_info().rss / 2 ** 20)
        elapsed = time.monotonic() - t0
        cpu = (sum(proc.cpu_times()[:2]) - cpu0) / elapsed * 100
        # Tab switches, starting with one that changes what is shown.
        keys = (["1", "2"] if a.view == "gpus" else ["2", "1"]) * 10
        raw = key_latency(fd, keys)
        by_key = {k: [round(v * 1000) for kk, v in zip(keys, raw, strict=True) if kk == k]
                  for k in set(keys)}
        lat = sorted(raw)
        os.write(fd, b"q")
        os.waitpid(pid, 0)
        subprocess.run([sys.executable, "-m", "app.cli", "cancel", "--grace", "1"], cwd=tmp,
                       env=env, capture_output=True)
    gpus = f"{a.simulate} simulated GPUs" if a.simulate else "real GPUs (NVML)"
    print(f"panel at {cols}x{rows} showing {a.view}, {gpus}, stage writing 2,000 "
          f"lines/s + 50 metrics/s, {elapsed:.0f} s:")
    print(f"  CPU {cpu:.1f}% of one core (target <= 5%)")
    print(f"  RSS first {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB, max {max(rss):.0f} MiB "
          f"(target <= 200 MB, flat)")
    print(f"  terminal output {nbytes / elapsed:,.0f} B/s (target <= 2,000 at 80x24)")
    if lat:
        p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))]
        print(f"  key press to screen update: p50 {statistics.median(lat) * 1000:.0f} ms, "
              f"p95 {p95 * 1000:.0f} ms (target p95 <= 100 ms); per key (tab switches), ms: {by_key}")
    print(f"  loss chart redraw, 3 series x 100,000 points: {chart_ms():.1f} ms (target <= 50 ms)")


if __name__ == "__main__":
    main()
