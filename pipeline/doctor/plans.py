"""doctor's plans, figures a launch would otherwise find out hours in: how
many times the run loads the target into a vLLM server, the KV cache per
GPU (or the CPU build's KV space), and the hidden states' disk forecast.

Each plan is made as a typed value (pipeline/run/plans.py: `TargetLoads`,
`KvPlan`, `DiskPlan`), kept in `Inputs.plans` for `doctor --json`, and
said as a finding by the check. The KV plan is made by the functions the
servers themselves are sized with (pipeline/vllm/kv_plan.py, the shared
server's kv_sizing): doctor's CPU space is the one a shared server gets,
and extract's own sizes for its longest prepared row (at most doctor's
seq_length)."""

from __future__ import annotations

import math
import os
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
from pipeline.run.plans import DiskPlan, KvPlan, TargetLoad, TargetLoads
from pipeline.run.rundir import RunDir
from pipeline.vllm import contract, draft_swap, start_history
from pipeline.vllm import kv_plan as sizing


def evaluated_checkpoints(cfg: Config) -> int:
    """How many checkpoints evaluate measures (at most: train may stop early)."""
    which, train = cfg.stages.evaluate.checkpoints, cfg.stages.train
    if which == "all":   # one per epoch (epochs = 0: the budget rule's, up to max_epochs)
        return max(1, train.epochs or train.max_epochs)
    return int(which[5:]) if which.startswith("best-") else 1


def planned_loads(x: Inputs, swap_why: str | None) -> TargetLoads:
    """The target loads the run makes: a vLLM server's each (regenerate,
    extract's per data-parallel group, online train's, evaluate's and its
    baseline's), with how long the last such start took here;
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
    target = str(cfg.target_path())
    loads = []
    for what, n, tp, method in out:
        last = start_history.last(f"{target}|tp={tp}|{method}")
        loads.append(TargetLoad(what, n, tp, method, last["elapsed_s"] if last else None))
    return TargetLoads(tuple(loads), swap_why)


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
    plan = x.plans["loads"] = planned_loads(x, why)
    out = [Finding("servers", OK, loads_text(plan))]
    if x.cfg.enabled("evaluate") and sec.one_server and why and evaluated_checkpoints(x.cfg) > 1:
        out.append(Finding("servers", WARN, f"evaluate: a server per checkpoint ({why})",
                           "vLLM >= 0.32 loads a new draft into its running server"))
    return out


def loads_text(plan: TargetLoads) -> str:
    parts = [f"{x.what} {x.count}" + (f", ~{fmt.duration(x.last_start_s)} each here last time"
                                       if x.last_start_s else "") for x in plan.loads]
    msg = f"{plan.total} target load{'s' * (plan.total != 1)}: " + "; ".join(parts)
    if plan.measured_s:
        msg += f" (~{fmt.duration(plan.measured_s)} of loading measured here)"
    return msg


@check(170)
def check_kv_cache(x: Inputs) -> list[Finding]:
    """The plan is for where the stages will run: the CPU build's KV space
    when the config names no GPU, else the GPUs the config names (bf16) —
    whatever machine doctor runs on (a login node has none: [gpus] memory_gb)."""
    if not x.uses_vllm or x.model is None:
        return []
    sec = x.cfg.stages.extract
    if not x.cfg.gpus.devices:
        if x.vllm is not None and x.vllm.cpu_build:
            plan, keys = extract_cpu_plan(x.model, x.cfg, x.layer_ids)
            x.plans["kv"] = plan
            return [cpu_kv_finding(plan, keys)]
        return []
    _, max_len, per_tok, _ = extract_sizing(x.cfg, x.model, len(x.layer_ids or [0]), True)
    if x.backend == "vllm-engine":   # its hooks take the hidden states: the cache holds K,V
        util, why = sec.gpu_memory_utilization, "[stages.extract] gpu_memory_utilization"
        per_tok = None
    else:
        util, why = sizing.server_util(list(sec.server_args), x.source, "server_args")
    plan = x.plans["kv"] = gpu_kv_plan(x.model, max(1, sec.tensor_parallel), planned_gpus(x),
                                       x.cfg, util, why, per_tok, max_len)
    return [gpu_kv_finding(plan, x.model)]


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
    stored = _stored(cfg, gpu)
    if stored == "fp8":
        return fp8.bytes_per_token(n_layers, m.hidden), stored_text(stored, n_layers, m.hidden)
    elem = 4 if stored == "float32" else 2
    return hs_bytes_per_token(m, n_layers, elem), stored_text(stored, n_layers, m.hidden)


def stored_text(stored: str, n_layers: int, hidden: int) -> str:
    """How a stored token's bytes are made, in words."""
    if stored == "fp8":
        return f"{n_layers} layers x {hidden} x 1 B FP8"
    return f"{n_layers} layers x {hidden} x {4 if stored == 'float32' else 2} B"


