"""doctor's checks of the target and the GPUs it runs on: GPUs present
against configured, the target's config (read from config.json, no code
run), its layer ids (hybrid and sparse ones too), tensor-parallel sizes and
sequence lengths against its shapes, and whether the installed vLLM serves
it with an EAGLE-3 draft and the configured algorithm's drafts."""

from __future__ import annotations

import os

from pipeline.config import Config
from pipeline.doctor.findings import BLOCK, OK, WARN, Finding, check, size_text
from pipeline.doctor.inputs import Inputs, serves_vllm
from pipeline.model.info import ModelInfo, describe_layers, validate_layer_ids
from pipeline.vllm import compat


@check(50, launch=20)
def check_gpus(x: Inputs) -> list[Finding]:
    configured = x.cfg.gpus.devices
    if x.gpus is None and configured and x.cfg.cluster.scheduler == "slurm":
        return [Finding("gpus", OK, f"no GPU on this machine (a login node); the jobs get "
                        f"GPUs {configured} on the compute nodes: planned with "
                        + (f"{x.cfg.gpus.memory_gb:g} GB each ([gpus] memory_gb)"
                           if x.cfg.gpus.memory_gb else "no memory size ([gpus] memory_gb)"))]
    if x.gpus is None:
        level = BLOCK if configured else OK
        return [Finding("gpus", level, "no NVIDIA driver / GPU found"
                        + (f", but [gpus] devices = {configured}" if configured else
                           "; stages run on the CPU"),
                        "run on the GPU server, or set [gpus] devices = []"
                        if level == BLOCK else "")]
    names = sorted({g["name"] for g in x.gpus})
    out = [Finding("gpus", OK, f"{len(x.gpus)} GPU(s): {', '.join(names)}; configured "
                   f"{configured or 'none (CPU)'}")]
    missing = [d for d in configured if d >= len(x.gpus)]
    if missing:
        out.append(Finding("gpus", BLOCK, f"[gpus] devices names GPU {missing} but this "
                           f"machine has {len(x.gpus)}", "fix [gpus] devices"))
    return out


@check(60, launch=30)
def check_model(x: Inputs) -> list[Finding]:
    from pipeline.model import hub
    # a hub id: its revision and commit, the snapshot, its size, the files vLLM
    # needs (with [model] download = true and nothing cached: what the Hub has)
    out = [Finding("model", level, message, fix) for level, message, fix in hub.report(x.cfg)]
    if x.model is None:
        if out and any(f.level == BLOCK for f in out):
            return out
        if hub.download_pending(x.cfg):
            return out + [Finding("model", OK, "the target's shapes: a launch checks them "
                                  "against the config.json the Hub serves; doctor, once it is "
                                  "downloaded")]
        return out + [Finding("model", BLOCK, f"cannot read the target's config.json: "
                              f"{x.extra.get('model_error')}",
                              "point [model] target at a local HF model folder or a Hugging "
                              "Face id (ORG/NAME) in the cache")]
    m = x.model
    kind = "MLA" if m.mla else ("GQA" if m.kv_heads < m.heads else "MHA")
    if m.hybrid or set(m.kinds) - {"mla", "attn"}:
        kind = f"hybrid/sparse ({describe_layers(m)})"
    out += [Finding("model", OK, f"{m.architecture} ({m.model_type}): {m.layers} layers, hidden "
                   f"{m.hidden}, {m.heads} heads / {m.kv_heads} KV heads, {kind} attention, "
                   f"{m.dtype}" + (", decoder under text_config (multimodal wrapper)"
                                   if m.wrapped else "")
                   + (f", weights {size_text(m.weights_bytes)}" if m.weights_bytes else "")
                   + (f"; quantized: {m.quant.text()}" if m.quant else ""))]
    if m.quant is not None and (m.quant.problem or not m.quant.known):
        out.append(Finding("model", WARN, f"the target's quantization_config (config.json): "
                           f"{m.quant.problem or m.quant.text()}; doctor cannot say what it "
                           "quantizes", "vLLM's own check below still asks whether it can "
                           "build the model; report the method if it is a released format"))
    if m.needs_remote_code and not x.cfg.model.trust_remote_code:
        out.append(Finding("model", BLOCK, "the target's config or tokenizer has auto_map "
                           "(custom code) and [model] trust_remote_code = false",
                           "set [model] trust_remote_code = true if you trust this model's code"))
    elif m.needs_remote_code:
        out.append(Finding("model", OK, "custom code (auto_map): trust_remote_code is on and is "
                           "passed to every tokenizer/config load and to vLLM"))
    return out


