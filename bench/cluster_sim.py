"""Extraction over N nodes with nodes failing, simulated: the shared queue's
policy (pipeline.cluster.workqueue: chunks from plan_chunks, a silent node's chunk
claimed again after lost_after_s, finished files kept) replayed over a
run's measured per-sample times.

    python bench/cluster_sim.py --run runs/demo               # a finished run's samples and rate
    python bench/cluster_sim.py --samples 50000 --tokens-per-s 23000 --mtbf-h 24 --nodes 1 2 16
    python bench/cluster_sim.py --samples 200 --trials 2 --nodes 1 2   # the smallest (CI)

Per-sample time is tokens / the node's measured tokens/s (extract's
summary in the run, divided by its node workers; or --tokens-per-s). Each node fails after an
exponential time with mean --mtbf-h and comes back after --repair-min
(0: never). Prints, per node count, the wall time, the samples redone and
the nodes lost, averaged over --trials seeds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cluster.workqueue import plan_chunks


def run_lengths(run: Path) -> tuple[list[int], float]:
    """Token counts of the run's prepared samples and extract's tokens/s."""
    from datasets import load_from_disk
    data = load_from_disk(str(run / "prepare" / "out" / "data")).with_format(None)
    lengths = [int(n) for n in data["seq_len"]]
    summary = None
    for line in (run / "extract" / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("type") == "stage_finished" and ev.get("summary"):
            summary = ev["summary"]
    if not summary or not summary.get("tokens_per_s"):
        raise SystemExit(f"{run}: extract has no finished summary with tokens_per_s")
    # A run over several nodes measured all of them: one node's share.
    nodes = max(1, len(list((run / "extract" / "queue" / "status").glob("*.json"))))
    return lengths, float(summary["tokens_per_s"]) / nodes


def simulate(lengths, tps: float, nodes: int, mtbf_s: float, repair_s: float,
             lost_after_s: float, seed: int, inflight: int = 8) -> dict:
    rng = random.Random(seed)
    chunks = plan_chunks(list(range(len(lengths))), lengths, nodes)
    done = [False] * len(lengths)
    open_chunks = list(range(len(chunks)))[::-1]      # pop() = the next chunk in the plan
    events: list[tuple[float, int, str, int]] = []    # (time, node, kind, chunk)
    alive = [True] * nodes
    fail_at = [rng.expovariate(1 / mtbf_s) if mtbf_s else float("inf") for _ in range(nodes)]
    current: dict[int, tuple[int, float]] = {}        # node -> (chunk, started at)
    redone = lost = 0
    now = 0.0

    def start(node: int, t: float) -> None:
        while open_chunks:
            k = open_chunks.pop()
            left = [i for i in chunks[k] if not done[i]]
            if not left:
                continue
            dur = sum(lengths[i] for i in left) / tps
            current[node] = (k, t)
            if t + dur < fail_at[node]:
                heapq.heappush(events, (t + dur, node, "finish", k))
            else:   # (a node idle past its failure time fails as it starts)
                heapq.heappush(events, (max(t, fail_at[node]), node, "fail", k))
            return
        heapq.heappush(events, (t + 1.0, node, "poll", -1))   # waits for a chunk to come back

    for n in range(nodes):
        start(n, 0.0)
    while events:
        now, node, kind, k = heapq.heappop(events)
        if kind == "finish":
            for i in chunks[k]:
                done[i] = True
            current.pop(node, None)
            start(node, now)
        elif kind == "fail":
            lost += 1
            alive[node] = False
            k, t0 = current.pop(node)
            elapsed = (now - t0) * tps                  # tokens it got through
            left = [i for i in chunks[k] if not done[i]]
            for i in left:
                if elapsed < lengths[i]:
                    break
                elapsed -= lengths[i]
                done[i] = True                          # its file was written: kept
            # The requests in flight on the node's servers are lost with it.
            redone += min(inflight, sum(not done[i] for i in left))
            heapq.heappush(events, (now + lost_after_s, node, "requeue", k))
            if repair_s:
                heapq.heappush(events, (now + repair_s, node, "back", -1))
        elif kind == "requeue":
            open_chunks.append(k)
        elif kind == "back":
            alive[node] = True
            fail_at[node] = now + rng.expovariate(1 / mtbf_s)
            start(node, now)
        elif kind == "poll" and alive[node]:
            if all(done):
                continue
            start(node, now)
        if all(done) and not current:
            break
    return {"wall_s": now, "redone": redone, "lost": lost, "complete": all(done)}


def _duration(s: float) -> str:
    if s != s:   # nan: no trial finished
        return "-"
    return f"{s / 3600:.2f}h" if s >= 3600 else f"{s / 60:.1f}min" if s >= 60 else f"{s:.1f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a run directory whose extract finished")
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--mean-tokens", type=int, default=1800)
    ap.add_argument("--tokens-per-s", type=float, help="one node's extraction rate")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--mtbf-h", type=float, default=24.0,
                    help="mean hours between a node's failures")
    ap.add_argument("--repair-min", type=float, default=0.0,
                    help="minutes until a failed node is back (0: never)")
    ap.add_argument("--lost-after-s", type=float, default=120.0)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--inflight", type=int, default=8, help="requests in flight per node")
    a = ap.parse_args()
    if a.run:
        lengths, tps = run_lengths(a.run)
        source = f"{a.run}: {len(lengths)} samples, measured {tps:,.0f} tokens/s"
    else:
        rng = random.Random(0)
        lengths = [max(16, int(rng.lognormvariate(0, 0.6) * a.mean_tokens / 1.2))
                   for _ in range(a.samples)]
        tps = a.tokens_per_s or 20_000.0
        source = f"{len(lengths)} synthetic samples (mean {statistics.mean(lengths):,.0f} tokens)"
    tps = a.tokens_per_s or tps
    print(f"{source}; {tps:,.0f} tokens/s per node; MTBF {a.mtbf_h} h per node; "
          f"repair {'never' if not a.repair_min else f'{a.repair_min} min'}; "
          f"lost after {a.lost_after_s:.0f} s; {a.trials} trials")
    ideal1 = sum(lengths) / tps
    # wall: mean over the trials that finished; unfinished: every node was lost
    # and none came back (the stage then fails, and a resume redoes nothing finished).
    print(f"{'nodes':>5} {'wall':>10} {'speedup':>8} {'lost':>6} {'redone':>7} {'unfinished':>10}")
    for n in a.nodes:
        res = [simulate(lengths, tps, n, a.mtbf_h * 3600, a.repair_min * 60, a.lost_after_s, s,
                        a.inflight) for s in range(a.trials)]
        whole = [r["wall_s"] for r in res if r["complete"]]   # the others need a resume
        wall = statistics.mean(whole) if whole else float("nan")
        print(f"{n:>5} {_duration(wall):>10} {ideal1 / wall:>7.2f}x "
              f"{statistics.mean(r['lost'] for r in res):>6.2f} "
              f"{statistics.mean(r['redone'] for r in res):>7.2f} "
              f"{sum(not r['complete'] for r in res):>10}")


if __name__ == "__main__":
    main()
