"""What the vllm-engine backend's capture costs per engine step, without vLLM.

    python bench/bench_capture.py [--device cuda] [--hidden 2048] [--steps 40]

The smallest size (CI, on a CPU, a few seconds):
    python bench/bench_capture.py --device cpu --hidden 64 --step-tokens 256 --req-len 96 \
        --steps 4 --forward-ms 5

pipeline/extract/vllm_capture.py runs inside vLLM's rank-0 worker: in the step it
adds hidden_states + residual per captured layer, stacks them and queues one
finiteness reduction; its copy thread moves the step to the host, slices it
between the step's requests and hands finished requests to the writer
threads. This feeds it steps of the shape the engine produces (token budget
split into requests, some chunked over two steps) from tensors already on the
device, and reports:

  back to back   steps with no forward between them: what the copy thread
                 and writers sustain (tokens/s, GB/s);
  with forward   each step preceded by a stand-in forward of --forward-ms on
                 the device (a sleep kernel, on CPU a sleep): the wall time
                 against the forwards alone = the stage's rate vs the model's.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what it needs at its defaults (bench/run_all.py): CUDA (--device cpu checks, measures nothing)
NEEDS = ("gpu",)
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4, help="captured layers (aux + last)")
    ap.add_argument("--step-tokens", type=int, default=8192)
    ap.add_argument("--req-len", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--writer-threads", type=int, default=2)
    ap.add_argument("--pageable", action="store_true", help="no pinned staging buffer")
    ap.add_argument("--forward-ms", type=float, default=400.0,
                    help="stand-in forward per step (8192 tokens at ~20k tokens/s: a large MoE)")
    a = ap.parse_args()
    import torch

    from pipeline.extract.vllm_capture import Capture
    from pipeline.model.hsfile import Writer

    dev = torch.device(a.device)
    dtype = torch.bfloat16
    layer_ids = list(range(1, a.layers)) + [a.layers * 8]
    T, H = a.step_tokens, a.hidden
    h = [torch.randn(T, H, device=dev, dtype=dtype) for _ in layer_ids]
    r = [torch.randn(T, H, device=dev, dtype=dtype) for _ in layer_ids]
    vocab = 32000
    tmp = Path(tempfile.mkdtemp(prefix="bench_capture_"))
    cap_writer = Writer(tmp, threads=a.writer_threads)
    cap = Capture(layer_ids, cap_writer, pin_host=not a.pageable)
    # Requests of req_len tokens laid end to end over the steps: a request
    # that does not fit the rest of a step is chunked into the next one.
    next_req, left = 0, {}
    jobs_ids: dict[str, list[int]] = {}

    def new_request():
        nonlocal next_req
        rid = f"hs-{next_req}"
        ids = torch.randint(0, vocab, (a.req_len,)).tolist()
        jobs_ids[rid] = ids
        cap.expect({rid: (next_req, ids)})
        left[rid] = 0
        next_req += 1
        return rid

    def step():
        counts, budget, order = {}, T, []
        for rid in list(left):
            if budget == 0:
                break
            n = min(a.req_len - left[rid], budget)
            counts[rid], budget = n, budget - n
            order.append(rid)
        while budget:
            rid = new_request()
            n = min(a.req_len, budget)
            counts[rid], budget = n, budget - n
            order.append(rid)
        ids, pos, starts = [], [], {}
        for rid in order:
            p0 = starts[rid] = left[rid]
            ids += jobs_ids[rid][p0:p0 + counts[rid]]
            pos += range(p0, p0 + counts[rid])
            left[rid] = p0 + counts[rid]
            if left[rid] == a.req_len:
                del left[rid]
        input_ids = torch.tensor(ids, device=dev)
        positions = torch.tensor(pos, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        cap.counts, cap.starts = counts, starts
        cap.on_embed(input_ids, h[0])
        cap.on_positions(positions)
        for j, k in enumerate(layer_ids):
            cap.on_layer(k, (h[j], r[j]))
        cap.end_step(order)
        if cap.error:
            raise SystemExit(cap.error)
        return time.perf_counter() - t0

    def fake_forward():
        if a.forward_ms <= 0:
            return
        if dev.type == "cuda":
            torch.cuda._sleep(int(a.forward_ms * 1e-3 * cycles_per_s))
        else:
            time.sleep(a.forward_ms / 1e3)

    cycles_per_s = 0.0
    if dev.type == "cuda":
        # Calibrate the sleep kernel: cycles per second of this GPU (rough;
        # the forwards alone are timed below, not assumed).
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(100_000_000)
        torch.cuda.synchronize()
        cycles_per_s = 100_000_000 / (time.perf_counter() - t0)

    def forwards_alone() -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            fake_forward()
            if dev.type == "cuda":
                torch.cuda.synchronize()   # vLLM syncs each step for the sampled token
        return time.perf_counter() - t0

    per_tok = a.layers * H * 2
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(f"capture on {dev} ({name}),{' pageable' if a.pageable else ''} {a.layers} layers x "
          f"{H} bf16 = {per_tok / 1024:.0f} KiB/token, steps of {T} tokens, requests of "
          f"{a.req_len}")
    for _ in range(3):
        step()   # warm-up: allocator, pinned buffer, stream
    cap.drain()
    for label, forward in (("back to back", False), ("with forward", True)):
        cap.writer.close()   # drained writers; fresh ones for this round
        cap.writer = Writer(tmp, threads=a.writer_threads)
        in_step = 0.0
        t_all = time.perf_counter()
        for _ in range(a.steps):
            if forward:
                fake_forward()
            in_step += step()
        cap.drain()
        cap.writer.close()
        wall = time.perf_counter() - t_all
        n = a.steps * T
        line = (f"  {label}: {n:,} tokens in {wall:.2f} s = {n / wall:,.0f} tokens/s "
                f"({n * per_tok / wall / 1e9:.2f} GB/s); in the step {in_step / a.steps * 1e3:.1f} "
                f"ms")
        if forward:
            alone = forwards_alone()
            line += f"; forwards alone {alone:.2f} s -> {alone / wall:.3f}x the model's rate"
        print(line)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