@check(65, launch=36)
def check_heads(x: Inputs) -> list[Finding]:
    """The target's embed_tokens and lm_head, which train copies into the
    draft (speculators' load_verifier_weights), unquantized in its files: a
    quantized one would reach the draft as packed or unscaled values, or the
    embedding would stand in for a missing lm_head.weight, silently. Read
    from the safetensors headers (quant.quantized_heads)."""
    m = x.model
    if m is None or not m.quantized_heads:
        return []
    return [Finding("model", BLOCK, "train copies the target's embed_tokens and lm_head into "
                    "the draft, and this target holds them quantized: "
                    f"{'; '.join(m.quantized_heads)} (speculators would take the stored values "
                    "as weights, or the embedding for a missing lm_head.weight)",
                    "use a checkpoint whose embed_tokens and lm_head are unquantized (as "
                    "Kimi-K2.5, DeepSeek-V3 and Kimi-K2 ship them: their quantization "
                    "config ignores lm_head)")]


@check(70, launch=40)
def check_layers(x: Inputs) -> list[Finding]:
    if x.model is None:
        return []
    m = x.model
    try:
        x.layer_ids = validate_layer_ids(list(x.cfg.stages.extract.layer_ids), m.layers)
    except ValueError as e:
        return [Finding("layers", BLOCK, f"[stages.extract] layer_ids: {e}",
                        "edit [stages.extract] layer_ids" + (
                            f", e.g. [2, {m.layers // 2}, {m.layers - 3}]" if m.layers >= 6
                            else ""))]
    return [Finding("layers", OK, f"aux layer ids {x.layer_ids[:-1]} + last {x.layer_ids[-1]} "
                    "(vLLM convention) are valid for {} layers".format(m.layers))]


