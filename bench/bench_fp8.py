"""FP8 hidden states and hybrid mode against bf16, on the same data, seed and
settings, through the real vLLM server (.venv-vllm).

    python bench/bench_fp8.py [--samples 0] [--epochs 2]
    python bench/bench_fp8.py --samples 16 --epochs 1 --modes bf16,fp8 --no-evaluate
                                                     # the smallest (CI, ~3 min on 2 cores)

Runs (each its own run directory; the target computes in bf16 so that the
baseline is bf16 files):
  bf16          offline: extract (vLLM's server writes bf16) + train + evaluate
  fp8           offline: the same with hidden_states_dtype = "fp8"
  online        online fp8: train asks the server for every sample
  hybrid        fp8, half of the samples on disk (the fp8 run's files), train asks for the
                rest, nothing kept
  hybrid-keep   the same, keeping what the server generates (later epochs read it)
Reports per run: bytes per hidden-state token on disk, extraction tokens/s, train's wall
time and final validation loss, vLLM's measured acceptance length; and the ratios the
issue targets: fp8 bytes/token vs bf16 (1/2), extraction rate vs bf16 (>= 0.95x),
validation loss and acceptance vs bf16 (within 2%), hybrid's wall time vs offline and
online.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("vllm",)   # to run at its defaults (bench/run_all.py): extraction through vLLM's server
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))   # its sibling bench_online

# one stage in its own process, as the runner starts it; (seconds, its summary)
from bench_online import stage  # noqa: E402

from pipeline.paths import VLLM_VENV  # noqa: E402
from tests.configs import merged, tiny_pipeline, write  # noqa: E402

MODES = ("bf16", "fp8", "online", "hybrid", "hybrid-keep")


def tables(mode: str, a) -> dict:
    fp8 = mode != "bf16"
    pipe = {"online": "online", "hybrid": "hybrid", "hybrid-keep": "hybrid"}.get(mode, "offline")
    return merged(tiny_pipeline("bench", a.samples), {
        "pipeline": {"mode": pipe},
        "model": {"dtype": "bfloat16"},
        "runtime": {"vllm_python": a.vllm_python},
        "stages": {
            "prepare": {"seq_length": 256},
            "extract": {"backend": "vllm-server", "hidden_states_dtype": "fp8" if fp8 else "auto"},
            "train": {"epochs": a.epochs, "dataloader_workers": 2,
                      "keep_generated_gb": 1.0 if mode == "hybrid-keep" else 0.0},
            "evaluate": {"enabled": a.evaluate, "baseline": False, "max_prompts": 24}}})


def run(tmp: Path, mode: str, a, fp8_files: Path | None, fp8_extract_s: float) -> dict:
    d = tmp / mode
    d.mkdir()
    write(d / "config.toml", tables(mode, a))
    stage(d, "prepare")
    stage(d, "vocab")
    out = {"mode": mode, "extract_s": 0.0}
    hs = d / "runs/bench/extract/out/hidden_states"
    if mode in ("bf16", "fp8"):
        out["extract_s"], s = stage(d, "extract")
        files = sorted(hs.glob("hs_*.safetensors"))
        out["bytes_per_token"] = s["bytes_per_token"]
        out["disk_bytes"] = sum(f.stat().st_size for f in files)
        out["extract_tokens_per_s"] = s["tokens_per_s"]
    elif mode.startswith("hybrid"):
        hs.mkdir(parents=True)   # half of the samples, as an extraction cut short left them
        for f in sorted(fp8_files.glob("hs_*.safetensors"))[::2]:
            shutil.copy(f, hs / f.name)
        out["on_disk_before"] = len(list(hs.glob("hs_*.safetensors")))
    out["train_s"], s = stage(d, "train")
    out["val_loss"] = s.get("val_loss")
    out["from_disk"], out["from_servers"] = s.get("from_disk"), s.get("from_servers")
    out["kept_bytes"] = s.get("kept_bytes")
    # a hybrid run continues an extraction cut short: its half took half the fp8 extraction
    half = 0.5 * fp8_extract_s if mode.startswith("hybrid") else 0.0
    out["wall_s"] = out["extract_s"] + out["train_s"] + half
    if a.evaluate:
        _, e = stage(d, "evaluate")
        out["acceptance"] = e.get("acceptance_length")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=0, help="rows of the bundled data (0 = all)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-evaluate", dest="evaluate", action="store_false")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON",
                                                            str(VLLM_VENV / "bin" / "python")))
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    tmp = Path(tempfile.mkdtemp(prefix="bench-fp8-"))
    res: dict[str, dict] = {}
    try:
        for mode in modes:
            fp8_files = tmp / "fp8" / "runs/bench/extract/out/hidden_states"
            if mode.startswith("hybrid") and not fp8_files.is_dir():
                raise SystemExit("hybrid runs take half of the fp8 run's files: put fp8 first")
            r = res[mode] = run(tmp, mode, a, fp8_files,
                                res.get("fp8", {}).get("extract_s", 0.0))
            print(f"{mode:12} wall {r['wall_s']:6.1f} s (extract {r['extract_s']:.1f} + train "
                  f"{r['train_s']:.1f})  val loss {r['val_loss']:.4f}"
                  + (f"  {r['bytes_per_token']:,} B/token  extract {r['extract_tokens_per_s']:,.0f}"
                     " tokens/s" if "bytes_per_token" in r else "")
                  + (f"  from disk {r['from_disk']} / servers {r['from_servers']}"
                     if r.get("from_disk") is not None else "")
                  + (f"  acceptance {r['acceptance']:.3f}" if r.get("acceptance") else ""),
                  flush=True)
        summary = compare(res)
        for line in summary.pop("lines"):
            print(line)
        if a.json:
            Path(a.json).write_text(json.dumps({"runs": res, **summary}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compare(res: dict) -> dict:
    out: dict = {"lines": []}
    b, f = res.get("bf16"), res.get("fp8")
    if b and f:
        out["bytes_ratio"] = f["bytes_per_token"] / b["bytes_per_token"]
        out["extract_rate_ratio"] = f["extract_tokens_per_s"] / b["extract_tokens_per_s"]
        out["val_loss_change"] = f["val_loss"] / b["val_loss"] - 1
        out["lines"].append(f"fp8 / bf16: bytes per token {out['bytes_ratio']:.3f}x, "
                            f"extraction rate {out['extract_rate_ratio']:.2f}x, validation loss "
                            f"{out['val_loss_change']:+.2%}")
        if b.get("acceptance") and f.get("acceptance"):
            out["acceptance_change"] = f["acceptance"] / b["acceptance"] - 1
            out["lines"].append(f"fp8 / bf16 acceptance: {out['acceptance_change']:+.2%}")
    for h in ("hybrid", "hybrid-keep"):
        if h in res and f:
            ref = f"vs offline {res[h]['wall_s'] / f['wall_s']:.2f}x"
            if "online" in res:
                ref += f", vs online {res[h]['wall_s'] / res['online']['wall_s']:.2f}x"
            out[f"{h}_vs_offline"] = res[h]["wall_s"] / f["wall_s"]
            out["lines"].append(f"{h} wall time (half extracted, then train): {ref}")
    return out


if __name__ == "__main__":
    main()
