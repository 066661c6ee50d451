"""A serving vLLM's speculative decoding as figures: one scrape of /metrics
is a Reading (counters since the server started, gauges now); two Readings
are an interval's figures, from the counters' deltas. A counter lower than
before means the server restarted (counters start again at 0): the interval
then counts from the restart, the later Reading alone, and says so.

Acceptance length = 1 + accepted / drafts (each verify step yields the
accepted tokens plus one from the target: pipeline/vllm/metrics.py, which
evaluate reads the same counters through)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pipeline.vllm import contract_strings as vs
from pipeline.vllm import metrics

GAUGES = {vs.METRIC_RUNNING: "running", vs.METRIC_WAITING: "waiting",
          vs.METRIC_KV_USAGE: "kv_usage", vs.METRIC_GPU_CACHE_USAGE: "kv_usage"}


class NotVllm(ValueError):
    """The server's /metrics holds no `vllm:` metric: not a vLLM server."""


@dataclass(frozen=True)
class Reading:
    """One scrape: counters since the server started, gauges at `t`."""
    t: float
    drafts: float
    draft_tokens: float
    accepted: float
    generated: float
    per_position: dict[int, float]
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None     # 0..1
    spec_decode: bool = True          # the server exposes speculative-decoding counters

    def counters(self) -> tuple[float, ...]:
        return (self.drafts, self.draft_tokens, self.accepted, self.generated,
                *self.per_position.values())


def read(text: str, t: float) -> Reading:
    """A /metrics text as a Reading; NotVllm when nothing in it is vLLM's."""
    samples = metrics.samples(text)
    if not any(name.startswith("vllm:") for name, _, _ in samples):
        raise NotVllm("its /metrics has no vllm: metric (is this a vLLM server?)")
    c = metrics.spec_counters(text)
    gauges: dict[str, float] = {}
    for name, _, value in samples:   # summed over engines (data-parallel ranks)
        if name in GAUGES:
            key = GAUGES[name]
            gauges[key] = gauges.get(key, 0.0) + value
    engines = sum(1 for name, _, _ in samples if name in (vs.METRIC_KV_USAGE,
                                                          vs.METRIC_GPU_CACHE_USAGE))
    if "kv_usage" in gauges and engines > 1:
        gauges["kv_usage"] /= engines   # a share: the engines' mean, not their sum
    spec = any(name == metrics.DRAFTS for name, _, _ in samples)
    return Reading(t, c["drafts"], c["draft_tokens"], c["accepted"], c["generated"],
                   dict(sorted(c["per_position"].items())), gauges.get("running"),
                   gauges.get("waiting"), gauges.get("kv_usage"), spec)


@dataclass(frozen=True)
class Figures:
    """What happened between two Readings (or since the server started)."""
    seconds: float
    drafts: int
    accepted_tokens: int
    draft_tokens: int
    generated_tokens: int
    acceptance_length: float | None        # None: no draft was verified in it
    acceptance_rate: float | None
    per_position: list[float | None] = field(default_factory=list)   # accept rate, position k
    drafted_per_s: float | None = None
    accepted_per_s: float | None = None
    generated_per_s: float | None = None
    restarted: bool = False                # the counters went back: counted from the restart

    def to_json(self) -> dict:
        return asdict(self)


def restarted(before: Reading, after: Reading) -> bool:
    """Counters only grow while a server lives: one lower than before means
    a new server process (or positions it no longer reports)."""
    if set(before.per_position) - set(after.per_position):
        return True
    return any(a < b for a, b in zip(
        (after.drafts, after.draft_tokens, after.accepted, after.generated),
        (before.drafts, before.draft_tokens, before.accepted, before.generated), strict=True)) \
        or any(after.per_position[k] < v for k, v in before.per_position.items())


ZERO = Reading(0.0, 0.0, 0.0, 0.0, 0.0, {})


def between(before: Reading | None, after: Reading) -> Figures:
    """The figures from `before` to `after`; with no `before` (or a restart
    between them), since `after`'s server started (rates then unknown: its
    start time is not in /metrics)."""
    reset = before is not None and restarted(before, after)
    base = ZERO if before is None or reset else before
    seconds = after.t - base.t if base is not ZERO else 0.0
    drafts = after.drafts - base.drafts
    accepted = after.accepted - base.accepted
    proposed = after.draft_tokens - base.draft_tokens
    generated = after.generated - base.generated
    per_pos = [(v - base.per_position.get(k, 0.0)) / drafts if drafts else None
               for k, v in after.per_position.items()]

    def rate(n: float) -> float | None:
        return n / seconds if seconds > 0 else None
    return Figures(seconds, int(drafts), int(accepted), int(proposed), int(generated),
                   1 + accepted / drafts if drafts else None,
                   accepted / proposed if proposed else None, per_pos,
                   rate(proposed), rate(accepted), rate(generated), reset)
