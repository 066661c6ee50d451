"""Benchmark the real stages on the built-in tiny model (CPU).

    python bench/bench_stages.py [--epochs 1] [--samples 0] [--rounds 3] [--no-evaluate]

The smallest size (CI, ~1 min on 2 cores):
    python bench/bench_stages.py --samples 16 --rounds 1 --no-evaluate

1. extract overhead: the stage's tokens/s against a bare transformers forward
   over the same length-batches in the same process (target >= 0.9x; on the
   CPU the forward is the bound).
2. train overhead: the train stage (events, metric handler, resume logic)
   against speculators' trainer called directly with the same flags and the
   same CPU shims, both as subprocesses (target >= 0.95x).
3. peak RSS of each stage, recorded by the supervisor of a full run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import extract_direct  # noqa: E402
import train_direct  # noqa: E402

from tests.configs import write  # noqa: E402


def config(a) -> dict:
    return {"run": {"name": "bench", "runs_dir": "runs"}, "data": {"max_samples": a.samples},
            "stages": {"extract": {"layer_ids": [1, 2, 3], "batch_tokens": a.batch_tokens},
                       "vocab": {"draft_vocab_size": 256},
                       "train": {"epochs": a.epochs, "total_seq_len": 1024},
                       "evaluate": {"enabled": a.evaluate}}}


def sh(args, cwd, env=None):
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(args, cwd=cwd, env=e, capture_output=True, text=True, check=True)


def extract_vs_bare(run: Path, batch_tokens: int, rounds: int = 3):
    """Alternate the stage's extraction loop (forward + validated atomic
    writes) with a bare forward over the same batches, in one process."""
    import statistics

    import torch

    from pipeline.builtin.tiny_model import ensure_built
    from pipeline.extract.hf import HFBackend, length_batches
    from pipeline.extract.job import RowIds
    ids = RowIds(run / "prepare/out/data")
    lengths = ids.lengths()
    backend = HFBackend.load(ensure_built(), [1, 2, 3, 4], "cpu", torch.float32)
    todo = list(range(len(lengths)))
    batches = length_batches(todo, lengths, batch_tokens)
    bare, stage, mb = [], [], []
    for _ in range(rounds):
        t0, tokens = time.perf_counter(), 0
        for b in batches:
            backend.forward([ids[i] for i in b])
            tokens += sum(lengths[i] for i in b)
        bare.append(tokens / (time.perf_counter() - t0))
        out = run / "bench_hs"
        out.mkdir()
        t0 = time.perf_counter()
        done = extract_direct.stage_loop(backend, ids, lengths, todo, out, batch_tokens)
        wall = time.perf_counter() - t0
        assert done.tokens == tokens and done.samples == len(todo), (done, tokens)
        stage.append(done.tokens / wall)
        mb.append(done.bytes / 1e6 / wall)
        shutil.rmtree(out)
    return statistics.median(stage), statistics.median(bare), statistics.median(mb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=0,
                    help="rows of the bundled data ([data] max_samples; 0 = all)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternations of the stage's extract loop and the bare forward")
    ap.add_argument("--no-evaluate", dest="evaluate", action="store_false",
                    help="leave evaluate out of the full run (it serves the target through "
                         "vLLM where one is installed); the figures below do not use it")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        write(tmp / "config.toml", config(a))
        t0 = time.time()
        sh([sys.executable, "-m", "app.cli", "run", "--wait"], tmp)
        print(f"full pipeline on the tiny model: {time.time() - t0:.0f} s")
        run = tmp / "runs" / "bench"
        state = json.loads((run / "state.json").read_text())
        for s in ("prepare", "extract", "vocab", "train"):
            st = state["stages"][s]
            print(f"  {s:8} {st['ended_at'] - st['started_at']:6.1f} s   "
                  f"peak RSS {st['max_rss_kb'] / 1024:7.1f} MiB")

        # 1. extract: the stage's loop vs a bare forward, same batches, same process.
        fin = [json.loads(x) for x in (run / "extract/events.jsonl").read_text().splitlines()]
        summary = [e for e in fin if e["type"] == "stage_finished"][-1]["summary"]
        stage_tps, bare_tps, mbps = extract_vs_bare(run, a.batch_tokens, a.rounds)
        print(f"extract: stage loop {stage_tps:,.0f} tokens/s ({mbps:.0f} MB/s written) vs bare "
              f"forward {bare_tps:,.0f} tokens/s: {stage_tps / bare_tps:.2f}x (target >= 0.9x); "
              f"the stage process end to end (cold): {summary['tokens_per_s']:,.0f} tokens/s")

        # 2. train: the stage vs speculators' trainer directly, same flags.
        stage_wall, direct_wall, direct_s = train_direct.compare(run, tmp, "cpu", sh)
        print(f"train: stage {stage_wall:.1f} s vs speculators directly {direct_wall:.1f} s "
              f"(trainer alone {direct_s:.1f} s): {direct_wall / stage_wall:.2f}x (target >= 0.95x)")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
