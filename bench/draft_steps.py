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
the draft's parameters from its checkpoint, and a FLOP estimate per step
(flops_per_step: the matmuls a token passes through, forward and the
gradients each needs, plus attention's QK and PV products; MLA: q/k heads of
nope + rope, v of v_head_dim). An estimate, said as one: the ratio of ratios
(time / FLOPs, MLA over Llama) is the figure the goal is about.

    python bench/draft_steps.py --synthetic kimi-k2.5 --device cuda --dtype bfloat16 \
        --attention simple_flex_attention,sdpa,sdpa:pad --total-seq-len 8192

--synthetic: no data and no training, both drafts untrained at a target's
shapes (tiny-kimi, or Kimi-K2.5's on a GPU), each with every attention
implementation asked for (`:pad` / `:nopad`: the MLA layer's v forced padded
to q/k's size or left narrower; unsuffixed, its own rule, pipeline.train.
mla_layer.pads_v), profiled in this process: ms a step, the ops that took
the time, and the ratio of each draft's fastest, per FLOP under both
estimates (dense: every key the mask spans; causal: the keys it keeps).
`skip` among them times each draft's step without attention's arithmetic
(see skip_attention): the step less it is attention in context, and MLA over
Llama per FLOP outside attention is measured rather than inferred.
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


def flops_per_step(shapes: dict, layer_cfg: dict, tokens: int, seq: int,
                   causal: bool = False, attention: bool = True) -> float:
    """The matmuls of one step, per token: the decoder layers' weights 6x
    (forward, both gradients) at each TTT step; the frozen lm_head 4x at
    each (forward, its input's gradient); fc 4x once (it runs before the
    TTT loop, and its input, the verifier's states, needs no gradient); not
    the embedding lookup, the vocab maps, or the verifier head (forward
    only, once, and a checkpoint leaves it out). Plus attention (QK^T and
    PV, forward and backward: 3 x 2 x keys x head dims per token, layer and
    head). TTT step k attends over the k previous steps' keys as well
    (speculators' Eagle-3): `seq` x (k + 1) keys, what a dense mask computes
    (SDPA, eager); `causal`: only the keys the mask keeps, (seq + 1) / 2 on
    average + k, what a block-sparse kernel (flex attention) approaches, the
    arithmetic a draft needs (documents packed in a row keep fewer still).
    `attention` False: the rest only (what a `skip` row computes).
    Checked against torch's FlopCounterMode (matmuls, the verifier head
    taken out): equal at tiny-kimi's shapes and Kimi-K2.5's. Before
    2026-12-04 it charged fc and lm_head 6x at every TTT step: the same
    excess in both drafts (outside attention +10-14% at tiny-kimi's shapes,
    +25-28% at Kimi-K2.5's), which pulled MLA over Llama towards 1."""
    def weights(prefix: str) -> int:   # 1-D tensors (norms) are not matmuls
        return sum(math.prod(s) for n, s in shapes.items() if n.startswith(prefix) and len(s) > 1)
    layer, head, fc = weights("layers."), weights("lm_head."), weights("fc.")
    heads = layer_cfg.get("num_attention_heads", 1)
    if layer_cfg.get("kv_lora_rank"):
        qk = layer_cfg["qk_nope_head_dim"] + layer_cfg["qk_rope_head_dim"]
        v = layer_cfg["v_head_dim"]
    else:
        qk = v = layer_cfg.get("head_dim") or layer_cfg["hidden_size"] // heads
    layers = layer_cfg.get("num_hidden_layers", 1)
    keys = [(seq + 1) / 2 + k if causal else seq * (k + 1) for k in range(TTT_STEPS)]
    attn = sum(3 * 2 * n * (qk + v) * heads * layers for n in keys)
    matmuls = (6.0 * layer + 4.0 * head) * TTT_STEPS + 4.0 * fc
    return matmuls * tokens + (attn * tokens if attention else 0.0)


def ratio_line(what: str, m: dict, ll: dict) -> str:
    """MLA over Llama: time per step, FLOPs per step (the dense and the
    causal estimate) and time per FLOP under each (issue 36's goal: 1.2x)."""
    t = m["s_per_step"] / ll["s_per_step"]
    f = m["flops_per_step"] / ll["flops_per_step"]
    fc = m["flops_causal"] / ll["flops_causal"]
    return (f"{what}: time per step {t:.2f}x, FLOPs per step {f:.2f}x (estimate): "
            f"{t / f:.2f}x per FLOP (goal <= 1.2x); causal keys only: FLOPs {fc:.2f}x, "
            f"{t / fc:.2f}x per FLOP")


def step_inputs(model, seq: int, device: str, dtype):
    """One packed row of `seq` tokens shaped as the trainer feeds them."""
    import torch
    g = torch.Generator().manual_seed(0)
    hidden = model.fc.out_features
    hs = torch.randn(1, seq, model.fc.in_features, generator=g).to(device, dtype)
    ids = torch.randint(0, model.embed_tokens.num_embeddings, (1, seq), generator=g).to(device)
    doc = torch.zeros(1, seq, dtype=torch.long, device=device)
    mask = torch.ones(1, seq, device=device)
    last = torch.randn(1, seq, hidden, generator=g).to(device, dtype)
    return hs, ids, doc, mask, last


def trainer_step(model, seq: int, device: str, pad: bool | None = None):
    """One training step of `model` as a closure, shaped as the trainer's
    (one packed row of `seq` tokens, the TTT steps with their loss, backward,
    AdamW; the loss implementation the train stage picks on the device).
    `pad` forces the MLA layer's v padded (True) or narrow (False) while the
    step runs, whatever its own rule says."""
    import torch
    from speculators.losses import resolve_loss_config

    from pipeline.stages.train import choose_loss
    from pipeline.train import mla_layer
    cuda = device.startswith("cuda")
    dtype = next(model.parameters()).dtype
    hs, ids, doc, mask, last = step_inputs(model, seq, device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss_config = resolve_loss_config(
        "kl_div", choose_loss("auto", "cuda" if cuda else "cpu", torch.__version__)[0])

    # one function for the row's every step: under torch.compile (CUDA) dynamo
    # guards on the global's identity, and a new one each step would recompile
    forced = None if pad is None else (lambda *_: pad)

    def step():
        rule = mla_layer.pads_v
        if forced is not None:
            mla_layer.pads_v = forced
        try:
            _, loss, _ = model(hs, ids, doc, loss_mask=mask, verifier_last_hidden_states=last,
                               ttt_steps=TTT_STEPS, loss_config=loss_config)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            mla_layer.pads_v = rule
        if cuda:
            torch.cuda.synchronize()
    return step


def interleaved(steps: dict, reps: int) -> tuple[dict, dict]:
    """`reps` rounds of one step of each in turn: the times of each, and the
    errors of those that failed (an OOM with every row resident: the row
    leaves the rotation, the others go on). On a shared machine the speed
    drifts over seconds; rows timed one after the other measured the second
    draft 1.10x to 1.46x the first across runs of one setup on 2 cores,
    interleaved 1.26x to 1.40x over three runs."""
    import time
    times: dict = {name: [] for name in steps}
    failed: dict = {}
    for _ in range(reps):
        for name, step in steps.items():
            if name in failed:
                continue
            t0 = time.perf_counter()
            try:
                step()
            except Exception as e:  # noqa: BLE001 (an OOM, a compile error: the others still run)
                failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
                free_device_cache()
                continue
            times[name].append(time.perf_counter() - t0)
    return times, failed


def free_device_cache() -> None:
    """After a failed step: what it held goes back to the GPU for the others."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_once(step, device: str, count: bool = True) -> dict:
    """One more step under torch's FlopCounterMode (the matmuls it knows; it
    has no formula for torch's CPU flash attention, so fused SDPA on CPU
    counts 0, SDPA's math path its bmm; elementwise work is not FLOPs to it)
    and one under torch.profiler: the ops that took the time (self time on
    the device, the top 6), where a slower draft spends it."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    cuda = device.startswith("cuda")
    flops = None
    if count:
        counter = FlopCounterMode(display=False)
        with counter:
            step()
        flops = counter.get_total_flops()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        step()

    def self_time(e):
        return e.self_device_time_total if cuda else e.self_cpu_time_total
    ops = sorted(prof.key_averages(), key=self_time, reverse=True)
    total = sum(self_time(e) for e in ops) or 1
    # top_ops: where the time goes (by time: it moves with the machine's load); ops: every
    # op that ran, which kernel a call dispatched to (a fact of the step, not of its time)
    return {"flops": flops, "top_ops": [(e.key, round(self_time(e) / total, 3)) for e in ops[:6]],
            "ops": sorted(e.key for e in ops)}


def profile_trained(ckpts: dict[str, Path], seq: int, reps: int = 9) -> dict[str, dict]:
    """Each trained checkpoint's draft reloaded in this process with the
    attention the train stage gives speculators on CPU (flex has no CPU
    backward), their steps timed interleaved, then profiled."""
    import statistics

    import torch
    from speculators.models.eagle3 import Eagle3DraftModel

    from pipeline.stages.train import choose_attention
    from pipeline.train.mla_layer import register
    register()
    attention = choose_attention("auto", "cpu")
    steps = {}
    for name, ckpt in ckpts.items():
        torch.manual_seed(0)
        config = Eagle3DraftModel.config_class.from_pretrained(str(ckpt))
        config.transformer_layer_config._attn_implementation = attention
        model = Eagle3DraftModel.from_pretrained(str(ckpt), config=config).float().train()
        steps[name] = trainer_step(model, seq, "cpu")
        steps[name]()   # warm-up (allocations, lazy inits)
    times, failed = interleaved(steps, reps)
    if failed:
        raise RuntimeError(f"a trained draft's step failed: {failed}")
    return {name: {"s_per_step": statistics.median(times[name]), "attention": attention,
                   **profile_once(steps[name], "cpu")} for name in steps}


# Kimi-K2.5's text model (DeepSeek-V3 shapes; its yarn rope left out: the
# draft's rope does not change a step's arithmetic), for --synthetic on a GPU
KIMI_K25 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=163840,
    hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=64,
    num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, hidden_act="silu", rms_norm_eps=1e-5,
    max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    initializer_range=0.02, tie_word_embeddings=False)
SHAPES = {"tiny-kimi": 256, "kimi-k2.5": 32000}   # shape -> draft vocabulary


def synthetic_verifier(folder: Path, shape: str) -> Path:
    """A config-only verifier folder of `shape` (no weights: the drafts
    built on it get random ones for the tensors they would take from the
    verifier, synthetic_draft)."""
    if shape == "tiny-kimi":
        from pipeline.builtin.tiny_kimi import TEXT_CONFIG
        raw = dict(TEXT_CONFIG)
    else:
        raw = dict(KIMI_K25)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def synthetic_draft(verifier: Path, layer: str, attention: str, draft_vocab: int):
    """An untrained one-layer EAGLE-3 draft of `layer` ("llama": speculators'
    own derivation from the verifier, as `speculators train` builds it
    without --draft-config; "mla": ours, pipeline.train.mla_draft), full
    attention in both (speculators' Llama default is a 2048-token sliding
    window: at longer rows it would do less arithmetic, not the same)."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.cli import create_transformer_layer_config
    from transformers import AutoConfig

    from pipeline.train.mla_draft import draft_layer_config
    from pipeline.train.mla_layer import register
    register()
    if attention == SKIP:
        from transformers import AttentionInterface
        AttentionInterface.register(SKIP, skip_attention)
    raw = json.loads((verifier / "config.json").read_text())
    if layer == "mla":
        cfg, _ = draft_layer_config(raw, 1)
        tl = AutoConfig.for_model(**cfg)
    else:
        tl = create_transformer_layer_config(str(verifier), 1, "llama", None, 2048, [0])
    tl._attn_implementation = attention
    n = raw["num_hidden_layers"]
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[2, n // 2, n - 3] if n >= 6 else [1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)],
            verifier=VerifierConfig.from_config(AutoConfig.from_pretrained(str(verifier)),
                                                name_or_path=str(verifier))))
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    # speculators leaves the tensors it takes from the verifier uninitialised
    # (load_verifier_weights fills them): left so, the loss and then every
    # weight were NaN after the first step, until 2026-12-04
    for frozen in (model.embed_tokens, model.lm_head, model.verifier_lm_head):
        torch.nn.init.normal_(frozen.weight, std=raw.get("initializer_range", 0.02))
    if attention == SKIP:
        model._create_mask_fn = no_mask
    t2d = torch.zeros(raw["vocab_size"], dtype=torch.bool)
    t2d[:draft_vocab] = True
    model.load_vocab_mappings(t2d, torch.zeros(draft_vocab, dtype=torch.long))
    return model


VARIANTS = {"": None, "pad": True, "nopad": False}   # the MLA layer's v: its own rule, forced
SKIP = "skip"   # an attention implementation that does none (skip_attention)


def skip_attention(module, query, key, value, attention_mask, **kwargs):
    """No attention, for the decomposition's rows: an output of attention's
    shape ([batch, seq, heads, v]) taken from the query, with every key and
    value summed in at zero weight so the gradients still reach them: the
    projections, norms, rope, the cache and their backward all run, and
    nothing of attention's arithmetic (a row's step less this row's is
    attention in context; speculators' mask is not built either)."""
    out = query[..., :value.shape[-1]] + 0.0 * (key.sum() + value.sum())
    return out.transpose(1, 2).contiguous(), None


def no_mask(*_args, **_kwargs):
    """speculators' mask builder for a `skip` row: no attention, no mask."""
    return None


def synthetic(a) -> None:
    """--synthetic: both drafts untrained at a target's shapes, each with the
    attention implementations asked for, built one after the other (a row
    that fails to build or to step is said and left out), then timed
    interleaved and profiled in this process."""
    import statistics
    asked = [x.partition(":") for x in a.attention.split(",")]
    rows = [(layer, impl, variant) for layer in ("llama", "mla") for impl, _, variant in asked
            if not (layer == "llama" and variant)]   # a variant is the MLA layer's
    folder = Path(tempfile.mkdtemp(prefix="bench-draft-"))
    try:
        verifier = synthetic_verifier(folder / "verifier", a.synthetic)
        built = [synthetic_one(verifier, layer, impl, variant, a)
                 for layer, impl, variant in rows]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    steps = {i: r.pop("step") for i, r in enumerate(built) if "step" in r}
    try:
        times, failed = interleaved(steps, a.reps)
        for i, r in enumerate(built):
            if i in failed:
                r["error"] = failed[i]
            elif i in steps:
                r["s_per_step"] = statistics.median(times[i])
                try:
                    r.update(profile_once(steps[i], a.device,
                                          count=not a.device.startswith("cuda")))
                except Exception as e:  # noqa: BLE001 (as in interleaved)
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    free_device_cache()
            print(synthetic_row(r), flush=True)
    finally:
        if a.json:
            a.json.write_text(json.dumps(built, indent=1))
    ok = [r for r in built if "error" not in r]
    best = {layer: min((r for r in ok if r["layer"] == layer and r["attention"] != SKIP),
                       key=lambda r: r["s_per_step"], default=None) for layer in ("llama", "mla")}
    m, ll = best["mla"], best["llama"]
    if m and ll:
        print(ratio_line(f"mla ({m['attention']}) / llama ({ll['attention']}), each its fastest",
                         m, ll))
    decompose(ok)


def decompose(rows: list[dict]) -> None:
    """With `skip` rows: each row's attention in context (its step less its
    draft's skip step), and MLA over Llama outside attention, per FLOP."""
    skip = {r["layer"]: r for r in rows if r["attention"] == SKIP}
    for r in rows:
        if r["attention"] != SKIP and r["layer"] in skip:
            ms = (r["s_per_step"] - skip[r["layer"]]["s_per_step"]) * 1000
            print(f"{r['layer']:6} {r['attention']:22} attention in context: {ms:.1f} ms "
                  f"({ms / (r['s_per_step'] * 1000):.0%} of the step)")
    if "mla" in skip and "llama" in skip:
        t = skip["mla"]["s_per_step"] / skip["llama"]["s_per_step"]
        f = skip["mla"]["flops_per_step"] / skip["llama"]["flops_per_step"]
        print(f"mla / llama outside attention ({SKIP}): time per step {t:.2f}x, FLOPs per step "
              f"{f:.2f}x (estimate): {t / f:.2f}x per FLOP")


def synthetic_one(verifier: Path, layer: str, impl: str, variant: str, a) -> dict:
    """One row built: the draft on the device, its step warmed up (on CUDA
    speculators compiles the forward: the first step's time), its own peak
    memory (what the rows built before it hold left out), its FLOP
    estimates, and its step closure; an error (an OOM, a compile failure)
    is the row's, not the run's."""
    import time

    import torch
    cuda = a.device.startswith("cuda")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    r: dict = {"layer": layer, "attention": f"{impl}:{variant}" if variant else impl}
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        model = synthetic_draft(verifier, layer, impl, SHAPES[a.synthetic])
        model = model.to(a.device, dtype).train()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        cfg = model.config.transformer_layer_config.to_dict()
        step = trainer_step(model, a.total_seq_len, a.device, VARIANTS[variant])
        t0 = time.perf_counter()
        step()
        r["first_step_s"] = time.perf_counter() - t0
        step()
    except Exception as e:  # noqa: BLE001 (an OOM, a compile error: the others still run)
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        free_device_cache()
        return r
    if cuda:
        r["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    r["params"] = sum(math.prod(x) for n, x in shapes.items() if not n.startswith("verifier_"))
    seq, attention = a.total_seq_len, impl != SKIP
    r["flops_per_step"] = flops_per_step(shapes, cfg, seq, seq, attention=attention)
    r["flops_causal"] = flops_per_step(shapes, cfg, seq, seq, causal=True, attention=attention)
    r["step"] = step
    return r


def synthetic_row(r: dict) -> str:
    """A row as the bench prints it (the test reads these lines)."""
    head = f"{r['layer']:6} {r['attention']:22}"
    if "error" in r:
        return f"{head} failed: {r['error']}"
    peak = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") else ""
    return (f"{head} {r['s_per_step'] * 1000:.1f} ms a step (first {r['first_step_s']:.1f} s)"
            f", {r['params']:,} parameters, ~{r['flops_per_step'] / 1e9:.1f} GFLOP a step "
            f"(estimate; {r['flops_causal'] / 1e9:.1f} causal){peak}; time by op: "
            + ", ".join(f"{k[:40]} {v:.0%}" for k, v in r["top_ops"]))


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
            "checkpoint": ckpt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--total-seq-len", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--synthetic", choices=sorted(SHAPES),
                    help="no data, no training: both drafts untrained at this target's "
                         "shapes, profiled in this process (kimi-k2.5 wants a GPU)")
    ap.add_argument("--device", default="cpu", help="with --synthetic: cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--attention", default="sdpa",
                    help="with --synthetic: comma-separated attention implementations "
                         "(sdpa, eager, simple_flex_attention, and skip: none, each draft's "
                         "step without attention); a suffix :pad or :nopad forces the MLA "
                         "layer's v padded to q/k's size or left narrower")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: the median of at least one timed step (1 or more)")
    if a.synthetic:
        if a.synthetic == "kimi-k2.5" and not a.device.startswith("cuda"):
            ap.error("--synthetic kimi-k2.5 wants a GPU (~19 GiB, a step of minutes on CPU): "
                     "add --device cuda, or take --synthetic tiny-kimi")
        wrong = [x for x in a.attention.split(",") if x.partition(":")[2] not in VARIANTS]
        if wrong:
            ap.error(f"--attention {','.join(wrong)}: a variant is :pad or :nopad (the MLA "
                     "layer's v padded to q/k's size, or left narrower)")
        if any(x.startswith(SKIP + ":") for x in a.attention.split(",")):
            ap.error(f"--attention {SKIP}: no attention, no v to pad (take {SKIP} alone)")
        synthetic(a)
        return
    given = [name for name in ("device", "dtype", "attention", "reps")
             if getattr(a, name) != ap.get_default(name)]
    if given:
        ap.error(f"{', '.join('--' + name for name in given)} only apply with --synthetic")
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
        profiled = profile_trained({name: r.pop("checkpoint") for name, r in out.items()},
                                   a.total_seq_len)
        for name, r in out.items():
            r["profiled"] = profiled[name]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nbuiltin:tiny-kimi, {a.samples} samples, {a.epochs} epochs at total_seq_len "
          f"{a.total_seq_len}, {TTT_STEPS} TTT steps:")
    for name, r in out.items():
        seq = a.total_seq_len
        r["flops_per_step"] = flops_per_step(r["shapes"], r["layer_cfg"], seq, seq)
        r["flops_causal"] = flops_per_step(r["shapes"], r["layer_cfg"], seq, seq, causal=True)
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
    print(ratio_line("mla / llama", m, ll))
    for name, r in out.items():
        p = r["profiled"]
        print(f"{name:6} profiled in process: {p['s_per_step'] * 1000:.0f} ms a step, "
              f"{p['flops'] / 1e9:.2f} GFLOP counted (FlopCounterMode), attention "
              f"{p['attention']}; time by op: "
              + ", ".join(f"{k} {v:.0%}" for k, v in p["top_ops"]))
    pm, pl = out["mla"]["profiled"], out["llama"]["profiled"]
    p_time, p_flops = pm["s_per_step"] / pl["s_per_step"], pm["flops"] / pl["flops"]
    print(f"mla / llama (profiled): time per step {p_time:.2f}x, FLOPs per step {p_flops:.2f}x "
          f"(counted): {p_time / p_flops:.2f}x per FLOP (FlopCounterMode counts no CPU flash "
          "attention: matmuls only)")
    for r in out.values():
        r.pop("layer_cfg")
    if a.json:
        a.json.write_text(json.dumps({"runs": out, "time_ratio": time_ratio,
                                      "flop_ratio": flop_ratio,
                                      "per_flop_ratio": time_ratio / flop_ratio,
                                      "profiled_per_flop_ratio": p_time / p_flops}, indent=1))


if __name__ == "__main__":
    main()
