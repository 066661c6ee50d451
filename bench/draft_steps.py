"""The MLA draft against the Llama draft, trained on the same data: time per
optimizer step, and per FLOP (issue 36: the MLA draft's cost should follow
its arithmetic, within 1.2x of the Llama draft's per FLOP).

    python bench/draft_steps.py [--samples 96] [--epochs 2] [--total-seq-len 512]
    python bench/draft_steps.py --samples 16 --epochs 1      # the smallest (CI)

On builtin:tiny-kimi (an MLA target: DeepSeek-V3 decoder, remote-code
tokenizer): prepare, extract (hf) and vocab once, then the train stage twice
on those files, `draft_layer = "llama"` and `"mla"`, the same epochs,
total_seq_len, lr and seed. Each: optimizer steps, the rate train reports
(steps since its first: the model load and the dataloader's start left out),
the draft's parameters from its checkpoint, and a FLOP estimate per step:
6 x the parameters a token passes through (the decoder layer, fc, norms,
lm_head; not the embedding lookup) x the tokens a step packs x the TTT steps,
plus attention's 4 x seq x head dims per token and layer (MLA: q/k heads of
nope + rope, v of v_head_dim). An estimate, said as one: the ratio of ratios
(time / FLOPs, MLA over Llama) is the figure the goal is about.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import stage_process  # noqa: E402

from tests.configs import merged, render  # noqa: E402

TTT_STEPS = 3   # the train stage's default, what both drafts unroll


def events(run: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run / name / "events.jsonl").read_text().splitlines() if x]


def draft_params(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    from pipeline.train.mla_draft import safetensors_header
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        shapes.update(safetensors_header(f))
    return shapes


def flops_per_step(shapes: dict, layer_cfg: dict, tokens: int, seq: int) -> float:
    """6 x parameters passed per token (not the embedding, not the vocab
    maps) x tokens x TTT steps, plus attention (QK^T and PV, forward and
    backward: 3 x 2 x 2 x seq x head dims per token, layer and head)."""
    passed = sum(math.prod(s) for n, s in shapes.items()
                 if "embed_tokens" not in n and not n.endswith(("t2d", "d2t")) and len(s) > 1)
    heads = layer_cfg.get("num_attention_heads", 1)
    if layer_cfg.get("kv_lora_rank"):
        qk = layer_cfg["qk_nope_head_dim"] + layer_cfg["qk_rope_head_dim"]
        v = layer_cfg["v_head_dim"]
    else:
        qk = v = layer_cfg.get("head_dim") or layer_cfg["hidden_size"] // heads
    layers = layer_cfg.get("num_hidden_layers", 1)
    # TTT step k attends over the k previous steps' keys as well (speculators' Eagle-3)
    attn = sum(3 * 2 * seq * (qk + v) * heads * layers * (k + 1) for k in range(TTT_STEPS))
    return 6.0 * passed * tokens * TTT_STEPS + attn * tokens


def profile_step(ckpt: Path, seq: int, reps: int = 5) -> dict:
    """Training steps of the checkpoint's draft in this process, shaped as
    the trainer's (one packed row of `seq` tokens, the TTT steps with their
    loss, backward, AdamW): FLOPs counted by torch's FlopCounterMode (the
    matmuls and attention it knows; elementwise work is not FLOPs to it),
    the median time of `reps` steps after a warm-up, and the ops that took
    the time (torch.profiler, self CPU time, the top 6): where a slower
    draft spends it, arithmetic or not."""
    import statistics
    import time

    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.stages.train import choose_attention
    from pipeline.train.mla_layer import register
    register()
    torch.manual_seed(0)
    config = Eagle3DraftModel.config_class.from_pretrained(str(ckpt))
    # the attention the train stage gives speculators here (flex has no CPU backward)
    config.transformer_layer_config._attn_implementation = choose_attention("auto", "cpu")
    model = Eagle3DraftModel.from_pretrained(str(ckpt), config=config).float().train()
    hidden = model.fc.out_features
    hs = torch.randn(1, seq, model.fc.in_features)
    ids = torch.randint(0, model.embed_tokens.num_embeddings, (1, seq))
    doc, mask = torch.zeros(1, seq, dtype=torch.long), torch.ones(1, seq)
    last = torch.randn(1, seq, hidden)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    from speculators.losses import resolve_loss_config

    from pipeline.stages.train import choose_loss
    # the loss implementation the train stage gives speculators here (KL, its default)
    loss_config = resolve_loss_config("kl_div", choose_loss("auto", "cpu", torch.__version__)[0])

    def step():
        _, loss, _ = model(hs, ids, doc, loss_mask=mask, verifier_last_hidden_states=last,
                           ttt_steps=TTT_STEPS, loss_config=loss_config)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()   # warm-up (allocations, lazy inits)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1
    return {"flops": counter.get_total_flops(), "s_per_step": statistics.median(times),
            "attention": getattr(model, "_attn_impl", "?"),
            "top_ops": [(e.key, round(e.self_cpu_time_total / total, 3)) for e in ops[:6]]}


def one_layer(base_run: Path, folder: Path, base: dict, layer: str) -> dict:
    run = folder / "runs" / layer
    shutil.copytree(base_run, run, copy_function=os.link)
    cfg = merged(base, {"stages": {"train": {"draft_layer": layer}}})
    config = folder / f"{layer}.toml"
    config.write_text(render(cfg))
    wall = stage_process.run(run, config, "train")
    evs = events(run, "train")
    summary = [e for e in evs if e["type"] == "stage_finished"][-1]["summary"]
    rates = [e["rate"] for e in evs if e["type"] == "progress" and e.get("rate")]
    steps = max(e["done"] for e in evs if e["type"] == "progress" and e.get("unit") == "steps")
    ckpt = Path(summary["checkpoint"])
    layer_cfg = json.loads((ckpt / "config.json").read_text()).get("transformer_layer_config", {})
    return {"layer": summary.get("draft_layer", layer), "steps": steps, "wall_s": wall,
            "steps_per_s": rates[-1] if rates else None, "shapes": draft_params(ckpt),
            "layer_cfg": layer_cfg, "estimate": summary.get("acceptance_length"),
            "profiled": profile_step(ckpt, int(base["stages"]["train"]["total_seq_len"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--total-seq-len", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-draft-"))
    try:
        base = {"run": {"name": "base", "runs_dir": str(folder / "runs")},
                "model": {"target": "builtin:tiny-kimi", "trust_remote_code": True},
                "data": {"max_samples": a.samples},
                "stages": {"regenerate": {"enabled": False}, "prepare": {"seq_length": 256},
                           "extract": {"backend": "hf", "layer_ids": [1, 2, 3]},
                           "vocab": {"draft_vocab_size": 256},
                           "train": {"epochs": a.epochs, "lr": 0.003,
                                     "total_seq_len": a.total_seq_len},
                           "evaluate": {"enabled": False}}}
        config = folder / "base.toml"
        config.write_text(render(base))
        run = folder / "runs" / "base"
        for name in ("prepare", "extract", "vocab"):
            print(f"  {name}: {stage_process.run(run, config, name):.0f} s", flush=True)
        out = {name: one_layer(run, folder, base, name) for name in ("llama", "mla")}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nbuiltin:tiny-kimi, {a.samples} samples, {a.epochs} epochs at total_seq_len "
          f"{a.total_seq_len}, {TTT_STEPS} TTT steps:")
    for name, r in out.items():
        r["flops_per_step"] = flops_per_step(r["shapes"], r["layer_cfg"], a.total_seq_len,
                                             a.total_seq_len)
        r["s_per_step"] = 1 / r["steps_per_s"] if r["steps_per_s"] else None
        params = sum(math.prod(s) for s in r.pop("shapes").values())
        r["params"] = params
        print(f"{name:6} {r['steps']} steps, {r['steps_per_s']:.2f} steps/s "
              f"({r['s_per_step'] * 1000:.0f} ms a step), {params:,} parameters, "
              f"~{r['flops_per_step'] / 1e9:.2f} GFLOP a step (estimate), train {r['wall_s']:.1f} s"
              f" wall, train's acceptance estimate {r['estimate'] or 0:.3f}", flush=True)
    m, ll = out["mla"], out["llama"]
    time_ratio = m["s_per_step"] / ll["s_per_step"]
    flop_ratio = m["flops_per_step"] / ll["flops_per_step"]
    print(f"mla / llama: time per step {time_ratio:.2f}x, FLOPs per step {flop_ratio:.2f}x "
          f"(estimate): {time_ratio / flop_ratio:.2f}x per FLOP (goal <= 1.2x)")
    for name, r in out.items():
        p = r["profiled"]
        print(f"{name:6} profiled in process: {p['s_per_step'] * 1000:.0f} ms a step, "
              f"{p['flops'] / 1e9:.2f} GFLOP counted (FlopCounterMode), attention "
              f"{p['attention']}; time by op: "
              + ", ".join(f"{k} {v:.0%}" for k, v in p["top_ops"]))
    pm, pl = out["mla"]["profiled"], out["llama"]["profiled"]
    p_time, p_flops = pm["s_per_step"] / pl["s_per_step"], pm["flops"] / pl["flops"]
    print(f"mla / llama (profiled): time per step {p_time:.2f}x, FLOPs per step {p_flops:.2f}x "
          f"(counted): {p_time / p_flops:.2f}x per FLOP (goal <= 1.2x)")
    for r in out.values():
        r.pop("layer_cfg")
    if a.json:
        a.json.write_text(json.dumps({"runs": out, "time_ratio": time_ratio,
                                      "flop_ratio": flop_ratio,
                                      "per_flop_ratio": time_ratio / flop_ratio,
                                      "profiled_per_flop_ratio": p_time / p_flops}, indent=1))


if __name__ == "__main__":
    main()
