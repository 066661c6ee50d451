"""Online vs offline training on the same data (the real vLLM server).

    python bench/bench_online.py [--samples 0] [--epochs 2] [--workers 2] [--work DIR]
    python bench/bench_online.py --samples 16 --epochs 1   # the smallest (~3 min on 2 cores)

(CI runs it from tests/vllm/test_vllm_online.py, at 64 samples, keeping both runs
in --work as the test's offline reference.)

offline: extract (backend auto: the vLLM server writes every sample's hidden
states) then train reads the files; online: train asks the vLLM server for
each sample as it needs it. Reports wall time of extract + train vs online
train, the trainer's data-wait share (speculators' queue time / step time),
the online buffer's peak vs the offline hidden states' size, and the final
losses (the same samples and seed: they should match). On a GPU server set
VLLM_PYTHON and [gpus] through --gpus "0,1" (extract) "2,3" (train).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("vllm",)   # to run at its defaults (bench/run_all.py): online training asks vLLM servers
sys.path.insert(0, str(ROOT))

from pipeline.paths import VLLM_VENV, pythonpath_with_project  # noqa: E402
from tests.configs import write  # noqa: E402


def config(mode: str, a, gpus: dict) -> dict:
    return {"run": {"name": "bench"}, "pipeline": {"mode": mode},
            "runtime": {"vllm_python": a.vllm_python}, "data": {"max_samples": a.samples},
            "gpus": gpus,
            "stages": {"extract": {"backend": "auto", "layer_ids": [1, 2, 3]},
                       "vocab": {"draft_vocab_size": 256},
                       "train": {"epochs": a.epochs, "lr": 0.001, "total_seq_len": 1024,
                                 "dataloader_workers": a.workers},
                       "evaluate": {"enabled": False}}}


def stage(d: Path, name: str) -> tuple[float, dict]:
    from pipeline.run.events import read_events
    env = dict(os.environ, PYTHONPATH=pythonpath_with_project(os.environ.get("PYTHONPATH")))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", f"pipeline.stages.{name}", "--run-dir",
                        str(d / "runs/bench"), "--config", str(d / "config.toml")],
                       env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        raise SystemExit(f"{d.name}: the {name} stage exited {p.returncode}:\n"
                         f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    ev = [e for e in read_events(d / "runs/bench" / name / "events.jsonl")
          if e["type"] == "stage_finished"][-1]
    return time.perf_counter() - t0, ev["summary"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpus", nargs=2, metavar=("EXTRACT", "TRAIN"), default=None)
    ap.add_argument("--work", type=Path, default=None,
                    help="keep both runs here (default: a temporary folder, removed)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON",
                                                            str(VLLM_VENV / "bin" / "python")))
    a = ap.parse_args()
    gpus = {"devices": []}
    if a.gpus:
        ids = [[int(i) for i in g.split(",")] for g in a.gpus]
        gpus = {"devices": sorted(set(ids[0]) | set(ids[1])), "extract": ids[0], "train": ids[1]}
    tmp = a.work or Path(tempfile.mkdtemp(prefix="bench-online-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        out = {}
        for mode in ("offline", "online"):
            d = tmp / mode
            d.mkdir()
            write(d / "config.toml", config(mode, a, gpus))
            stage(d, "prepare")
            stage(d, "vocab")
            wall = 0.0
            if mode == "offline":
                wall, _ = stage(d, "extract")
                disk = sum(p.stat().st_size for p in
                           (d / "runs/bench/extract/out/hidden_states").glob("hs_*"))
            t, s = stage(d, "train")
            wall += t
            out[mode] = (wall, s, disk if mode == "offline" else s["buffer_peak_bytes"])
            print(f"{mode:8} {wall:7.1f} s (extract + train)  data wait "
                  f"{s.get('data_wait_share', 0):.1%}  disk {out[mode][2]:,} B  "
                  f"last train loss {s['last_train_loss']:.4f}  val loss {s['val_loss']:.4f}",
                  flush=True)
        (off, _, off_disk), (on, _, on_disk) = out["offline"], out["online"]
        print(f"\nonline / offline wall time: {on / off:.2f}x; online disk peak "
              f"{on_disk / off_disk:.1%} of offline's hidden states")
    finally:
        if a.work is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
