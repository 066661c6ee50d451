"""Measuring one checkpoint: its saved Measurement when it is of these
contents (a resumed evaluate measures only what no attempt finished), else
the prompts through the pool with its draft, saved as it ends
(evaluate/out/checkpoints/<name>.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pipeline.drive.stage_context import StageContext
from pipeline.evaluate.choice import checkpoint_id, train_estimates
from pipeline.evaluate.measurement import Measurement
from pipeline.evaluate.servers import ServerPool, mla_draft_backend, served_draft
from pipeline.run.events import EventType
from pipeline.train.val_metrics import estimate, read_val_metrics


def saved(ctx: StageContext, ckpt: Path) -> Measurement | None:
    """Checkpoint `ckpt`'s saved measurement, when it is of these contents."""
    path = ctx.out / "checkpoints" / f"{ckpt.name}.json"
    old = json.loads(path.read_text()) if path.exists() else None
    return Measurement.from_json(old) if old and old.get("checkpoint") == checkpoint_id(ckpt) \
        else None


def measure(ctx: StageContext, ev: ServerPool, n: int, ckpt: Path) -> Measurement:
    """Checkpoint `ckpt`'s measurement: the saved one when it is of these
    contents, else a new one (server n), saved as it ends."""
    old = saved(ctx, ckpt)
    if old is not None:
        print(f"evaluate: checkpoint {ckpt.name} already measured", flush=True)
        return old
    ident = checkpoint_id(ckpt)
    served = served_draft(ctx, ckpt, ev.env)
    if served != ckpt:
        print(f"evaluate: checkpoint {ckpt.name} is an MLA draft: serving its vLLM "
              f"export {served}", flush=True)
    m = ev.run_prompts(n, ckpt, served,
                       mla_draft_backend(ctx, ev.env) if served != ckpt else None)
    guess = estimate(ctx.cfg, read_val_metrics(ckpt))
    if guess is None:   # no val_metrics.json there: the epoch's figure from train
        guess = train_estimates(ctx.out_of("train") / "plateau.json").get(ckpt.name)
    m = dataclasses.replace(m, served=str(served), checkpoint=ident, estimate=guess)
    ctx.write_json(ctx.out / "checkpoints" / f"{ckpt.name}.json", m.to_json())
    print(f"evaluate: checkpoint {ckpt.name}: acceptance length "
          f"{m.acceptance_length:.3f} (train's estimate "
          f"{'-' if guess is None else format(guess, '.3f')}) over "
          f"{m.drafts} drafts, {m.decode_tokens_per_s:.1f} tokens/s", flush=True)
    return m


def emit(ctx: StageContext, ckpt: Path, m: Measurement) -> None:
    """The measurement as a metric event: the panel's chart and the trackers' step."""
    ctx.events.emit(EventType.METRIC, step=m.checkpoint["global_step"], epoch=ckpt.name,
                    split="eval", values={
                        "acceptance_length": m.acceptance_length,
                        "acceptance_estimate": m.estimate,
                        **{f"accept_rate_{k}": r for k, r in enumerate(m.per_position)}})
