"""Benchmark `eagle-panel watch` as a user runs it: a real terminal (a pty) at
80x24, reading a /metrics whose counters grow at every read (a LABELLED
STAND-IN server, tests/fakes/metrics_standin.py: a real vLLM's counters are
read by tests/vllm/test_vllm_pipeline.py; here the load is the panel's own)
every --interval seconds for --duration seconds, the local GPUs sampled as
the panel does.

    python bench/bench_watch.py [--duration 600] [--interval 5]
    python bench/bench_watch.py --duration 5 --interval 1    # the smallest (CI, ~15 s)

Reports: the panel's CPU (% of one core) and RSS at the start and the end
(the history is an hour of reads: bounded, so RSS flat once it is full),
bytes written to the terminal per second, and that the figures were on
screen. Targets (as the main panel's, bench/bench_panel.py): CPU <= 5%,
RSS <= 200 MB and flat, <= 2,000 B/s at 80x24 (at watch's default interval, 5 s:
each read redraws the figures, every one of which moves).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import struct
import sys
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_panel import TAIL, PanelDied, drain  # noqa: E402


def bodies(n: int) -> list[str]:
    """n reads' /metrics: a draft accepting ~2.9 tokens a step, 50 steps a read."""
    from tests.unit.test_watch import metrics_text
    return [metrics_text(50 * i, 95 * i, [45 * i, 33 * i, 17 * i], 150 * i, running=3, kv=0.3)
            for i in range(1, n + 1)]


def measure(a) -> bool:
    import psutil

    from tests.fakes.metrics_standin import MetricsStandIn
    TAIL.clear()
    reads = int(a.duration / a.interval) + 30
    with MetricsStandIn(bodies(reads), model="stand-in") as server:
        env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        pid, fd = pty.fork()
        if pid == 0:
            os.execvpe(sys.executable, [sys.executable, "-m", "app.cli", "watch", server.url,
                                        "--interval", str(a.interval)], env)
        try:
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            proc = psutil.Process(pid)
            drain(fd, 5)                      # start-up, the first reads
            rss = [proc.memory_info().rss / 2 ** 20]
            cpu0, t0, nbytes, seen = sum(proc.cpu_times()[:2]), time.monotonic(), 0, False
            while time.monotonic() - t0 < a.duration:
                n = drain(fd, min(10.0, a.duration))
                nbytes += n
                seen |= b"acceptance length" in TAIL
                rss.append(proc.memory_info().rss / 2 ** 20)
            elapsed = time.monotonic() - t0
            cpu = (sum(proc.cpu_times()[:2]) - cpu0) / elapsed * 100
            os.write(fd, b"q")
            os.waitpid(pid, 0)
        except PanelDied as e:
            print(f"the watch panel died:\n{e}")
            return False
        read_count = server.reads
    print(f"watch at 80x24, a read every {a.interval:g} s, {elapsed:.0f} s ({read_count} reads "
          "of a stand-in /metrics):")
    print(f"  CPU {cpu:.1f}% of one core (target <= 5%)")
    print(f"  RSS first {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB, max {max(rss):.0f} MiB "
          "(target <= 200 MB, flat)")
    print(f"  terminal output {nbytes / elapsed:,.0f} B/s (target <= 2,000 at 80x24)")
    print(f"  figures on screen: {'yes' if seen else 'NO'}")
    return seen and read_count >= 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--interval", type=float, default=5.0)   # watch's own default
    return 0 if measure(ap.parse_args()) else 1


if __name__ == "__main__":
    sys.exit(main())
