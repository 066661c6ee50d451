"""What evaluate measured, logged into train's run in [tracking]'s trackers."""

from __future__ import annotations

import json

from pipeline import tracking
from pipeline.drive.stage_context import StageContext
from pipeline.evaluate.measurement import Measurement
from pipeline.run.summaries import EvaluateSummary


def log(ctx: StageContext, results: dict[str, Measurement], named: str,
        summary: EvaluateSummary) -> None:
    """What vLLM measured, into train's run in [tracking]'s trackers: each
    checkpoint at its step, and the chosen draft's per category and speedup.
    Each once: a resume logs only what no attempt logged (tracked.json), and
    a tracker that fails is a warning, not a failed stage after the
    measurements are done."""
    loggers = ctx.cfg.tracking.loggers
    if not loggers:
        return
    done_path = ctx.out / "tracked.json"
    try:
        done = set(json.loads(done_path.read_text()))
    except (OSError, ValueError, TypeError):
        done = set()   # none yet (or damaged: logged again, a repeat at the same steps)
    points, keys = [], []
    for name, m in results.items():
        key = f"{name}@{m.checkpoint['global_step']}"
        if key not in done:
            points.append((m.checkpoint["global_step"], {"eval": m.tracker_values()}))
            keys.append(key)
    chosen = {f"category/{c}": v for c, v in (summary.per_category or {}).items()}
    if summary.speedup:
        chosen["speedup"] = summary.speedup
    key = f"chosen {named}@{results[named].checkpoint['global_step']}"
    if chosen and key not in done:
        points.append((results[named].checkpoint["global_step"], {"eval": chosen}))
        keys.append(key)
    if points:
        try:
            tracking.log_measured(ctx.run.path, ctx.run.id, loggers, points)
        except Exception as e:  # noqa: BLE001 - any tracker's own error: the measurements stand
            ctx.events.warning(f"the measured acceptance was not logged to {', '.join(loggers)}"
                               f": {type(e).__name__}: {e}")
            return
        ctx.write_json(done_path, sorted(done | set(keys)))
    print(f"evaluate: measured acceptance logged to {', '.join(loggers)}; to look: "
          + "; ".join(tracking.where(ctx.run.path, loggers)), flush=True)
