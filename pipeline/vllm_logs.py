"""Read KV-cache figures from a vLLM server's log lines and /metrics.

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

GIB = 1 << 30
_SIZE = re.compile(r"([A-Z]+(?: \+ host)?) KV cache size: ([\d,]+) tokens")
_CONC = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_MEM = re.compile(r"Available KV cache memory: ([\d.]+) GiB")


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
        return {"num_blocks": None, "block_size": None, "bytes_per_block": None,
                "total_bytes": total, "tokens_capacity": self.tokens,
                "max_concurrency": self.concurrency, "max_model_len": self.max_model_len,
                "groups": [], "pool": self.pool, "source": "log"}


_METRIC = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([-+\d.eE]+|NaN)\s*$")


def parse_metrics(text: str) -> dict | None:
    """`kv_usage` fields from a Prometheus /metrics page: usage averaged over
    the server's engines (data-parallel ranks), requests summed."""
    vals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and m.group(3) != "NaN":
            vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(3))
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    key = next((k for k in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
                if k in vals), None)
    if key is None:
        return None
    usage = vals[key] / counts[key]
    return {"usage_perc": usage, "running": int(vals.get("vllm:num_requests_running", 0)),
            "waiting": int(vals.get("vllm:num_requests_waiting", 0))}


def combine_usage(usages: list[dict]) -> dict:
    """One `kv_usage` event for several servers / engines (data parallel):
    usage averaged, requests summed."""
    return {"usage_perc": sum(u["usage_perc"] for u in usages) / len(usages),
            "running": sum(u["running"] for u in usages),
            "waiting": sum(u["waiting"] for u in usages)}
