"""Benchmark the panel as a user runs it: a real terminal (a pty), 8
simulated GPUs at 1 Hz, a stage writing 2,000 log lines/s and 50 metric
events/s.

    python bench/bench_panel.py [--duration 120] [--size 80x24] [--view train-log]

Cluster mode (`--nodes 16 --gpus-per-node 8`): as many node samplers write
`telemetry/<host>.json` into the run directory every second, each through
pipeline.cluster.node_telemetry's own `sample_forever` (SIMULATED GPUs), for
the flooding stage; the GPU tab shows one line per node (`--view gpus`) or
one node's GPUs (`--view drill`: `g` pressed once), and the key presses
measured walk the node view and its drill-down (`g`) as well as the tabs.
Several counts (`--nodes 0 2`) run one after another, 0 being one machine.

The smallest size (CI, ~25 s a run: start-up, one 5 s window, 20 key presses):
    python bench/bench_panel.py --duration 5
    python bench/bench_panel.py --duration 5 --nodes 0 2 --gpus-per-node 4   (both modes)

Reports: CPU (% of one core) and RSS over time, bytes written to the
terminal per second in steady state, key press to screen update latency
(p50/p95), and the loss chart's redraw time with 100,000 points.
Targets (issue 4): CPU <= 5% avg, RSS <= 200 MB and flat, key p95 <= 100 ms,
chart <= 50 ms, <= 2,000 B/s at 80x24; at cluster scale (issue 24): the same
with key p95 <= 50 ms and RSS flat over 30 minutes.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
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

FLOOD_STAGE = "train"   # the stage that floods its log and writes the loss curve
TAIL = bytearray()  # the terminal's last bytes: a crashed panel's traceback is there
SEEN = bytearray()  # the screen's answers to the timed key presses (what they showed)
CAPTURE = [False]   # read() keeps what it reads in SEEN


class PanelDied(Exception):
    pass


def read(fd) -> int:
    try:
        data = os.read(fd, 65536)
    except OSError:  # EIO: the panel exited
        raise PanelDied(TAIL[-6000:].decode(errors="replace")) from None
    TAIL.extend(data)
    del TAIL[:-65536]
    if CAPTURE[0]:
        SEEN.extend(data)
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


def key_latency(fd, keys, settle=0.4) -> list[float | None]:
    """Time from writing a key to the first byte of the screen's answer
    (None: no answer within 2 s)."""
    out = []
    for k in keys:
        drain(fd, settle)
        t0 = time.perf_counter()
        os.write(fd, k.encode())
        CAPTURE[0] = True
        r, _, _ = select.select([fd], [], [], 2.0)
        if r:
            read(fd)
            out.append(time.perf_counter() - t0)
        else:
            out.append(None)
        drain(fd, 0.1)   # the rest of the answer
        CAPTURE[0] = False
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


def node_samplers(run_dir: str, stage: str, nodes: int, gpus: int, interval: float = 1.0) -> None:
    """`nodes` nodes' samplers in this process, each pipeline.cluster.node_telemetry's
    own `sample_forever` (its writer, its file format, its rate) in a thread named
    for its host (node01, node02, ...), with `gpus` SIMULATED GPUs seeded per node.
    They start spread over one interval, as real nodes are not in step."""
    import socket
    import threading

    from pipeline.cluster import node_telemetry
    from pipeline.telemetry import SimulatedSource, Telemetry

    class NodeTelemetry(Telemetry):   # each node its own random walk, not node01's
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            if isinstance(self.source, SimulatedSource):
                self.source.rng.seed(threading.current_thread().name)

    os.environ[node_telemetry.SIMULATE_ENV] = str(gpus)
    node_telemetry.Telemetry = NodeTelemetry
    socket.gethostname = lambda: threading.current_thread().name   # the host each writes as
    threads = [threading.Thread(target=node_telemetry.sample_forever,
                                args=(Path(run_dir), stage, interval),
                                name=f"node{i + 1:02d}", daemon=True) for i in range(nodes)]
    for t in threads:
        t.start()
        time.sleep(interval / nodes)
    for t in threads:
        t.join()


def start_samplers(run_dir: Path, nodes: int, gpus: int, env: dict) -> subprocess.Popen:
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import bench_panel; "
            f"bench_panel.node_samplers({str(run_dir)!r}, {FLOOD_STAGE!r}, {nodes}, {gpus})")
    log = run_dir.parent.parent / "samplers.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=f)
    wanted = {f"node{i + 1:02d}.json" for i in range(nodes)}
    end = time.monotonic() + 30
    while time.monotonic() < end and p.poll() is None:
        if wanted <= {f.name for f in (run_dir / "telemetry").glob("*.json")}:
            return p
        time.sleep(0.2)
    p.kill()
    p.wait()
    raise SystemExit(f"the node samplers did not report: {log.read_text()[-3000:]}")


def keys_for(view: str, nodes: int, n: int = 20) -> list[str]:
    """`n` key presses, each changing what is shown: tab switches, starting
    with one away from the view; in cluster mode half of them, then `g` on the
    GPU tab (the node view -> node 1 -> node 2 ...)."""
    on_gpus = view in ("gpus", "drill")
    tabs = ["1", "2"] if on_gpus else ["2", "1"]
    if not nodes:
        return (tabs * n)[:n]
    first = (tabs * n)[:n // 2] + ([] if on_gpus else ["2"])
    return first + ["g"] * (n - len(first))


UP, DOWN = b"\x1b[A", b"\x1b[B"
# The panel selects the running stage by itself (train, the flooding one): up to
# the first stage, then down to the one wanted.
VIEW_KEYS = {"train-log": [UP * 5 + DOWN * 4],   # train: its flooding log is shown
             "quiet-log": [UP * 5],              # regenerate: its log, long finished
             "gpus": [b"2"], "drill": [b"2", b"g"], "training": [b"4"]}


def p50_max(ms: list) -> str:
    ms = sorted(x for x in ms if x is not None)
    return f"{ms[len(ms) // 2]} / {ms[-1]}" if ms else "-"


def measure(a, nodes: int) -> bool:
    import psutil
    cols, rows = map(int, a.size.split("x"))
    from tests.conftest import stagekit_config
    TAIL.clear()
    SEEN.clear()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
        tmp = Path(d)
        stagekit_config(tmp, {FLOOD_STAGE: f"flood:{a.duration + 60}"})
        env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        subprocess.run([sys.executable, "-m", "app.cli", "run"], cwd=tmp, env=env, check=True,
                       capture_output=True)
        samplers = start_samplers(tmp / "runs" / "t", nodes, a.gpus_per_node, env) \
            if nodes else None
        pid, fd = pty.fork()
        if pid == 0:
            os.chdir(tmp)
            sim = ["--simulate-gpus", str(a.simulate)] if a.simulate else []
            os.execvpe(sys.executable, [sys.executable, "-m", "app.cli", "ui", *sim], env)
        try:
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            proc = psutil.Process(pid)
            drain(fd, 5)                      # start-up
            for k in VIEW_KEYS[a.view]:
                os.write(fd, k)
                drain(fd, 0.5)
            drain(fd, 5)
            load0 = os.getloadavg()[0]
            cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
            nbytes, rss, windows = 0, [], []   # windows: (seconds, cpu seconds, bytes)
            flood_seen = False
            while time.monotonic() - t0 < a.duration:
                w0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
                n = drain(fd, min(10.0, a.duration))
                nbytes += n
                flood_seen |= b"realistic log line" in TAIL[-n:] if n else False
                rss.append(proc.memory_info().rss / 2 ** 20)
                windows.append((time.monotonic() - w0, sum(proc.cpu_times()[:2]) - c0, n))
            elapsed = time.monotonic() - t0
            load1 = os.getloadavg()[0]
            cpu = (sum(proc.cpu_times()[:2]) - cpu0) / elapsed * 100
            keys = keys_for(a.view, nodes, a.keys)
            raw = key_latency(fd, keys)
            os.write(fd, b"q")
            os.waitpid(pid, 0)
        finally:
            if samplers is not None:
                samplers.kill()
                samplers.wait()
            subprocess.run([sys.executable, "-m", "app.cli", "cancel", "--grace", "1"], cwd=tmp,
                           env=env, capture_output=True)
    by_key = {k: [round(v * 1000) if v is not None else None
                  for kk, v in zip(keys, raw, strict=True) if kk == k] for k in dict.fromkeys(keys)}
    if len(keys) > 20:   # too many to list: each key's p50 / max
        by_key = {k: p50_max(v) for k, v in by_key.items()}
    lat = sorted(v for v in raw if v is not None)
    gpus = f"{a.simulate} simulated GPUs" if a.simulate else "real GPUs (NVML)"
    if nodes:
        gpus = f"{nodes} nodes x {a.gpus_per_node} simulated GPUs (node samplers), local {gpus}"
    view = {"gpus": "gpus (node view)", "drill": "gpus (one node: g)"}.get(a.view, a.view) \
        if nodes else a.view
    print(f"panel at {cols}x{rows} showing {view}, {gpus}, stage writing 2,000 "
          f"lines/s + 50 metrics/s, {elapsed:.0f} s:")
    print(f"  CPU {cpu:.1f}% of one core (target <= 5%); the machine's load average "
          f"{load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    print(f"  RSS first {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB, max {max(rss):.0f} MiB "
          f"(target <= 200 MB, flat)")
    print(f"  terminal output {nbytes / elapsed:,.0f} B/s (target <= 2,000 at 80x24)")
    if elapsed >= 300:   # a long run: is anything creeping up?
        step = max(1, len(windows) // 6)
        spans = [windows[i:i + step] for i in range(0, len(windows), step)]
        print("  over time (CPU % / B/s / RSS MiB at its end), per "
              f"{sum(w[0] for w in spans[0]) / 60:.0f} min: " + ", ".join(
                  f"{sum(w[1] for w in span) / sum(w[0] for w in span) * 100:.1f}% / "
                  f"{sum(w[2] for w in span) / sum(w[0] for w in span):,.0f} / "
                  f"{rss[min(len(rss) - 1, (i + 1) * step - 1)]:.0f}"
                  for i, span in enumerate(spans)))
    if lat:
        p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))]
        target = 50 if nodes else 100
        lost = sum(v is None for v in raw)
        print(f"  key press to screen update: p50 {statistics.median(lat) * 1000:.0f} ms, "
              f"p95 {p95 * 1000:.0f} ms (target p95 <= {target} ms)"
              + (f", {lost} keys unanswered in 2 s" if lost else "")
              + f"; per key, ms{' (p50 / max)' if len(keys) > 20 else ''}: {by_key}")
    wrong = []   # the bench did not measure what it says: exit 1
    if flood_seen != (a.view == "train-log"):
        wrong.append(f"the flooding log was {'' if flood_seen else 'not '}on screen")
    if nodes:
        seen = SEEN.decode(errors="replace")
        node_view = bool(re.search(r"Node +GPUs +Memory", seen))   # its header
        drill = f"(1 of {nodes})" in seen
        print(f"  node view seen: {'yes' if node_view else 'NO'}; "
              f"drill-down (g) seen: {'yes' if drill else 'NO'}")
        wrong += ["the node view was not seen"] * (not node_view) + \
            ["the drill-down was not seen"] * (not drill)
    for w in wrong:
        print(f"  WRONG: {w}")
    return not wrong


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--size", default="80x24")
    ap.add_argument("--simulate", type=int, default=8,
                    help="simulated GPUs; 0 = the machine's real GPUs through NVML")
    ap.add_argument("--view", default="train-log",
                    choices=["train-log", "quiet-log", "gpus", "drill", "training"],
                    help="what is on screen: the flooding stage's log (worst case), a quiet "
                         "stage's log, the GPU tab (cluster mode: the node view), one node's "
                         "GPUs (cluster mode, `g`) or the training curves")
    ap.add_argument("--nodes", type=int, nargs="+", default=[0],
                    help="cluster mode: this many nodes' samplers write telemetry/<host>.json "
                         "(several counts: one run each; 0: one machine)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--keys", type=int, default=20, help="key presses timed after the window")
    a = ap.parse_args()
    if a.view == "drill" and not all(a.nodes):
        ap.error("--view drill needs cluster mode (--nodes N)")
    ok = [measure(a, nodes) for nodes in a.nodes]
    print(f"  loss chart redraw, 3 series x 100,000 points: {chart_ms():.1f} ms (target <= 50 ms)")
    sys.exit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
