"""A vLLM server's KV cache planned, one way for doctor and for the stages.

On the CPU build the plan is a decision: the space the server is given
(VLLM_CPU_KVCACHE_SPACE, `cpu_plan`) for the requests a stage keeps in
flight. On GPUs it is a forecast (`gpu_plan`): the share of the smallest
GPU vLLM takes (`--gpu-memory-utilization`, else the release's default,
pipeline/vllm/memory_fraction.py) less the weights' share. Either way the
value is a `pipeline.run.plans.KvPlan`: doctor says it as a sentence before
a launch, and each server reports it beside what vLLM allocated
(`VllmServer.kv_report`), so the two can be read side by side.
"""

from __future__ import annotations

import dataclasses
import math

from pipeline.model.info import kv_bytes_per_token
from pipeline.run.plans import GIB, KvPlan
from pipeline.vllm import contract
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.memory_fraction import default_fraction


def cpu_kv_space_gib(tokens: int, bytes_per_token: int, headroom: float = 1.5) -> int:
    """VLLM_CPU_KVCACHE_SPACE for `tokens` in flight at `bytes_per_token`
    (whole GiB, at least 1)."""
    return max(1, math.ceil(tokens * bytes_per_token * headroom / GIB))


def extraction_bytes_per_token(m, tp: int, elem: int, captured: int) -> int:
    """KV-cache bytes a token takes on a server that captures `captured`
    layers' hidden states: the target's K,V, and beside them vLLM's
    HiddenStateCacheSpec (extract_hidden_states: the captured layers x
    hidden, in the KV dtype, whatever dtype extract stores them in).
    Measured equal to vLLM's own bytes per block / block size on the CPU
    build (tests/vllm/test_vllm_real.py)."""
    return kv_bytes_per_token(m, tp, elem) + captured * m.hidden * elem


def planned_tokens(space: float, per_token: int, per_seq: int, max_len: int) -> int:
    """Tokens `space` bytes hold: per token, or, where each sequence also
    keeps a fixed state (linear-attention layers), whole `max_len`
    sequences' worth."""
    if space <= 0:
        return 0
    if not per_seq:
        return int(space // per_token)
    return int(space / (max_len * per_token + per_seq) * max_len)


def cpu_plan(requests: int, max_len: int, per_token: int, per_seq: int = 0) -> KvPlan:
    """The CPU build's space for `requests` of `max_len` tokens in flight,
    against the RAM available now."""
    gib = cpu_kv_space_gib(requests, max_len * per_token + per_seq)
    return KvPlan("cpu", 1, per_token, max_len, per_seq,
                  tokens=planned_tokens(gib * GIB, per_token, per_seq, max_len),
                  requests=requests, space_gib=gib, ram_available=mem_available())


def with_space(plan: KvPlan, gib: str) -> KvPlan:
    """A CPU plan whose space the user set (VLLM_CPU_KVCACHE_SPACE in the
    panel's environment or the stage's `env`): the server keeps theirs, so
    the plan says theirs — or, where it is no whole number of GiB, that the
    space is theirs and unknown here."""
    where = f"{contract.ENV_CPU_KV_SPACE}={gib} set for the server"
    try:
        space = int(gib)
    except ValueError:
        return dataclasses.replace(plan, space_gib=None, tokens=None, space_why=where)
    return dataclasses.replace(
        plan, space_gib=space, space_why=where,
        tokens=planned_tokens(space * GIB, plan.bytes_per_token, plan.bytes_per_seq, plan.max_len))


def gpu_plan(tp: int, max_len: int, per_token: int, per_seq: int, gpu_memory: int | None,
             util: float, util_why: str, weights_bytes: int | None) -> KvPlan:
    """What a server on `tp` GPUs of `gpu_memory` bytes each (the smallest;
    None: not known) should have for its KV cache: `util` of it less the
    weights' share."""
    weights = int(weights_bytes // tp) if weights_bytes else None   # 0: not known either
    if gpu_memory is None:
        return KvPlan("gpu", tp, per_token, max_len, per_seq, util=util, util_why=util_why,
                      weights_per_gpu=weights)
    space = gpu_memory * util - (weights or 0)
    return KvPlan("gpu", tp, per_token, max_len, per_seq,
                  tokens=planned_tokens(space, per_token, per_seq, max_len),
                  gpu_memory=gpu_memory, util=util, util_why=util_why, weights_per_gpu=weights)


def server_util(args: list[str], src, where: str) -> tuple[float, str]:
    """(the share of each GPU a server takes, where that figure comes from):
    its own --gpu-memory-utilization in `args` (`where` names them), else the
    installed release's default by its own rule (0.9, 0.92, or 1.0 with
    0.34's extensible KV cache on CUDA)."""
    for i, a in enumerate(args):
        if a.startswith(vs.FLAG_GPU_UTIL):
            val = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return float(val), f"{vs.FLAG_GPU_UTIL} in {where}"
            except ValueError:
                pass
    rule = default_fraction(src, cuda=True)
    return rule.fraction, rule.why


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