@check(80)
def check_hybrid(x: Inputs) -> list[Finding]:
    """Hybrid and sparse targets (Kimi-K3/Kimi-Linear: KDA + MLA, Qwen3-Next:
    gated delta net + attention, DeepSeek-V3.2/GLM-MoE-DSA, DeepSeek-V4):
    which layers the aux hidden states come from, and what the vLLM routes
    can do with them."""
    m = x.model
    if m is None or x.layer_ids is None or not (m.hybrid or set(m.kinds) - {"mla", "attn"}):
        return []
    names = {"linear": (m.linear or {}).get("kind", "linear"), "mla": "MLA", "attn": "attention",
             "dsa": "DSA"}
    which = ", ".join(f"{k} ({names.get(m.kinds[k - 1], m.kinds[k - 1])})" if k else "0 (embeddings)"
                      for k in x.layer_ids[:-1])
    out = [Finding("layers", OK, f"{describe_layers(m)}: aux ids {which} - every decoder "
                   "layer's output is the residual stream whatever its attention, so each can "
                   "give EAGLE-3 aux hidden states (vLLM takes any layer id)")]
    if serves_vllm(x) and x.vllm is not None and x.vllm.cpu_build and "linear" in m.kinds:
        gdn = x.source is not None and x.source.has_module(compat.CPU_GDN_MODULE)
        if m.linear and m.linear["kind"] == "KDA" or not gdn:
            stages = [s for s in ("regenerate", "evaluate") if x.cfg.enabled(s)]
            out.append(Finding("layers", WARN, f"vLLM {x.vllm.version}'s CPU build has no "
                               f"{m.linear['kind'] if m.linear else 'linear-attention'} kernel "
                               "(its CPU path is the gated delta net's, "
                               f"vllm.{compat.CPU_GDN_MODULE}): vLLM cannot serve this target "
                               "here" + (f" ({', '.join(stages)} would fail)" if stages else ""),
                               'extract with backend = "hf" or "auto" (it picks hf here); '
                               "disable regenerate / evaluate, or run them on a GPU build"))
    if x.vllm is not None and x.vllm.cpu_build and x.source is not None and \
            m.linear and m.linear["kind"] != "KDA":
        devices = x.cfg.stage_devices("extract")
        why = compat.cpu_gdn_dtype_problem(x.source, x.cfg.dtype_name(bool(devices)))
        uses = ([f"extract (backend {x.backend})"] if x.uses_vllm else []) + \
            [s for s in ("regenerate", "evaluate") if x.cfg.enabled(s)]
        if why and uses:
            out.append(Finding("layers", BLOCK, f"{why}: {', '.join(uses)} would fail at the "
                               "first request, after a whole server start",
                               '[model] dtype = "bfloat16" (or extract with backend = "hf" and '
                               "disable regenerate / evaluate)"))
    if x.backend == "vllm-engine" and x.source is not None:
        bad = compat.decoder_layer_mismatch(x.source, m.architecture)
        if bad:
            out.append(Finding("layers", BLOCK, bad, 'use backend = "vllm-server" (vLLM\'s own '
                               'aux hidden states) or "hf"'))
    return out


def vllm_servers(cfg: Config) -> list[tuple[str, int]]:
    """(what, tensor-parallel size) of each kind of vLLM server the run starts:
    extract's (and online train's) per `tensor_parallel` group, regenerate's and
    evaluate's over all of their GPUs."""
    out = []
    ext = cfg.stages.extract
    if cfg.online or ext.backend != "hf":
        out.append(("[stages.extract] tensor_parallel", max(1, ext.tensor_parallel)))
    for stage in ("regenerate", "evaluate"):
        if cfg.enabled(stage):
            out.append((f"[stages.{stage}]'s server (its GPUs: {cfg.stage_devices(stage)})",
                        max(1, len(cfg.stage_devices(stage)))))
    return out


def tp_sizes(m: ModelInfo, upto: int = 64) -> list[int]:
    """Tensor-parallel sizes vLLM accepts for this model: they divide the
    attention heads, and the KV heads divide them or they divide the KV heads
    (each rank then holds a copy). MLA has one latent, copied on every rank."""
    ok = []
    for tp in range(1, upto + 1):
        if m.heads % tp:
            continue
        if not m.mla and m.kv_heads % tp and tp % m.kv_heads:
            continue
        ok.append(tp)
    return ok


