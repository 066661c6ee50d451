"""vLLM's KV-cache figures, wherever they come from: a server's log lines
and /metrics, or an engine's KVCacheConfig. All become the same `kv_cache`
and `kv_usage` events (pipeline.run.events).

The formats are vLLM's own (every release 0.11-0.33; tests check them
against the format strings in the source releases):
  "GPU KV cache size: 1,234,560 tokens"            (0.33: "GPU + host KV cache size")
  "Maximum concurrency for 8,192 tokens per request: 150.70x"
  "Available KV cache memory: 110.47 GiB"
0.29+ print the first two on one line. Lines carry prefixes such as
"(EngineCore_DP0 pid=12) INFO 11-29 10:00:00 [kv_cache_utils.py:1087]".
"""

from __future__ import annotations

import re

from pipeline.vllm import contract_strings as vs
from pipeline.vllm.metrics import samples

GIB = 1 << 30
_SIZE = re.compile(vs.LOG_KV_SIZE)
_CONC = re.compile(vs.LOG_KV_CONCURRENCY)
_MEM = re.compile(vs.LOG_KV_MEMORY)


def kv_cache_fields(source: str, **known) -> dict:
    """A `kv_cache` event's fields (pipeline.run.events.KvCacheEvent): what the
    source knows, None for the rest. The one place the event is built."""
    fields = {"num_blocks": None, "block_size": None, "bytes_per_block": None,
              "total_bytes": None, "tokens_capacity": None, "max_concurrency": None,
              "max_model_len": None, "groups": [], "source": source}
    unknown = known.keys() - fields.keys() - {"pool", "cache_dtype"}
    if unknown:
        raise ValueError(f"not kv_cache fields: {sorted(unknown)}")
    fields.update(known)
    return fields


class KvLogReader:
    """Feed it log lines; `event()` is the `kv_cache` event once all the
    figures a server prints have been seen (None before)."""

    def __init__(self):
        self.tokens = self.max_model_len = self.concurrency = self.memory = None
        self.pool = None

    def feed(self, line: str) -> bool:
        """True when the line changed what is known."""
        hit = False
        if m := _SIZE.search(line):
            self.pool, self.tokens = m.group(1).strip(), int(m.group(2).replace(",", ""))
            hit = True
        if m := _CONC.search(line):
            self.max_model_len = int(m.group(1).replace(",", ""))
            self.concurrency = float(m.group(2))
            hit = True
        if m := _MEM.search(line):
            self.memory = float(m.group(1))
            hit = True
        return hit

    def event(self) -> dict | None:
        if self.tokens is None or self.concurrency is None:
            return None
        total = int(self.memory * GIB) if self.memory is not None else None
        return kv_cache_fields("log", total_bytes=total, tokens_capacity=self.tokens,
                               max_concurrency=self.concurrency,
                               max_model_len=self.max_model_len, pool=self.pool)


def parse_metrics(text: str) -> dict | None:
    """`kv_usage` fields from a Prometheus /metrics page: usage averaged over
    the server's engines (data-parallel ranks), requests summed."""
    vals: dict[str, list[float]] = {}
    for name, _labels, value in samples(text):
        vals.setdefault(name, []).append(value)
    key = next((k for k in (vs.METRIC_KV_USAGE, vs.METRIC_GPU_CACHE_USAGE) if k in vals), None)
    if key is None:
        return None
    return {"usage_perc": sum(vals[key]) / len(vals[key]),
            "running": int(sum(vals.get(vs.METRIC_RUNNING, [0]))),
            "waiting": int(sum(vals.get(vs.METRIC_WAITING, [0])))}


def cache_config(text: str) -> dict | None:
    """The `kv_cache` figures in /metrics' `vllm:cache_config_info` gauge
    (vLLM 0.32: its labels are the engine's cache config): blocks, block
    size, bytes, capacity and dtype, which the log lines do not all give."""
    for name, labels, _value in samples(text):
        if name != vs.METRIC_CACHE_CONFIG_INFO:
            continue

        def num(key, labels=labels):
            v = labels.get(key)
            return int(float(v)) if v not in (None, "None", "") else None
        blocks = num("num_gpu_blocks") or num("num_cpu_blocks")
        block = num("block_size")
        total = num("kv_cache_memory_bytes")
        out = {"num_blocks": blocks, "block_size": block, "total_bytes": total,
               "bytes_per_block": total // blocks if total and blocks else None,
               "tokens_capacity": num("kv_cache_size_tokens") or (
                   blocks * block if blocks and block else None),
               "cache_dtype": labels.get("cache_dtype")}
        return {k: v for k, v in out.items() if v is not None}
    return None


def combine_usage(usages: list[dict]) -> dict:
    """One `kv_usage` event for several servers / engines (data parallel):
    usage averaged, requests summed."""
    return {"usage_perc": sum(u["usage_perc"] for u in usages) / len(usages),
            "running": sum(u["running"] for u in usages),
            "waiting": sum(u["waiting"] for u in usages)}


def kv_tensors_total(tensors) -> int:
    """Bytes of KV cache the tensors describe. Up to 0.24 each tensor is its
    own allocation (sum them); from 0.29 each carries the size of one
    backing allocation the groups overlay (count it once)."""
    tensors = list(tensors)
    if not tensors:
        return 0
    if hasattr(tensors[0], "shared_by"):
        return sum(int(t.size) for t in tensors)
    return max(int(t.size) for t in tensors)


def kv_cache_event(kv_cache_config, block_size: int, max_model_len: int) -> dict:
    """The `kv_cache` event's fields from an engine's KVCacheConfig."""
    total = kv_tensors_total(kv_cache_config.kv_cache_tensors)
    n = int(kv_cache_config.num_blocks)
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append({"spec": type(spec).__name__, "num_layers": len(g.layer_names),
                       "page_size_bytes": int(getattr(spec, "page_size_bytes", 0) or 0),
                       "block_size": int(getattr(spec, "block_size", block_size))})
    # Each group needs its own blocks for a token; the token capacity is
    # what one group's share of the blocks holds.
    tokens = n // len(groups) * block_size if groups else 0
    dtypes = {str(getattr(g.kv_cache_spec, "dtype", "")).removeprefix("torch.")
              for g in kv_cache_config.kv_cache_groups} - {""}
    return kv_cache_fields(
        "engine", cache_dtype=",".join(sorted(dtypes)) or None,
        num_blocks=n, block_size=block_size, bytes_per_block=total // n if n else 0,
        total_bytes=total, tokens_capacity=tokens,
        max_concurrency=round(tokens / max_model_len, 2) if max_model_len else None,
        max_model_len=max_model_len, groups=groups)
