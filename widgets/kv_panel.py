"""The KV cache as vLLM allocated it (from `kv_cache` events), and its live use."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from pipeline import fmt


@dataclass
class KVReport:
    """What the tab shows: the last `kv_cache` event, each server's, the live
    use (`kv_usage`) and the backend the stage runs."""
    kv: dict | None
    servers: dict = field(default_factory=dict)
    usage: dict | None = None
    backend: str | None = None


class KVCachePanel(Static):
    def update_from(self, report: KVReport) -> None:
        kv, usage, backend = report.kv, report.usage, report.backend
        if kv is None:
            if backend == "hf":
                self.update(Text("No KV cache for this backend: the `hf` extract backend runs a "
                                 "plain transformers forward. vLLM backends report their "
                                 "KV-cache allocation here.", style="dim"))
            else:
                self.update(Text("No KV-cache report yet (it appears when the vLLM engine "
                                 "has allocated its cache).", style="dim"))
            return
        t = Table(box=None, show_header=False, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        rows = [
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
