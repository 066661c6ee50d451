"""A vLLM server's start, read from its log as it grows: the phase it is in
(starting, loading weights n/N shards, loading the draft, profiling and KV
allocation, warm-up or compile, ready), how long each took, and whether it
has stalled — no new log line and no change in its GPUs' memory for
`stall_after_s` while it starts.

On the user's target a start takes 10-20 minutes (a trillion-parameter
checkpoint in dozens of safetensors shards), once per server per stage; these
lines are what the panel, `status` and `run --wait` show for that time. The
lines are vLLM's own, matched loosely: a release that words them differently
shows fewer phases, never a wrong one. Standard library only.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from pipeline.run.events import SERVER_READY, SERVER_STOPPED
from pipeline.vllm import contract_strings as vs

STARTING, LOADING, DRAFT, PROFILING, WARMUP, READY = (
    "starting", "loading weights", "loading the draft", "profiling / KV cache", "warm-up",
    SERVER_READY)
# (phase, pattern): the first that matches a line moves the server to that phase
PHASES = [(DRAFT, re.compile(vs.LOG_PHASE_DRAFT)), (LOADING, re.compile(vs.LOG_PHASE_LOADING)),
          (PROFILING, re.compile(vs.LOG_PHASE_PROFILING)),
          (WARMUP, re.compile(vs.LOG_PHASE_WARMUP)), (READY, re.compile(vs.LOG_PHASE_READY))]
SHARDS = re.compile(vs.LOG_SHARDS)
TOOK = re.compile(vs.LOG_TOOK)
ORDER = [STARTING, LOADING, DRAFT, PROFILING, WARMUP, READY]
# After its start: the stage stopped it (a view counts the servers that are still up:
# evaluate's come and go within one stage).
STOPPED = SERVER_STOPPED


@dataclass
class StartupWatch:
    """Fed the log's lines (and, on GPUs, the memory its GPUs hold); says
    the phase, the shard count and whether it is stuck."""
    stall_after_s: float = 600.0
    clock: object = time.monotonic
    phase: str = STARTING
    shards: tuple[int, int] | None = None
    last_line: str = ""
    partial: str = ""          # the log's last line while it is still being written
    took: dict = field(default_factory=dict)   # "Loading weights took" -> seconds
    started: float = 0.0
    phase_since: float = 0.0
    moved_at: float = 0.0      # the last new line or memory change
    expected_s: float | None = None   # the last start of this target here, whole
    phase_times: dict = field(default_factory=dict)   # phase -> seconds, the ones left
    _memory: object = None

    def __post_init__(self):
        self.started = self.phase_since = self.moved_at = self.clock()

    def feed(self, line: str) -> bool:
        """One log line; True if what it shows changed."""
        now = self.clock()
        self.moved_at = now
        line = line.rstrip()
        if line.strip():
            self.last_line = line
        changed = False
        m = SHARDS.search(line)
        if m:
            shards = (int(m.group(2)), int(m.group(3)))
            changed |= shards != self.shards
            self.shards = shards
        m = TOOK.search(line)
        if m:
            self.took[m.group(1)] = float(m.group(2))
        for phase, pattern in PHASES:
            if pattern.search(line):
                # phases only move forward (the draft loads after the target)
                if ORDER.index(phase) > ORDER.index(self.phase) or \
                        (phase == LOADING and self.phase == LOADING):
                    if phase != self.phase:
                        self._leave(now)
                        self.phase, self.phase_since, changed = phase, now, True
                        if phase == DRAFT:
                            self.shards = None
                break
        return changed

    def memory(self, used: object) -> None:
        """What its GPUs hold now (any comparable value): a change is progress."""
        if used != self._memory:
            self._memory = used
            self.moved_at = self.clock()

    def _leave(self, now: float) -> None:
        self.phase_times[self.phase] = self.phase_times.get(self.phase, 0.0) + \
            now - self.phase_since

    def ready(self) -> None:
        if self.phase != READY:
            now = self.clock()
            self._leave(now)
            self.phase, self.phase_since = READY, now

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def stalled_s(self) -> float:
        """Seconds without a sign of life while starting (0 when not stalled)."""
        if self.phase == READY:
            return 0.0
        quiet = self.clock() - self.moved_at
        return quiet if quiet >= self.stall_after_s else 0.0

    def fields(self) -> dict:
        """The `server` event's fields for the state it is in."""
        now = self.clock()
        out = {"phase": self.phase, "elapsed_s": round(now - self.started, 1),
               "phase_s": round(now - self.phase_since, 1),
               "last_line": (self.partial.strip() or self.last_line)[-300:]}
        if self.shards and self.phase == LOADING:
            out["done"], out["total"] = self.shards
        stalled = self.stalled_s()
        if stalled:
            out["stalled_s"] = round(stalled, 1)
        if self.took:
            out["took"] = dict(self.took)
        if self.expected_s:
            out["expected_s"] = round(self.expected_s, 1)
        return out


def describe(ev: dict) -> str:
    """One server's start in words: `loading weights 8/64 (2m10s)`, with the
    last start here as the expectation `(2m10s of ~11m last time)`,
    `stalled 6m in loading weights`, `ready in 1m20s`."""
    from pipeline.fmt import duration
    phase = ev.get("phase", STARTING)
    if ev.get("stalled_s"):
        return f"stalled {duration(ev['stalled_s'])} in {phase}"
    if phase == READY:
        return f"ready in {duration(ev.get('elapsed_s'))}"
    if phase == STOPPED:
        return "stopped"
    shards = f" {ev['done']}/{ev['total']}" if ev.get("total") else ""
    expected = f" of ~{duration(ev['expected_s'])} last time" if ev.get("expected_s") else ""
    return f"{phase}{shards} ({duration(ev.get('elapsed_s'))}{expected})"
