"""Flex attention alone at a draft's head sizes: what its kernel options buy.

bench/draft_steps.py found the MLA draft at Kimi-K2.5's shapes 1.36x the
Llama draft per (causal) FLOP on an H200, with flex attention's backward 34%
of its step. Triton's flex kernels pick block sizes by head size (torch's
template_heuristics: bf16 on sm90, q/k 192 gets 64x64 blocks in 2 stages,
64 gets 128-wide ones in 3) and round q/k 192 up to 256. This times one
forward + backward of the attention a TTT step runs — speculators' own
block mask (causal within the document plus one diagonal per earlier draft
step), built as its Eagle3 draft builds it — for each head configuration, with
the default kernel and with each `--options` set, the rows interleaved.

    python bench/flex_heads.py --device cuda --dtype bfloat16 --seq 8192 \\
        --options 'mla/w8={"bwd_num_warps": 8}' --options 'mla/f128={"fwd_BLOCK_M": 128}'

(On an H200 the first was 7.6-8.1% faster for MLA's heads: docs/benchmarks.md.)

Heads are `name=HEADS:QK:V` (`--heads`, default Kimi-K2.5's drafts: llama
64 heads of 64 — speculators takes the target's `head_dim` — and mla 64 heads
of q/k 192, v 128). FLOPs are the pairs the mask keeps (forward 2·(qk+v),
backward 2·(3·qk+2·v) per pair and head): what a draft needs, not the padded
tiles the kernel computes. On a CPU it times the forward only (flex has no
backward there) and compiles nothing unless `--compile`: a check that the
script runs, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from draft_steps import free_device_cache, interleaved

KIMI_DRAFTS = ("llama=64:64:64", "mla=64:192:128")


def parse_heads(spec: str) -> tuple[str, int, int, int]:
    name, _, dims = spec.partition("=")
    try:
        heads, qk, v = (int(x) for x in dims.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads {spec!r}: want name=HEADS:QK:V, "
                                         "e.g. mla=64:192:128") from None
    return name, heads, qk, v


def parse_options(spec: str) -> tuple[str, dict]:
    """name=JSON; `heads/name=JSON` for one head configuration's rows only."""
    name, _, text = spec.partition("=")
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--options {spec!r}: not JSON ({e.msg}); want "
                                         "name={\"BLOCK_M\": 64, ...}") from None
    if not name or not isinstance(opts, dict):
        raise argparse.ArgumentTypeError(f"--options {spec!r}: want name={{...}}")
    return name, opts


def block_mask(seq: int, step: int, device: str):
    """The mask of TTT step `step` (0-based) as speculators' Eagle3 draft builds
    it: one document, causal, then one diagonal block per earlier step.
    (speculators imported here: a refused command line answers at once.)"""
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_mask_for_draft_tokens,
    )
    from torch.nn.attention.flex_attention import create_block_mask
    doc = torch.zeros(seq, dtype=torch.long, device=device)
    mask = create_block_mask(create_combined_mask_mod(doc, seq), B=None, H=None,
                             Q_LEN=seq, KV_LEN=seq, device=device)
    for _ in range(step):
        mask = extend_mask_for_draft_tokens(mask)
    return mask


def flops(seq: int, step: int, heads: int, qk: int, v: int, backward: bool) -> float:
    """Forward (+ backward) FLOPs over the pairs the mask keeps."""
    pairs = seq * (seq + 1) / 2 + step * seq
    return pairs * heads * (2 * (qk + v) + (2 * (3 * qk + 2 * v) if backward else 0))