@check(180)
def check_disk(x: Inputs) -> list[Finding]:
    if x.model is None or x.layer_ids is None:
        return []
    gpu = bool(x.cfg.gpus.devices)
    n_layers = len(x.layer_ids)
    mode = x.cfg.pipeline.mode
    if mode == "offline":
        plan = x.plans["disk"] = disk_plan(x.cfg, x.model, n_layers, gpu)
        return [disk_finding(plan, x.model.hidden)]
    bpt, how = stored_per_token(x.cfg, x.model, n_layers, gpu)
    keep = x.cfg.stages.train.keep_generated_gb
    kept = f"; up to {keep:g} GB of what the servers generate is kept for later epochs" \
        if keep else ""
    if mode == "online":
        x.plans["disk"] = DiskPlan(mode, bpt, _stored(x.cfg, gpu), n_layers,
                                   keep_generated_bytes=int(keep * 1e9))
        return [Finding("disk", OK, f"online: hidden states are not kept on disk{kept}; the "
                        f"buffer holds the samples in flight, {bpt / 1024:.1f} KiB/token ({how}) "
                        f"x at most {x.cfg.stages.prepare.seq_length} tokens each")]
    folder = RunDir(x.cfg.runs_dir() / x.cfg.run.name).out_dir("extract") / "hidden_states"
    files = list(folder.glob("hs_*.safetensors")) if folder.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    x.plans["disk"] = DiskPlan(mode, bpt, _stored(x.cfg, gpu), n_layers, at=str(folder),
                               on_disk_files=len(files), on_disk_bytes=size,
                               keep_generated_bytes=int(keep * 1e9))
    return [Finding("disk", OK, f"hybrid: train reads the {len(files):,} hidden-state files "
                    f"on disk ({size / GIB:,.2f} GiB at {folder}) and asks vLLM for the "
                    f"rest ({bpt / 1024:.1f} KiB/token, {how}){kept}")]


def _stored(cfg: Config, gpu: bool) -> str:
    """The dtype the hidden states are stored in."""
    return "fp8" if cfg.stages.extract.hidden_states_dtype == "fp8" else cfg.dtype_name(gpu)


def extract_sizing(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool
                   ) -> tuple[int, int, int, str]:
    """(requests in flight, the longest request, KV bytes a token, the keys
    that set them) of the server extract's hidden states come from: the
    shared server's sizing when regenerate and extract share one
    (pipeline.extract.shared_server.kv_sizing), else extract's own
    (max_inflight requests of seq_length + 8; online, train's servers'
    online_max_inflight). A token holds the target's K,V and the captured
    layers' hidden states (vLLM's HiddenStateCacheSpec, on the server
    route)."""
    from pipeline.extract.shared_server import kv_sizing
    from pipeline.extract.shared_server import why_not as not_shared
    if not cfg.online and cfg.enabled("regenerate") and not_shared(cfg) is None:
        return (*kv_sizing(cfg, m, n_layers), "[stages.regenerate] concurrency or max_tokens, "
                "[stages.extract] max_inflight or [stages.prepare] seq_length")
    tp = max(1, cfg.stages.extract.tensor_parallel) if gpu else 1
    per_tok = sizing.extraction_bytes_per_token(
        m, tp, 4 if cfg.dtype_name(gpu) == "float32" else 2, n_layers)
    requests, key = (cfg.stages.train.online_max_inflight, "[stages.train] online_max_inflight") \
        if cfg.online else (cfg.stages.extract.max_inflight, "[stages.extract] max_inflight")
    return requests, cfg.stages.prepare.seq_length + 8, per_tok, \
        f"{key} or [stages.prepare] seq_length"


