"""doctor's plans, figures a launch would otherwise find out hours in: how
many times the run loads the target into a vLLM server, the KV cache per
GPU (or the CPU build's KV space), and the hidden states' disk forecast."""

from __future__ import annotations

import math
import shutil

from pipeline import fmt
from pipeline.config import Config
from pipeline.doctor.findings import BLOCK, GIB, OK, WARN, Finding, check, size_text
from pipeline.doctor.inputs import Inputs, count_rows, serves_vllm
from pipeline.model import fp8
from pipeline.model.info import (
    ModelInfo,
    describe_layers,
    hs_bytes_per_token,
    kv_bytes_per_token,
    recurrent_bytes_per_seq,
)
from pipeline.run.rundir import RunDir
from pipeline.vllm import contract_strings, draft_swap, start_history
from pipeline.vllm.environment import cpu_kv_space_gib
from pipeline.vllm.memory_fraction import default_fraction


def server_util(cfg: Config, src) -> tuple[float, str]:
    """(the share of each GPU the extract server takes, where that figure comes
    from): the run's own --gpu-memory-utilization, else the installed release's
    default by its own rule (pipeline/vllm/memory_fraction.py: 0.9, 0.92, or
    1.0 with 0.34's extensible KV cache on CUDA)."""
    args = list(cfg.stages.extract.server_args)
    for i, a in enumerate(args):
        if a.startswith(contract_strings.FLAG_GPU_UTIL):
            val = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return float(val), f"{contract_strings.FLAG_GPU_UTIL} in server_args"
            except ValueError:
                pass
    rule = default_fraction(src, cuda=True)
    return rule.fraction, rule.why


def evaluated_checkpoints(cfg: Config) -> int:
    """How many checkpoints evaluate measures (at most: train may stop early)."""
    which, train = cfg.stages.evaluate.checkpoints, cfg.stages.train
    if which == "all":   # one per epoch (epochs = 0: the budget rule's, up to max_epochs)
        return max(1, train.epochs or train.max_epochs)
    return int(which[5:]) if which.startswith("best-") else 1


