"""The KV cache as vLLM allocated it (from `kv_cache` events), and its live use."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from pipeline import fmt
from pipeline.run.plans import KvPlan, read_kv

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
    stopped: frozenset = frozenset()   # names of the servers that have stopped


class KVCachePanel(Static):
    def update_from(self, report: KVReport) -> None:
        if report.kv is None:
            self.update(no_report_text(report))
            return
        # the gap after a label is in the label: Textual draws a rich Table
        # without its cell padding ("bytes per block256.5 KiB")
        t = Table(box=None, show_header=False, pad_edge=False)
        t.add_column(style="bold", no_wrap=True)
        t.add_column()
        gap = "  "
        # the stage's servers first (what a person looks for at 80x24), then
        # the figures of the one shown
        for k, v in server_rows(report) + figure_rows(report.kv, report.usage,
                                                      len(report.servers) > 1):
            t.add_row(k + gap, v)
        self.update(t)


def no_report_text(report: KVReport) -> Text:
    """Why there is no KV cache to show: the stage starts no server, the
    backend has none, or the engine has not allocated it yet."""
    if not report.has_servers and report.stage not in VLLM_STAGES:
        return Text(f"{report.stage} starts no vLLM server, so it has no KV "
                    f"cache. Select {', '.join(VLLM_STAGES)} to see theirs.", style="dim")
    if report.backend == "hf":
        return Text("No KV cache for this backend: the `hf` extract backend runs a "
                    "plain transformers forward. vLLM backends report their "
                    "KV-cache allocation here.", style="dim")
    return Text(f"No KV-cache report from {report.stage} yet (it appears "
                "when its vLLM engine has allocated its cache).", style="dim")


def server_rows(report: KVReport) -> list[tuple[str, object]]:
    """The stage, and each of its servers when there are several or one stopped."""
    servers = report.servers
    rows: list[tuple[str, object]] = [("stage", report.stage)]
    if len(servers) > 1:
        caps = [e.get("tokens_capacity") or 0 for e in servers.values()]
        # (whose figures follow: the source row says)
        rows.append(("servers", f"{len(servers)} (data parallel): {sum(caps):,} tokens in all"))
    for name, e in sorted(servers.items(), key=lambda item: str(item[0])):
        if len(servers) < 2 and name not in report.stopped:
            break   # one server, up: the figures below are all there is
        line = Text(f"{e.get('tokens_capacity') or 0:,} tokens, "
                    f"{fmt.nbytes(e.get('total_bytes'))}, GPUs "
                    f"{list(e.get('devices') or []) or '- (CPU)'}")
        if name in report.stopped:
            line.append(" · stopped", style="dim")
        rows.append((f"server {name}", line))
    return rows


def figure_rows(kv: Mapping, usage: Mapping | None,
                several: bool = False) -> list[tuple[str, object]]:
    """The live use, then the figures of the report shown and its groups:
    with `several` servers, headed by whose they are; the blocks with the
    token slots they make, so that vLLM's own capacity, which may count
    fewer, is read beside them rather than against them."""
    rows: list[tuple[str, object]] = []
    if several and "server" in kv:
        rows.append(("figures of", Text(f"server {kv['server']} (GPUs "
                                        f"{list(kv.get('devices') or []) or '- (CPU)'})",
                                        style="bold")))
    if usage:
        rows.append(("live use", f"{usage.get('usage_perc', 0) * 100:.1f}%  running "
                                 f"{usage.get('running')}  waiting {usage.get('waiting')}"))
    blocks, size, cap = kv.get("num_blocks"), kv.get("block_size"), kv.get("tokens_capacity")
    slots = blocks * size if blocks and size else None
    rows += [
        ("blocks", (f"{blocks:,}" + (f" x {size} tokens = {slots:,} token slots" if slots
                                     else "")) if blocks else "-"),
        ("bytes per block", fmt.nbytes(kv.get("bytes_per_block"))),
        ("total", fmt.nbytes(kv.get("total_bytes"))),
        ("token capacity", "-" if not cap else f"{cap:,}" if not slots or cap == slots
         else f"{cap:,} (vLLM's own count: {cap / slots:.0%} of the slots)"),
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
    if (plan := read_kv(kv.get("planned"))) is not None:
        rows.insert(rows.index(next(r for r in rows if r[0] == "token capacity")) + 1,
                    ("planned", plan_text(plan, cap)))
    return rows + [("group", f"{g.get('spec')}: {g.get('num_layers')} layers, page "
                             f"{fmt.nbytes(g.get('page_size_bytes'))}")
                   for g in kv.get("groups") or []]


def plan_text(plan: KvPlan, counted: int | None) -> str:
    """The server's KV plan beside vLLM's own count: the space the panel
    gave it (the CPU build) or the GPU share it should leave. (Not beside
    the slots: a server with a draft pages each layer group on its own, so
    its blocks x block size counts one token several times.)"""
    if plan.tokens is None:
        return (f"{plan.space_why}: not a whole number of GiB" if plan.where == "cpu" else
                f"{plan.bytes_per_token:,} B/token at TP={plan.tp}: no GPU memory to plan against")
    if plan.where == "cpu":
        how = (f"{plan.space_gib} GiB ({plan.space_why})" if plan.space_why else
               f"{plan.space_gib} GiB for {plan.requests} x {plan.max_len} tokens")
    else:
        weights = "" if plan.weights_per_gpu is None else \
            f" less {fmt.nbytes(plan.weights_per_gpu)} of weights"
        how = f"{plan.util or 0:.0%} of {fmt.nbytes(plan.gpu_memory)}{weights}"
    said = f"~{plan.tokens:,} tokens: {how}"
    if counted and plan.tokens:
        said += f"; vLLM counts {counted / plan.tokens:.0%} of it"
    return said