def extract_cpu_plan(m: ModelInfo, cfg: Config, layer_ids: list[int] | None
                     ) -> tuple[KvPlan, str]:
    """The CPU build's KV space as extract's server gets it — the user's own
    VLLM_CPU_KVCACHE_SPACE where the stage's environment sets one, as the
    server keeps it (pipeline.vllm.server.server_kv_plan) — and the keys
    that size it (for the fix)."""
    requests, max_len, per_tok, keys = extract_sizing(cfg, m, len(layer_ids or [0]), False)
    per_seq = recurrent_bytes_per_seq(m, 1, 4 if cfg.dtype_name(False) == "float32" else 2)
    plan = sizing.cpu_plan(requests, max_len, per_tok, per_seq)
    environ = {**os.environ, **cfg.runtime.env, **cfg.stage("extract").env}
    user = environ.get(contract.ENV_CPU_KV_SPACE)
    return (sizing.with_space(plan, user) if user else plan), keys


def cpu_kv_finding(plan: KvPlan, keys: str) -> Finding:
    """The CPU plan said: the space against the RAM available."""
    state = f" + {size_text(plan.bytes_per_seq)} of fixed state each" if plan.bytes_per_seq \
        else ""
    ram = plan.ram_available
    if plan.space_gib is None:   # the user's, which vLLM itself reads with int()
        return Finding("kv_cache", BLOCK, f"KV cache on the CPU: {plan.space_why}, which vLLM "
                       "reads as a whole number of GiB", f"set {contract.ENV_CPU_KV_SPACE} to "
                       "whole GiB, or unset it: the panel sizes the space")
    msg = (f"KV cache on the CPU: VLLM_CPU_KVCACHE_SPACE={plan.space_gib} GiB"
           + (f" ({plan.space_why})" if plan.space_why else "") + " for "
           f"{plan.requests} requests x {plan.max_len} tokens x {plan.bytes_per_token:,} B/token "
           f"(K,V + hidden states){state}; "
           + (f"{ram / GIB:.1f} GiB of RAM available" if ram else "RAM unknown"))
    if not plan.fits:
        return Finding("kv_cache", BLOCK, msg, f"lower {keys}, or free memory")
    return Finding("kv_cache", OK, msg)


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


def gpu_kv_plan(m: ModelInfo, tp: int, gpus: list[dict], cfg: Config, util: float,
                util_why: str = "", per_token: int | None = None,
                max_len: int | None = None) -> KvPlan:
    """Extract's server on the smallest of its GPUs, bf16: `per_token` (by
    default the target's K,V alone) for requests of `max_len` (by default
    seq_length + 8)."""
    devices = [g for g in gpus if g["index"] in (cfg.stage_devices("extract") or [])]
    mem = min(g["memory_total"] for g in devices) if devices else None
    return sizing.gpu_plan(tp, max_len or cfg.stages.prepare.seq_length + 8,
                           per_token or kv_bytes_per_token(m, tp), recurrent_bytes_per_seq(m, tp),
                           mem, util, util_why, m.weights_bytes)


def kv_plan(m: ModelInfo, tp: int, gpus: list[dict], cfg: Config, util: float,
            util_why: str = "") -> list[Finding]:
    """The target's own KV cache on `gpus`, said: the plan of a server that
    captures nothing (tests and scripts; doctor's check adds the hidden
    states extract's server caches)."""
    return [gpu_kv_finding(gpu_kv_plan(m, tp, gpus, cfg, util, util_why), m)]