def planned_loads(x: Inputs, swap_why: str | None) -> list[tuple[str, int, int, str]]:
    """(what, loads, tensor-parallel size, speculative method) of the target
    loads the run makes: a vLLM server's each (regenerate, extract's per
    data-parallel group, online train's, evaluate's and its baseline's);
    `swap_why`: why evaluate cannot swap drafts (None: one server)."""
    from pipeline.extract.shared_server import why_not as not_shared
    cfg, out = x.cfg, []
    every = max(1, len(cfg.stage_devices("regenerate")))
    shared = x.uses_vllm and not cfg.online and not_shared(cfg) is None
    if cfg.enabled("regenerate") and not shared:
        out.append(("regenerate", 1, every, ""))
    if x.uses_vllm:
        tp = max(1, cfg.stages.extract.tensor_parallel)
        groups = max(1, len(cfg.stage_devices("extract")) // tp)
        out.append(("regenerate + extract (one server: share_server)" if shared else
                    "train (online)" if cfg.online else "extract", groups, tp,
                    "" if cfg.online else "extract_hidden_states"))
    if cfg.enabled("evaluate"):
        sec, n = cfg.stages.evaluate, evaluated_checkpoints(cfg)
        tp = max(1, len(cfg.stage_devices("evaluate")))
        one = swap_why is None
        upto = "up to " if sec.checkpoints == "all" and not cfg.stages.train.epochs else ""
        out.append((f"evaluate ({upto}{n} checkpoint{'s' * (n > 1)}"
                    + (", the next ones swapped in)" if one and n > 1 else ")"),
                    1 if one else n, tp, "eagle3"))
        if sec.baseline:
            out.append(("evaluate's baseline", 1, tp, ""))
    return out


@check(160)
def check_target_loads(x: Inputs) -> list[Finding]:
    """The number a user pays for on a large target: how many times the run
    loads it into a vLLM server, and how long the last such start took on
    this machine (pipeline.vllm.start_history)."""
    if not serves_vllm(x):
        return []
    sec = x.cfg.stages.evaluate
    why = draft_swap.unavailable(x.source, sec.server_args) if sec.one_server else \
        "[stages.evaluate] one_server = false"
    plan = planned_loads(x, why)
    target = str(x.cfg.target_path())
    total, known, parts = 0, 0.0, []
    for what, n, tp, method in plan:
        last = start_history.last(f"{target}|tp={tp}|{method}")
        total += n
        took = f", ~{fmt.duration(last['elapsed_s'])} each here last time" if last else ""
        known += n * last["elapsed_s"] if last else 0.0
        parts.append(f"{what} {n}{took}")
    msg = f"{total} target load{'s' * (total != 1)}: " + "; ".join(parts)
    if known:
        msg += f" (~{fmt.duration(known)} of loading measured here)"
    out = [Finding("servers", OK, msg)]
    if x.cfg.enabled("evaluate") and sec.one_server and why and evaluated_checkpoints(x.cfg) > 1:
        out.append(Finding("servers", WARN, f"evaluate: a server per checkpoint ({why})",
                           "vLLM >= 0.32 loads a new draft into its running server"))
    return out


@check(170)
def check_kv_cache(x: Inputs) -> list[Finding]:
    """The plan is for where the stages will run: the CPU build's KV space
    when the config names no GPU, else the GPUs the config names (bf16) —
    whatever machine doctor runs on (a login node has none: [gpus] memory_gb)."""
    if not x.uses_vllm or x.model is None:
        return []
    sec = x.cfg.stages.extract
    tp = max(1, sec.tensor_parallel)
    if not x.cfg.gpus.devices:
        if x.vllm is not None and x.vllm.cpu_build:
            return [cpu_kv_plan(x.model, x.cfg, x.layer_ids)]
        return []
    util, why = (sec.gpu_memory_utilization, "[stages.extract] gpu_memory_utilization") \
        if x.backend == "vllm-engine" else server_util(x.cfg, x.source)
    return kv_plan(x.model, tp, planned_gpus(x), x.cfg, util, why)


def planned_gpus(x: Inputs) -> list[dict]:
    """The GPUs to plan with: this machine's, or [gpus] memory_gb each."""
    if x.gpus:
        return x.gpus
    gb = x.cfg.gpus.memory_gb
    return [{"index": d, "name": "planned", "memory_total": int(gb * 1e9)}
            for d in x.cfg.gpus.devices] if gb else []


def stored_per_token(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool) -> tuple[int, str]:
    """(bytes one token of hidden states takes on disk, how): the target's
    dtype, or FP8 with a float32 scale per token ([stages.extract]
    hidden_states_dtype)."""
    if cfg.stages.extract.hidden_states_dtype == "fp8":
        return fp8.bytes_per_token(n_layers, m.hidden), f"{n_layers} layers x {m.hidden} x 1 B FP8"
    elem = 4 if cfg.dtype_name(gpu) == "float32" else 2
    return hs_bytes_per_token(m, n_layers, elem), f"{n_layers} layers x {m.hidden} x {elem} B"


@check(180)
def check_disk(x: Inputs) -> list[Finding]:
    if x.model is None or x.layer_ids is None:
        return []
    gpu = bool(x.cfg.gpus.devices)
    bpt, how = stored_per_token(x.cfg, x.model, len(x.layer_ids), gpu)
    keep = x.cfg.stages.train.keep_generated_gb
    kept = f"; up to {keep:g} GB of what the servers generate is kept for later epochs" \
        if keep else ""
    if x.cfg.pipeline.mode == "online":
        return [Finding("disk", OK, f"online: hidden states are not kept on disk{kept}; the "
                        f"buffer holds the samples in flight, {bpt / 1024:.1f} KiB/token ({how}) "
                        f"x at most {x.cfg.stages.prepare.seq_length} tokens each")]
    if x.cfg.pipeline.mode == "hybrid":
        folder = RunDir(x.cfg.runs_dir() / x.cfg.run.name).out_dir("extract") / "hidden_states"
        files = list(folder.glob("hs_*.safetensors")) if folder.is_dir() else []
        size = sum(f.stat().st_size for f in files)
        return [Finding("disk", OK, f"hybrid: train reads the {len(files):,} hidden-state files "
                        f"on disk ({size / GIB:,.2f} GiB at {folder}) and asks vLLM for the "
                        f"rest ({bpt / 1024:.1f} KiB/token, {how}){kept}")]
    return [disk_forecast(x.cfg, x.model, len(x.layer_ids), gpu)]


def cpu_kv_plan(m: ModelInfo, cfg: Config, layer_ids: list[int] | None) -> Finding:
    """The CPU build's KV cache: VLLM_CPU_KVCACHE_SPACE as the extract stage
    sizes it (requests in flight x the longest sample) against free RAM."""
    sec = cfg.stages.extract
    elem = 4 if cfg.dtype_name(False) == "float32" else 2
    hs = hs_bytes_per_token(m, len(layer_ids or [0]), elem)
    per_tok = kv_bytes_per_token(m, 1, elem) + hs
    max_len = cfg.stages.prepare.seq_length + 8
    # a linear-attention layer's state is per sequence, whatever its length
    per_seq = recurrent_bytes_per_seq(m, 1, elem)
    gib = cpu_kv_space_gib(sec.max_inflight, max_len * per_tok + per_seq)
    avail = _mem_available()
    state = f" + {size_text(per_seq)} of fixed state each" if per_seq else ""
    msg = (f"KV cache on the CPU: VLLM_CPU_KVCACHE_SPACE={gib} GiB for {sec.max_inflight} "
           f"requests x {max_len} tokens x {per_tok:,} B/token (K,V + hidden states){state}; "
           + (f"{avail / GIB:.1f} GiB of RAM available" if avail else "RAM unknown"))
    if avail is not None and gib * GIB > avail:
        return Finding("kv_cache", BLOCK, msg, "lower [stages.extract] max_inflight or "
                       "[stages.prepare] seq_length, or free memory")
    return Finding("kv_cache", OK, msg)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_kind(m: ModelInfo, tp: int) -> str:
    """How the per-token (and, for hybrid targets, per-sequence) KV figure is made."""
    if m.hybrid or set(m.kinds) - {"mla", "attn"}:
        per_seq = recurrent_bytes_per_seq(m, tp)
        state = (f"; + {size_text(per_seq)} per sequence of fixed state ({m.kinds.count('linear')} "
                 f"{(m.linear or {}).get('kind', 'linear')} layers: conv + recurrent state; "
                 "x2 where vLLM keeps it in float32)" if per_seq else "")
        return f"{describe_layers(m)}: only the attention layers keep KV per token{state}"
    return ("MLA: layers x (kv_lora_rank + qk_rope_head_dim) x 2 B, replicated per rank"
            if m.mla else "2 (K,V) x layers x KV heads per rank x head_dim x 2 B")


def kv_plan(m: ModelInfo, tp: int, gpus: list[dict], cfg: Config, util: float,
            util_why: str = "") -> list[Finding]:
    per_tok = kv_bytes_per_token(m, tp)
    per_seq = recurrent_bytes_per_seq(m, tp)
    max_len = cfg.stages.prepare.seq_length + 8
    kind = kv_kind(m, tp)
    devices = [g for g in gpus if g["index"] in (cfg.stage_devices("extract") or [])]
    if not devices:
        return [Finding("kv_cache", OK, f"KV cache: {per_tok:,} B/token per GPU at TP={tp} "
                        f"({kind}); no GPU memory to plan against (no GPU here: set [gpus] "
                        "memory_gb to plan for the GPUs the jobs will get)")]
    mem = min(g["memory_total"] for g in devices)
    weights = (m.weights_bytes or 0) / tp
    free = mem * util - weights
    if free <= 0:
        need = math.ceil((m.weights_bytes or 0) / (mem * util))
        return [Finding("kv_cache", BLOCK, f"weights {weights / GIB:.1f} GiB per GPU at TP={tp} "
                        f"exceed {util:.0%} of {mem / GIB:.0f} GiB",
                        f"use [stages.extract] tensor_parallel >= {need}")]
    # A sequence of max_len tokens holds its KV and (hybrid targets) its fixed state.
    seqs = free / (max_len * per_tok + per_seq)
    tokens = int(free // per_tok) if not per_seq else int(seqs * max_len)
    note = "" if m.weights_bytes else " (weights size unknown: not subtracted)"
    return [Finding("kv_cache", OK if tokens >= max_len else BLOCK,
                    f"KV cache per GPU at TP={tp}: {per_tok:,} B/token ({kind}); "
                    f"{util:.0%}{f' ({util_why})' if util_why else ''} of {mem / GIB:.0f} GiB"
                    f" - weights {weights / GIB:.1f} GiB = "
                    f"{free / GIB:.1f} GiB -> ~{tokens:,} tokens, max concurrency "
                    f"~{seqs:.1f} at {max_len} tokens{note}",
                    "" if tokens >= max_len else "raise tensor_parallel or lower seq_length")]


def disk_forecast(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool,
                  tokens: int | None = None) -> Finding:
    bpt, how = stored_per_token(cfg, m, n_layers, gpu)
    exact = tokens is not None
    if tokens is None:
        tokens, exact = prepared_tokens(cfg)
    runs = cfg.runs_dir()
    probe = runs
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if tokens is None:
        return Finding("disk", OK, f"hidden states: {bpt / 1024:.1f} KiB/token ({how}); data "
                       f"size unknown, {free / GIB:.0f} GiB free at {probe}")
    need = tokens * bpt
    room = free - cfg.stages.extract.min_free_gb * GIB
    what = "" if exact else "at most "
    msg = (f"hidden states: {bpt / 1024:.1f} KiB/token ({how}) x {what}{tokens:,} tokens = "
           f"{what}{need / GIB:,.1f} GiB; {free / GIB:,.0f} GiB free at {probe}")
    if cfg.stages.extract.hidden_states_dtype != "fp8" and gpu:
        half = tokens * fp8.bytes_per_token(n_layers, m.hidden)
        msg += f" (FP8: {what}{half / GIB:,.1f} GiB)"
    if need > room:
        level = BLOCK if exact else WARN
        return Finding("disk", level, msg, "free space, move [run] runs_dir to a bigger disk, "
                       'set [stages.extract] hidden_states_dtype = "fp8" (half of bf16), '
                       '[pipeline] mode = "online" or "hybrid", or lower [data] max_samples / '
                       "[stages.prepare] seq_length")
    if need > 0.5 * room:
        return Finding("disk", WARN, msg, "less than half of the free space would be left")
    return Finding("disk", OK, msg)


def prepared_tokens(cfg: Config) -> tuple[int | None, bool]:
    """Exact tokens if this run's prepare stage has finished, else an upper
    bound (rows x seq_length)."""
    data = RunDir(cfg.runs_dir() / cfg.run.name).out_dir("prepare") / "data"
    if data.exists():
        try:
            from datasets import load_from_disk
            return int(sum(load_from_disk(str(data))["seq_len"])), True
        except Exception:  # noqa: BLE001 - fall back to the estimate
            pass
    path = cfg.data_path()
    if not path.exists():
        return None, False
    rows = count_rows(path, cfg.data.max_samples)
    return (rows * cfg.stages.prepare.seq_length if rows else None), False
