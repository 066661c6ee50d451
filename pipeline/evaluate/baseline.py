"""The baseline: the same prompts served without a draft, for the
speedup; its server started ahead, beside the first draft's, where that is
nearly free (a CPU-only machine)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.drive.stage_context import StageContext, StageError
from pipeline.evaluate.measurement import Measurement
from pipeline.evaluate.servers import ServerPool


class BaselineAhead:
    """The baseline's server, started beside the first draft's.

    Most of a server's start is one core's work (imports, engine set-up:
    ~40 s of the demo's ~45 s on 2 cores), so on a CPU-only machine two
    starting side by side take little longer than one: the demo's evaluate
    saves about one server start. Only on the CPU build without GPUs (a GPU
    server's servers each need the GPUs), and only with room in memory for a
    second copy of the target. It must be up before the draft's prompts
    start, or its start would share their cores and skew the decode speed
    the speedup is measured from. One that fails to start is stopped and
    left to the baseline's own measurement, which starts it again and
    reports whatever stops it there."""

    def __init__(self, ev: ServerPool, k: int):
        self.ev, self.server = ev, ev.server(k, None)
        self.failed = self.waited = False
        self.server.start()
        ev.starts += 1

    def watch(self) -> None:
        """Its start's phases reported while the draft's server starts."""
        self.server.read_log()
        self.server.report_startup()

    def wait(self) -> None:
        sec = self.ev.sec
        try:
            self.server.wait_ready(sec.startup_timeout_s, lambda: self.ev.ctx.stop_requested)
        except StageError as e:
            print(f"evaluate: the baseline's server, started ahead, did not come up ({e}); "
                  "it starts again for its own measurement", flush=True)
            self.stop()
            self.failed = True
        self.waited = True   # once: the next drafts' servers start alone

    def stop(self) -> None:
        self.server.stop(grace=self.ev.ctx.cfg.runtime.term_grace_s)

    @staticmethod
    def worth_it(ev: ServerPool) -> bool:
        """A CPU-only evaluate with memory for two servers of this target."""
        if not ev.env.cpu_build or ev.devices:
            return False
        import psutil
        weights = sum(f.stat().st_size for f in Path(ev.target).glob("*.safetensors"))
        kv = ev.sec.concurrency * ev.max_len * ev.draft_kv_per_token
        return psutil.virtual_memory().available > 2 * (weights + kv) + (4 << 30)


def saved(ctx: StageContext, ev: ServerPool) -> Measurement | None:
    """The baseline already measured on these prompts (a resumed evaluate's)."""
    path = ctx.out / "baseline.json"
    old = json.loads(path.read_text()) if path.exists() else None
    return Measurement.from_json(old) if old and old.get("prompts") == len(ev.prompts) else None


def measure(ctx: StageContext, ev: ServerPool, k: int) -> Measurement:
    """The same prompts without a draft (server k, or the one started ahead),
    unless already measured."""
    baseline = saved(ctx, ev)
    if baseline is None:
        ahead = ev.ahead
        alive = ahead is not None and not ahead.failed and ahead.server.died() is None
        server = ahead.server if alive else None   # (one that died meanwhile: a new one)
        baseline = ev.run_prompts(k, None, server=server)
        ctx.write_json(ctx.out / "baseline.json", baseline.to_json())
    return baseline