def gpu_kv_finding(plan: KvPlan, m: ModelInfo) -> Finding:
    """The GPU plan said: the arithmetic from a GPU's memory to tokens."""
    tp, kv = plan.tp, kv_bytes_per_token(m, plan.tp)
    kind = kv_kind(m, tp) + (f"; + {plan.bytes_per_token - kv:,} B/token of the captured "
                             "hidden states (vLLM's HiddenStateCacheSpec)"
                             if plan.bytes_per_token > kv else "")
    if plan.gpu_memory is None:
        return Finding("kv_cache", OK, f"KV cache: {kv:,} B/token per GPU at "
                       f"TP={tp} ({kind}); no GPU memory to plan against (no GPU here: set "
                       "[gpus] memory_gb to plan for the GPUs the jobs will get)")
    mem, util, weights = plan.gpu_memory, plan.util or 0.0, plan.weights_per_gpu or 0
    free = plan.space_bytes or 0
    if free <= 0:
        need = math.ceil((m.weights_bytes or 0) / (mem * util))
        return Finding("kv_cache", BLOCK, f"weights {weights / GIB:.1f} GiB per GPU at TP={tp} "
                       f"exceed {util:.0%} of {mem / GIB:.0f} GiB",
                       f"use [stages.extract] tensor_parallel >= {need}")
    note = "" if plan.weights_per_gpu is not None else " (weights size unknown: not subtracted)"
    why = f" ({plan.util_why})" if plan.util_why else ""
    return Finding("kv_cache", OK if plan.fits else BLOCK,
                   f"KV cache per GPU at TP={tp}: {kv:,} B/token ({kind}); "
                   f"{util:.0%}{why} of {mem / GIB:.0f} GiB - weights {weights / GIB:.1f} GiB = "
                   f"{free / GIB:.1f} GiB -> ~{plan.tokens:,} tokens, max concurrency "
                   f"~{plan.concurrency:.1f} at {plan.max_len} tokens{note}",
                   "" if plan.fits else "raise tensor_parallel or lower seq_length")


def disk_plan(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool,
              tokens: int | None = None) -> DiskPlan:
    """Offline: every token's hidden states on disk, against the free space
    where the runs go."""
    bpt, _ = stored_per_token(cfg, m, n_layers, gpu)
    exact = tokens is not None
    if tokens is None:
        tokens, exact = prepared_tokens(cfg)
    probe = cfg.runs_dir()
    while not probe.exists():
        probe = probe.parent
    fp8_alt = cfg.stages.extract.hidden_states_dtype != "fp8" and gpu and tokens is not None
    return DiskPlan("offline", bpt, _stored(cfg, gpu), n_layers, tokens, exact,
                    shutil.disk_usage(probe).free, str(probe),
                    int(cfg.stages.extract.min_free_gb * GIB),
                    tokens * fp8.bytes_per_token(n_layers, m.hidden) if fp8_alt else None)


def disk_forecast(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool,
                  tokens: int | None = None) -> Finding:
    """The offline disk plan, said (for tests and scripts: check_disk keeps
    the plan it says)."""
    return disk_finding(disk_plan(cfg, m, n_layers, gpu, tokens), m.hidden)


def disk_finding(plan: DiskPlan, hidden: int) -> Finding:
    """The offline plan said: the hidden states' size against the free space."""
    bpt, free = plan.bytes_per_token, plan.free_bytes or 0
    how = stored_text(plan.stored, plan.layers, hidden)
    if plan.tokens is None:
        return Finding("disk", OK, f"hidden states: {bpt / 1024:.1f} KiB/token ({how}); data "
                       f"size unknown, {free / GIB:.0f} GiB free at {plan.at}")
    need, room = plan.need_bytes or 0, plan.room_bytes or 0
    what = "" if plan.exact else "at most "
    msg = (f"hidden states: {bpt / 1024:.1f} KiB/token ({how}) x {what}{plan.tokens:,} tokens = "
           f"{what}{need / GIB:,.1f} GiB; {free / GIB:,.0f} GiB free at {plan.at}")
    if plan.fp8_bytes is not None:
        msg += f" (FP8: {what}{plan.fp8_bytes / GIB:,.1f} GiB)"
    if need > room:
        level = BLOCK if plan.exact else WARN
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
