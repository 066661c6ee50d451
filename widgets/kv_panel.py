"""The KV cache as vLLM allocated it (from `kv_cache` events), and its live use."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from pipeline import fmt

# the stages that start vLLM (train does in online and hybrid modes: it has servers then)
VLLM_STAGES = ("regenerate", "extract", "evaluate")


@dataclass
class KVReport:
    """What the tab shows for one stage: the `kv_cache` report to show, each
    server's, the live use (`kv_usage`, only while a server is up) and the
    backend the stage runs (extract)."""
    kv: Mapping | None
    servers: Mapping = field(default_factory=dict)
    usage: Mapping | None = None
    backend: str | None = None
    stage: str = "extract"
    has_servers: bool = False


class KVCachePanel(Static):
    def update_from(self, report: KVReport) -> None:
        kv, usage, backend = report.kv, report.usage, report.backend
        if kv is None:
            if not report.has_servers and report.stage not in VLLM_STAGES:
                self.update(Text(f"{report.stage} starts no vLLM server, so it has no KV "
                                 f"cache. Select {', '.join(VLLM_STAGES)} to see theirs.",
                                 style="dim"))
            elif backend == "hf":
                self.update(Text("No KV cache for this backend: the `hf` extract backend runs a "
                                 "plain transformers forward. vLLM backends report their "
                                 "KV-cache allocation here.", style="dim"))
            else:
                self.update(Text(f"No KV-cache report from {report.stage} yet (it appears "
                                 "when its vLLM engine has allocated its cache).", style="dim"))
            return
        t = Table(box=None, show_header=False, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        rows = [
            ("stage", report.stage),
            ("blocks", f"{kv.get('num_blocks'):,}" if kv.get("num_blocks") else "-"),
            ("block size", f"{kv.get('block_size')} tokens" if kv.get("block_size") else "-"),
            ("bytes per block", fmt.nbytes(kv.get("bytes_per_block"))),
            ("total", fmt.nbytes(kv.get("total_bytes"))),
            ("token capacity", f"{kv.get('tokens_capacity'):,}" if kv.get("tokens_capacity") else "-"),
            ("max concurrency", f"{kv.get('max_concurrency'):.2f}x at {kv.get('max_model_len')} tokens"
             if kv.get("max_concurrency") else "-"),
            ("bytes per token", fmt.nbytes(kv["total_bytes"] / kv["tokens_capacity"])
             if kv.get("total_bytes") and kv.get("tokens_capacity") else "-"),
            ("cache dtype", "auto (the model's)" if kv.get("cache_dtype") == "auto"
             else str(kv.get("cache_dtype") or "-")),
            ("source", str(kv.get("source", "-"))
             + (f", {kv['pool']} memory" if kv.get("pool") else "")
             + (f" (server {kv['server']}, GPUs {kv.get('devices') or '- (CPU)'})"
                if "server" in kv else "")),
        ]
        for k, v in rows:
            t.add_row(k, v)
        for g in kv.get("groups") or []:
            t.add_row("group", f"{g.get('spec')}: {g.get('num_layers')} layers, page "
                               f"{fmt.nbytes(g.get('page_size_bytes'))}")
        servers = report.servers
        if len(servers) > 1:
            caps = [e.get("tokens_capacity") or 0 for e in servers.values()]
            t.add_row("servers", f"{len(servers)} (data parallel): {sum(caps):,} tokens in all; "
                                 "the figures above are server "
                                 f"{kv.get('server')}'s")
        if usage:
            t.add_row("live use", f"{usage.get('usage_perc', 0) * 100:.1f}%  running "
                                  f"{usage.get('running')}  waiting {usage.get('waiting')}")
        self.update(t)
