"""evaluate's results: results.json (every measurement, the baseline, the
settings and servers) and the stage's summary; the gate on the number."""

from __future__ import annotations

from pipeline.drive.stage_context import StageContext, StageError
from pipeline.evaluate.measurement import Measurement
from pipeline.run.events import EventType
from pipeline.run.summaries import EvaluateSummary, WorstCategory


def write(ctx: StageContext, results: dict[str, Measurement], last_name: str,
          baseline: Measurement | None, n_prompts: int, servers: dict) -> EvaluateSummary:
    """results.json (with its artifact event) and the stage's summary."""
    sec = ctx.section
    last = results[last_name]
    speedup = (last.decode_tokens_per_s / baseline.decode_tokens_per_s
               if baseline and baseline.decode_tokens_per_s else None)
    cats = last.per_category or {}
    worst = min(((c, v["acceptance_length"]) for c, v in cats.items()
                 if v.get("acceptance_length") is not None), key=lambda x: x[1], default=None)
    out = {"checkpoints": {n: m.to_json() for n, m in results.items()},
              "baseline": baseline.to_json() if baseline else None, "speedup": speedup,
              "num_speculative_tokens": sec.num_speculative_tokens,
              "temperature": sec.temperature, "concurrency": sec.concurrency,
              "max_tokens": sec.max_tokens, "seed": sec.seed,
              "prompts": "validation split" if not sec.prompts else sec.prompts,
              "per_category": cats, "worst_prompts": last.worst_prompts or [],
              "min_acceptance": sec.min_acceptance or None, "servers": servers,
              "algorithm": ctx.cfg.stages.train.algorithm}
    ctx.write_json(ctx.out / "results.json", out)
    ctx.events.emit(EventType.ARTIFACT, path=str(ctx.out / "results.json"), kind="evaluation",
                    bytes=(ctx.out / "results.json").stat().st_size)
    return EvaluateSummary(
        checkpoint=last_name, acceptance_length=last.acceptance_length,
        acceptance_estimate=last.estimate,
        per_position=[round(r, 4) for r in last.per_position if r is not None],
        per_category={c: round(v["acceptance_length"], 4) for c, v in cats.items()
                      if v.get("acceptance_length") is not None},
        worst_category=WorstCategory(worst[0], round(worst[1], 4))
        if worst and len(cats) > 1 else None,
        decode_tokens_per_s=round(last.decode_tokens_per_s, 1),
        baseline_tokens_per_s=round(baseline.decode_tokens_per_s, 1) if baseline else None,
        speedup=round(speedup, 3) if speedup else None, prompts=n_prompts,
        target_loads=servers["target_loads"],   # (this attempt's)
        measured=len(results), drafts_swapped=sum(
            (m.served_by or "").startswith("swapped") for m in results.values()),
        results=str(ctx.out / "results.json"))


def gate(threshold: float, summary: EvaluateSummary) -> None:
    """[stages.evaluate] min_acceptance: below it the stage fails, so a
    script can rely on `run --wait`'s exit status (0 = off). The
    measurements are kept: a resume fails again at once, without serving."""
    measured = summary.acceptance_length
    if not threshold or measured is None or measured >= threshold:
        return
    worst = summary.worst_category
    raise StageError(f"acceptance length {measured:.2f} measured is below min_acceptance "
                     f"{threshold:g}" + (f"; lowest category: {worst.category} "
                                         f"{worst.acceptance_length:.2f}" if worst else ""),
                     hint=f"see the worst prompts in {summary.results}; train longer or "
                          "on the target's own answers ([stages.regenerate]), or lower "
                          "min_acceptance")
