"""The real-GPU checks, run on one NVIDIA GPU (the device tool's H200):

    python bench/bench_gpu.py [--parts nvml,extract,pipeline,panel] [--small]

1. nvml: our NVML source against `nvidia-smi` at the same moments, idle and
   under load (matmuls + host-to-device copies for PCIe traffic); the time
   one sample of all fields takes.
2. extract: the hf backend on a ~1B random Llama (bf16), in one process:
   bare forward tokens/s, write-only tokens/s (the stage's writer fed from
   pinned host memory, GPU idle), and the stage's loop (forward + async copy
   + validated atomic writes). Bound = min(forward, write); target >= 0.9x.
3. pipeline: `eagle-panel run --wait` on the tiny model with `devices = [0]`
   (CUDA extract, CUDA train with its loss/attention choice), then the train
   stage against speculators' trainer called directly on CUDA, then one
   rank of the torchrun path (`train_worker` under torch.distributed.run).
4. panel: bench_panel.py against real NVML (no simulated GPUs).

Each part reports and carries on when another fails; the exit status is 1
when one did. `--small` shrinks everything so the script can be dry-run on a
CPU machine (nvml then says it has no GPU and is skipped); the smallest run,
the one CI makes (~20 s on 2 cores):

    python bench/bench_gpu.py --small --parts extract
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("gpu",)   # at its defaults (bench/run_all.py): a ~1B model and NVML; a CPU takes days
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import extract_direct  # noqa: E402
import train_direct  # noqa: E402

from tests.configs import write  # noqa: E402


def say(*a):
    print(*a, flush=True)


# -- 1. NVML vs nvidia-smi ------------------------------------------------------

SMI_FIELDS = "memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,power.limit"


def smi_row(index: int) -> dict:
    out = subprocess.run(["nvidia-smi", "-i", str(index), f"--query-gpu={SMI_FIELDS}",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30).stdout.strip().split(", ")
    keys = ["mem_used_mib", "mem_total_mib", "util", "temp", "power", "power_limit"]
    return {k: _num(v) for k, v in zip(keys, out, strict=True)}


def smi_pcie(index: int) -> tuple[float | None, float | None]:
    """`nvidia-smi dmon -s t`: rxpci/txpci in MB/s over its 1 s window."""
    out = subprocess.run(["nvidia-smi", "dmon", "-i", str(index), "-c", "1", "-s", "t"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [ln.split() for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]
    if not rows or len(rows[-1]) < 3:
        return None, None
    return _num(rows[-1][1]), _num(rows[-1][2])


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def part_nvml(small: bool):
    import torch
    if not torch.cuda.is_available():
        say("nvml: skipped, no CUDA GPU on this machine")
        return
    from pipeline.telemetry import NvmlSource
    src = NvmlSource(slow_interval=0)
    t0 = time.perf_counter()
    for _ in range(5):
        src.sample()
    all_ms = (time.perf_counter() - t0) / 5 * 1000
    src.slow_interval = 1e9
    src.sample()
    t0 = time.perf_counter()
    for _ in range(50):
        src.sample()
    fast_ms = (time.perf_counter() - t0) / 50 * 1000
    say(f"nvml: one sample of {src.count} GPU(s): {fast_ms:.2f} ms without PCIe, "
        f"{all_ms:.1f} ms with PCIe rx/tx")
    src.slow_interval = 0

    stop = threading.Event()

    def load():
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    def copies():
        s = torch.cuda.Stream()
        host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device="cuda")
        with torch.cuda.stream(s):
            while not stop.is_set():
                dev.copy_(host, non_blocking=True)
                s.synchronize()

    hold = None
    for phase in ("idle", "load"):
        if phase == "load":
            hold = torch.empty(20 << 30, dtype=torch.uint8, device="cuda")  # 20 GiB visible
            threads = [threading.Thread(target=f, daemon=True) for f in (load, copies)]
            for t in threads:
                t.start()
            time.sleep(4)
        for k in range(3):
            ours = src.sample()[0]
            smi = smi_row(0)
            rx, tx = smi_pcie(0)
            ours_pcie = src.sample()[0]
            say(f"  {phase} #{k}: memory used MiB ours {ours.mem_used / 2**20:,.0f} / smi "
                f"{smi['mem_used_mib']:,.0f}; total MiB ours {ours.mem_total / 2**20:,.0f} / smi "
                f"{smi['mem_total_mib']:,.0f}; util % ours {ours.util} / smi {smi['util']}; "
                f"temp C ours {ours.temp} / smi {smi['temp']}; power W ours {ours.power} / smi "
                f"{smi['power']}; limit W ours {ours.power_limit} / smi {smi['power_limit']}; "
                f"PCIe MB/s rx ours {_mb(ours_pcie.pcie_rx)} / smi {rx}, tx ours "
                f"{_mb(ours_pcie.pcie_tx)} / smi {tx}")
    stop.set()
    time.sleep(1)
    del hold
    src.close()


def _mb(v):
    return None if v is None else round(v / 1e6, 1)


# -- 2. extract on a ~1B random model --------------------------------------------

def part_extract(small: bool):
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.extract.hf import HFBackend, length_batches
    from pipeline.model.hsfile import Writer
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if small:
        cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)
        layer_ids, total, lo, hi, batch_tokens = [1, 2, 3, 4], 12_000, 64, 256, 4096
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=14, num_attention_heads=16, num_key_value_heads=16,
                          max_position_embeddings=4096)
        layer_ids, total, lo, hi, batch_tokens = [2, 7, 11, 14], 1_000_000, 1024, 2048, 32768
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype)
    params = sum(p.numel() for p in model.parameters())
    backend = HFBackend(model, layer_ids)
    rng = random.Random(0)
    rows, lengths = [], []
    while sum(lengths) < total:
        n = rng.randint(lo, hi)
        rows.append([rng.randrange(cfg.vocab_size) for _ in range(n)])
        lengths.append(n)
    todo = list(range(len(rows)))
    tokens = sum(lengths)
    bpt = extract_direct.bytes_per_token(backend)
    batches = length_batches(todo, lengths, batch_tokens)
    say(f"extract: random Llama {params / 1e9:.2f} B params ({dtype}) on {dev}; "
        f"{len(rows)} samples, {tokens:,} tokens, {bpt / 1024:.1f} KiB/token, "
        f"{len(batches)} batches of <= {batch_tokens} tokens")

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    # Warm-up over every batch shape: on the H200 a cold first round ran at
    # 108k tokens/s against 183k warm, which would flatter the stage's ratio.
    for b in batches:
        backend.forward([rows[i] for i in b])
    sync()
    out = Path(tempfile.mkdtemp(prefix="bench_hs_", dir=str(ROOT)))
    bare, write_only, stage = [], [], {}
    host = None
    if dev == "cuda":
        host = torch.ones(batch_tokens * len(layer_ids) * cfg.hidden_size, dtype=dtype).pin_memory()
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            for b in batches:
                backend.forward([rows[i] for i in b])
            sync()
            bare.append(tokens / (time.perf_counter() - t0))

            if host is not None:
                w = Writer(out, threads=2)
                t0 = time.perf_counter()
                for b in batches:
                    n = max(lengths[i] for i in b)
                    view = host[:len(b) * n * len(layer_ids) * cfg.hidden_size].view(
                        len(b), n, len(layer_ids), cfg.hidden_size)
                    w.submit(view, torch.tensor(True), None,
                             [(i, rows[i]) for i in b], bpt * sum(lengths[i] for i in b))
                w.close()
                write_only.append(tokens / (time.perf_counter() - t0))
                shutil.rmtree(out)
                out.mkdir()

            for threads in ([2, 4] if dev == "cuda" else [0]):
                t0 = time.perf_counter()
                done = extract_direct.stage_loop(backend, rows, lengths, todo, out, batch_tokens,
                                                 writer_threads=threads)
                stage.setdefault(threads, []).append(done.tokens / (time.perf_counter() - t0))
                assert done.tokens == tokens and len(os.listdir(out)) == len(rows)
                shutil.rmtree(out)
                out.mkdir()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    fwd = statistics.median(bare)
    say(f"  bare forward: {fwd:,.0f} tokens/s ({[round(x) for x in bare]})")
    bound = fwd
    if write_only:
        wr = statistics.median(write_only)
        say(f"  write only (2 writer threads from pinned memory, GPU idle): {wr:,.0f} tokens/s "
            f"= {wr * bpt / 1e9:.2f} GB/s ({[round(x) for x in write_only]})")
        bound = min(fwd, wr)
    for threads, vals in stage.items():
        st = statistics.median(vals)
        say(f"  stage loop, {threads} writer threads: {st:,.0f} tokens/s = {st * bpt / 1e9:.2f} GB/s "
            f"written ({[round(x) for x in vals]}); {st / fwd:.2f}x forward, {st / bound:.2f}x "
            f"the bound min(forward, write) = {bound:,.0f} tokens/s (target >= 0.9x)")


# -- 3. the pipeline on CUDA -----------------------------------------------------

def config(devices: list[int], epochs: int, samples: int, evaluate: bool) -> dict:
    return {"run": {"name": "gpu"}, "data": {"max_samples": samples},
            "gpus": {"devices": devices},
            "stages": {"extract": {"layer_ids": [1, 2, 3], "batch_tokens": 8192},
                       "vocab": {"draft_vocab_size": 256},
                       "train": {"epochs": epochs, "total_seq_len": 2048},
                       "evaluate": {"enabled": evaluate}}}


def events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def sh(args, cwd, timeout=600, check=True):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{args[:4]} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def part_pipeline(small: bool):
    import torch
    cuda = torch.cuda.is_available()
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    write(tmp / "config.toml", config([0] if cuda else [], epochs=1, samples=16 if small else 0,
                                      evaluate=not small))
    t0 = time.perf_counter()
    r = sh([sys.executable, "-m", "app.cli", "run", "--wait"], tmp, check=False)
    say(f"pipeline on the tiny model, devices {'[0]' if cuda else '[]'}: exit {r.returncode} "
        f"in {time.perf_counter() - t0:.0f} s")
    run = tmp / "runs" / "gpu"
    state = json.loads((run / "state.json").read_text())
    for s in ("prepare", "extract", "vocab", "train"):
        st = state["stages"][s]
        evs = events(run / s / "events.jsonl")
        warns = [e["message"] for e in evs if e["type"] == "warning"]
        fin = [e for e in evs if e["type"] == "stage_finished"]
        summ = fin[-1].get("summary", {}) if fin else {}
        keep = {k: summ[k] for k in ("tokens_per_s", "gb_per_s", "acceptance_length",
                                     "first_train_loss", "last_train_loss", "val_loss") if k in summ}
        dur = (st.get("ended_at") or 0) - (st.get("started_at") or 0)
        say(f"  {s:8} {st['status']:9} {dur:6.1f} s  peak RSS {(st.get('max_rss_kb') or 0) / 1024:6.0f} "
            f"MiB  {keep}  warnings: {warns}")
    if r.returncode != 0:
        say(r.stdout[-2000:], r.stderr[-2000:])
        for s in ("extract", "train"):
            p = run / s / "stage.log"
            if p.exists():
                say(f"--- {s} log tail ---\n" + p.read_text()[-3000:])
        return
    if cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    stage_wall, direct_wall, direct_s = train_direct.compare(run, tmp, "cuda" if cuda else "cpu",
                                                             sh)
    say(f"  train on {'cuda' if cuda else 'cpu'}: stage {stage_wall:.1f} s vs speculators directly "
        f"{direct_wall:.1f} s (trainer alone {direct_s:.1f} s): {direct_wall / stage_wall:.2f}x "
        f"(target >= 0.95x)")
    if not cuda:
        return
    # The torchrun path (used with 2+ GPUs) as one rank on this GPU.
    shutil.rmtree(run / "train/out")
    (run / "train/out").mkdir()
    n_metrics = sum(1 for e in events(run / "train/events.jsonl") if e["type"] == "metric")
    t0 = time.perf_counter()
    r = sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            "-m", "pipeline.train.worker", "--run-dir", str(run), "--",
            *train_direct.recorded_argv(run)], tmp,
           check=False)
    ckpts = sorted(p.name for p in (run / "train/out/checkpoints").glob("*")) if (
        run / "train/out/checkpoints").exists() else []
    n_after = sum(1 for e in events(run / "train/events.jsonl") if e["type"] == "metric")
    say(f"  torchrun, 1 rank on cuda: exit {r.returncode} in {time.perf_counter() - t0:.0f} s, "
        f"checkpoints {ckpts}, metric events from rank 0: {n_after - n_metrics}")
    if r.returncode != 0:
        say(r.stdout[-2500:], r.stderr[-2500:])


# -- 4. the panel against real NVML ------------------------------------------------

def part_panel(small: bool):
    r = sh([sys.executable, str(ROOT / "bench/bench_panel.py"), "--simulate", "0", "--view",
            "gpus", "--duration", "10" if small else "30"], ROOT, check=False)
    say("panel with real NVML (no simulated GPUs), GPU view:\n" + r.stdout + r.stderr[-1500:])


PARTS = {"nvml": part_nvml, "extract": part_extract, "panel": part_panel, "pipeline": part_pipeline}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--small", action="store_true", help="tiny sizes, for a dry run on a CPU")
    a = ap.parse_args()
    import torch
    say(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda "
        f"{torch.cuda.is_available() and torch.cuda.get_device_name(0)}")
    failed = []
    for name in a.parts.split(","):
        t0 = time.perf_counter()
        try:
            PARTS[name](a.small)
        except Exception:  # noqa: BLE001 - report and go on with the next part
            say(f"part {name} FAILED:\n{traceback.format_exc()}")
            failed.append(name)
        say(f"[{name}: {time.perf_counter() - t0:.0f} s]")
    if failed:
        say(f"parts that failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