@check(90, launch=50)
def check_shapes(x: Inputs) -> list[Finding]:
    """What a launch on GPUs breaks on after minutes of loading: tensor
    parallel against the heads, sequence lengths against the target's
    positions, the draft's vocabulary and tokens against the target's."""
    if x.model is None:
        return []
    m, cfg, out = x.model, x.cfg, []
    heads = f"{m.heads} attention heads" + ("" if m.mla else f" / {m.kv_heads} KV heads")
    for what, tp in vllm_servers(cfg):
        if tp not in tp_sizes(m, max(tp, 1)):
            fits = [t for t in tp_sizes(m) if t <= 64]
            out.append(Finding("shapes", BLOCK, f"{what}: tensor-parallel size {tp} does not "
                               f"fit the target's {heads} (vLLM refuses it at startup)",
                               f"use a size in {fits[:8]}"))
    sec = cfg.stages
    if m.max_position:
        need = [("[stages.prepare] seq_length", sec.prepare.seq_length + 8)]
        if cfg.enabled("regenerate"):
            need.append(("[stages.prepare] seq_length + [stages.regenerate] max_tokens",
                         sec.prepare.seq_length + sec.regenerate.max_tokens + 8))
        if cfg.enabled("evaluate"):
            need.append(("[stages.prepare] seq_length + [stages.evaluate] max_tokens",
                         sec.prepare.seq_length + sec.evaluate.max_tokens + 8))
        for what, n in need:
            if n > m.max_position:
                out.append(Finding("shapes", BLOCK, f"{what} (+8) = {n:,} tokens per request, "
                                   f"more than the target's max_position_embeddings "
                                   f"{m.max_position:,}", f"lower {what.split(' + ')[-1]}"))
    if m.vocab_size and cfg.enabled("vocab") and sec.vocab.draft_vocab_size > m.vocab_size:
        out.append(Finding("shapes", BLOCK, f"[stages.vocab] draft_vocab_size "
                           f"{sec.vocab.draft_vocab_size:,} is larger than the target's vocabulary "
                           f"({m.vocab_size:,} tokens)",
                           f"set draft_vocab_size <= {m.vocab_size} (32000 is usual)"))
    k, ttt = sec.evaluate.num_speculative_tokens, sec.train.ttt_steps
    from pipeline.train.algorithms import get
    eagle3_draft = get(sec.train.algorithm).eagle3_layers   # (the others: checked at load)
    if cfg.enabled("evaluate") and k > ttt and eagle3_draft:
        out.append(Finding("shapes", WARN, f"[stages.evaluate] num_speculative_tokens = {k} but "
                           f"the draft is trained for {ttt} ([stages.train] ttt_steps): "
                           "positions past it are drafted untrained and mostly rejected",
                           f"set num_speculative_tokens <= {ttt}, or ttt_steps = {k}"))
    if not out:
        tps = sorted({tp for _, tp in vllm_servers(cfg)})
        out.append(Finding("shapes", OK, f"{heads}: tensor-parallel {tps or '-'} fits; "
                           f"requests of up to {sec.prepare.seq_length:,} tokens within "
                           f"{m.max_position or '?'} positions"))
    return out


@check(100)
def check_eagle3(x: Inputs) -> list[Finding]:
    if not (x.uses_vllm and x.source is not None and x.model is not None):
        return []
    e3 = compat.eagle3_support(x.source, x.model.architecture)
    return [Finding("eagle3", BLOCK if e3.fires else OK, e3.detail,
                    "upgrade vLLM, or use the hf backend" if e3.fires else "", e3.key)]


@check(110)
def check_draft_method(x: Inputs) -> list[Finding]:
    """Whether the installed vLLM serves the [stages.train] algorithm's
    drafts (its model runners' unsupported lists, from its source): where
    not, evaluate is skipped with this reason, and train's estimate stands."""
    if not (x.cfg.enabled("evaluate") and x.vllm is not None and x.source is not None):
        return []
    from pipeline.train.algorithms import ALGORITHMS, get
    algo = get(x.cfg.stages.train.algorithm)
    environ = {**os.environ, **x.cfg.runtime.env, **x.cfg.stage("evaluate").env}

    def why_not(a):
        return compat.draft_method_unservable(x.source, a.vllm_method, x.vllm.triton, environ,
                                              a.architectures, tuple(a.vllm_extra),
                                              a.speculator_type)
    why = why_not(algo)
    if why is None:
        return [Finding("evaluate", OK, f"vLLM {x.vllm.version} serves {algo.display} drafts "
                                        f"(method {algo.vllm_method!r})")]
    served = [a.name for a in ALGORITHMS.values() if why_not(a) is None]
    return [Finding("evaluate", WARN, f"{algo.display}: {why}; evaluate will be skipped, and "
                                      "the run ends at train's estimate",
                    f"see the reason for what would serve it; or set [stages.train] algorithm "
                    f"to one this vLLM serves ({', '.join(served) or 'none'})")]