class Row:
    """One head configuration under one set of kernel options: its tensors,
    its compiled (or eager) attention, its times."""

    def __init__(self, head, opts, a, mask, sync):
        (self.heads_name, heads, qk, v), (self.opts_name, self.opts) = head, opts
        self.name = f"{self.heads_name}/{self.opts_name}"
        g = torch.Generator(device=a.device).manual_seed(0)
        kv_len = a.seq * (a.step + 1)

        def rand(n, d):
            return torch.randn(1, heads, n, d, device=a.device, dtype=a.dtype,
                               generator=g).requires_grad_(a.backward)
        self.q, self.k, self.v = rand(a.seq, qk), rand(kv_len, qk), rand(kv_len, v)
        self.grad = torch.randn(1, heads, a.seq, v, device=a.device, dtype=a.dtype,
                                generator=g)
        self.mask, self.backward, self.sync = mask, a.backward, sync
        self.flops = flops(a.seq, a.step, heads, qk, v, a.backward)
        kw = {"kernel_options": self.opts} if self.opts else {}
        from torch.nn.attention.flex_attention import flex_attention

        def attend(q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask, **kw)
        self.fn = torch.compile(attend, dynamic=False) if a.compile else attend
        self.times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        """One forward (+ backward), finished on the device when it returns."""
        out = self.fn(self.q, self.k, self.v, self.mask)
        if self.backward:
            out.backward(self.grad)
            self.q.grad = self.k.grad = self.v.grad = None
        self.sync()

    def result(self) -> dict:
        out = {"row": self.name, "heads": self.heads_name, "options": self.opts}
        if self.error or not self.times:
            return {**out, "error": self.error or "not timed (the run ended first)"}
        ms = statistics.median(self.times) * 1e3
        return {**out, "median_ms": round(ms, 3), "flops": self.flops,
                "tflops": round(self.flops / ms / 1e9, 3),
                "times_ms": [round(t * 1e3, 3) for t in self.times]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--seq", type=int, default=256, help="tokens a step (default 256)")
    ap.add_argument("--step", type=int, default=2,
                    help="TTT step timed, 0-based (default 2: the third, keys of three)")
    ap.add_argument("--heads", type=parse_heads, action="append",
                    help=f"name=HEADS:QK:V (default {' '.join(KIMI_DRAFTS)})")
    ap.add_argument("--options", type=parse_options, action="append", default=[],
                    help="[heads/]name=JSON of flex kernel_options: a row each beside the "
                         "default (heads/: for those heads only)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the attention (default: on CUDA only)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.reps < 1 or a.seq < 128 or a.seq % 128 or a.step < 0:
        ap.error("--reps wants >= 1, --seq a multiple of 128 (flex's block), --step >= 0")
    a.compile = a.device.startswith("cuda") if a.compile is None else a.compile
    a.backward = a.device.startswith("cuda")   # flex has no backward on CPU (torch 2.13)
    if a.options and not a.device.startswith("cuda"):
        ap.error("--options are Triton block sizes: they want --device cuda")
    a.dtype = getattr(torch, a.dtype)
    heads = a.heads or [parse_heads(s) for s in KIMI_DRAFTS]
    unknown = {o.partition("/")[0] for o, _ in a.options if "/" in o} - {h[0] for h in heads}
    if unknown:
        ap.error(f"--options for heads {', '.join(sorted(unknown))}: no such --heads "
                 f"(there are {', '.join(h[0] for h in heads)})")
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    mask = block_mask(a.seq, a.step, a.device)
    rows = [Row(h, (o[0].rpartition("/")[2], o[1]), a, mask, sync) for h in heads
            for o in [("default", {}), *a.options] if o[0].partition("/")[0] in (h[0], o[0])]
    # every row compiles the same function: one cache entry each (shapes, options)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               len(rows) + 1)
    print(f"flex attention, {a.device}, {str(a.dtype)[6:]}, {a.seq} tokens, TTT step "
          f"{a.step} (keys {a.seq * (a.step + 1)}), compiled: {a.compile}, "
          + ("forward + backward" if a.backward else "forward only (no backward on CPU)"),
          flush=True)
    try:
        for r in rows:   # first calls apart: each compiles (a failure leaves its row)
            t0 = time.perf_counter()
            try:
                r.run()
                print(f"  {r.name}: first call {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - an option set Triton cannot build
                r.error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                print(f"  {r.name}: {r.error}", flush=True)
                free_device_cache()
        live = {i: r.run for i, r in enumerate(rows) if not r.error}
        times, failed = interleaved(live, a.reps)   # a row failing there leaves the rotation
        for i in live:
            rows[i].times, rows[i].error = times[i], failed.get(i)
        for res in (results := [r.result() for r in rows]):
            print(f"{res['row']:>24}: " + (res.get("error") or
                  f"{res['median_ms']:8.2f} ms  {res['tflops']:7.3f} TFLOP/s (kept pairs)"))
        ratio_lines(results)
    finally:   # what was timed, however the run ends
        if a.json:
            a.json.write_text(json.dumps({"device": a.device, "seq": a.seq, "step": a.step,
                                          "rows": [r.result() for r in rows]}, indent=1))
    return 0


def ratio_lines(results: list[dict]) -> None:
    """Each row's time per FLOP against the first head configuration's
    default, and an options row's time against its own heads' default."""
    def per_flop(r):
        return r["median_ms"] / r["flops"]
    timed = [r for r in results if "error" not in r]
    defaults = {r["heads"]: r for r in timed if not r["options"]}
    base = results[0] if results and "error" not in results[0] else None
    for res in timed:
        said = []
        if base is not None and res is not base:
            said.append(f"{per_flop(res) / per_flop(base):.2f}x {base['row']}'s time per FLOP")
        own = defaults.get(res["heads"])
        if res["options"] and own is not None:
            said.append(f"{res['median_ms'] / own['median_ms']:.3f}x {own['row']}'s time")
        if said:
            print(f"{res['row']:>24}: " + "; ".join(said))


if __name__ == "__main__":
    sys.exit(main())
