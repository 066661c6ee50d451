"""Plain-text formatting shared by the CLI, the panel and its widgets (no
terminal library: the CLI runs without one)."""

from __future__ import annotations

import time

from pipeline.run.diskspace import fmt_bytes
from pipeline.run.summaries import (
    EvaluateSummary,
    ExtractSummary,
    PrepareSummary,
    RegenerateSummary,
    Summary,
    TrainSummary,
    VocabSummary,
)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def nbytes(n: float | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def stage_duration(st: dict, now: float | None = None) -> float | None:
    if not st.get("started_at"):
        return None
    end = st.get("ended_at") or (now or time.time())
    return max(0.0, end - st["started_at"])


def exit_text(st: dict) -> str:
    if st.get("signal"):
        return st["signal"]
    if st.get("exit_code") is not None:
        return str(st["exit_code"])
    return "-"


def rate_text(rate: float, unit: str | None = None) -> str:
    """`1.6 steps/s`; under 0.1 a second (an evaluate's measurements, a slow
    regenerate) the time each takes, `1m20s per measurement`, never `0.0 x/s`.
    Without a unit (the stage table's column): `1.6/s`, `1m20s each`."""
    if rate >= 0.1:
        return f"{rate:.1f} {unit}/s" if unit else f"{rate:.1f}/s"
    if not unit:
        return f"{duration(1 / rate)} each"
    one = unit[:-1] if unit.endswith("s") and not unit.endswith("ss") else unit
    return f"{duration(1 / rate)} per {one}"


def epoch_text(epoch: int | None, epochs: int | None) -> str:
    """`epoch 2/4`: counted from 1, as every other line that names an epoch
    (speculators' own numbers, the checkpoint folders' names, start at 0);
    `epochs` the planned number (a plateau may stop before)."""
    if epoch is None:
        return ""
    return f"epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")


def progress_text(ev: dict | None, running: bool = True) -> str:
    """`340/510 steps  1.6 steps/s  ETA 1m46s`; a stage that no longer runs
    has its count only (no rate, no "ETA 0.0s")."""
    if not ev:
        return "-"
    done, total, unit = ev.get("done"), ev.get("total"), ev.get("unit", "")
    parts = [f"{done}/{total} {unit}".rstrip() if total else f"{done} {unit}".rstrip()]
    if not running:
        return parts[0]
    if ev.get("phase"):
        return f"{parts[0]}  {ev['phase']}"
    if ev.get("rate"):
        parts.append(rate_text(ev["rate"], unit or "items"))
    if ev.get("eta_s") is not None and not (total and done == total):
        parts.append(f"ETA {duration(ev['eta_s'])}")
    return "  ".join(parts)


def outcome_lines(train: TrainSummary, evaluate: EvaluateSummary, evaluate_state: dict,
                  run_id: str = "") -> list[str]:
    """What a finished pipeline made: the draft, its acceptance length as
    vLLM measured it beside train's estimate, and the speedup; then where
    its trackers are and how to export it."""
    lines = _made_lines(train, evaluate, evaluate_state)
    return lines + next_lines(train, evaluate, run_id) if lines else lines


def next_lines(train: TrainSummary, evaluate: EvaluateSummary, run_id: str) -> list[str]:
    """After a run: how to look at its trackers, and (a measured draft) the
    command that exports it for shipping."""
    lines = []
    trackers = evaluate.trackers or train.trackers or []
    if trackers:
        lines.append("trackers: " + "; ".join(trackers))
    if evaluate.acceptance_length is not None and run_id:
        lines.append(f"to ship it: eagle-panel export {run_id} (draft + model card)")
    return lines


def _made_lines(train: TrainSummary, evaluate: EvaluateSummary,
                evaluate_state: dict) -> list[str]:
    lines = []
    # Where vLLM measured, the draft named is the one it measured (the best of
    # several, or the one `checkpoints` chose), so the acceptance printed below
    # is that draft's; else train's pick.
    measured = evaluate.acceptance_length
    draft, chosen_by = (evaluate.checkpoint_path, evaluate.checkpoint_chosen_by) \
        if evaluate.checkpoint_path and measured is not None else \
        (train.checkpoint, train.checkpoint_chosen_by)
    if draft:
        lines += ["", f"trained draft{f' ({chosen_by})' if chosen_by else ''}: {draft}"]
    if train.stopped:
        lines.append(f"training stopped: {train.stopped} ({train.epochs_trained} "
                     f"epochs, total_seq_len {train.total_seq_len})")
    est = train.acceptance_length
    if measured is not None:
        lines += _measured_lines(evaluate)
    elif est is not None:
        lines.append(f"estimated acceptance length (greedy chain, validation): {est:.2f}")
        if evaluate.skipped:
            lines.append(f"not measured: evaluate was skipped: {evaluate.skipped}")
        elif str(evaluate_state.get("reason") or "").startswith("off"):
            lines.append(f"not measured: evaluate is {evaluate_state['reason']}")
    return lines


def _measured_lines(ev: EvaluateSummary) -> list[str]:
    """vLLM's measurement: the acceptance (train's estimate beside it), the
    speedup, the drafts swapped into a running server."""
    per_pos = " ".join(f"{r:.2f}" for r in ev.per_position or [])
    lines = [f"acceptance length: {ev.acceptance_length:.2f} measured by vLLM (checkpoint "
             f"{ev.checkpoint}, {ev.prompts} prompts)"
             + (f", {ev.acceptance_estimate:.2f} estimated by train"
                if ev.acceptance_estimate is not None else "")
             + (f"; accepted at each draft position: {per_pos}" if per_pos else "")]
    if ev.speedup:
        lines.append(f"decode: {ev.decode_tokens_per_s:.0f} tokens/s with the draft, "
                     f"{ev.baseline_tokens_per_s:.0f} without: {ev.speedup:.2f}x")
    if ev.drafts_swapped:
        lines.append(f"evaluate: {ev.drafts_swapped} of {ev.measured} checkpoints measured on "
                     "a running server, their drafts swapped in")
    return lines


def target_loads_line(stages: list[tuple[str, int, float, float]]) -> str | None:
    """(stage, target loads, seconds loading, seconds the stage ran) -> the
    line a big target's user reads first: how much of the run was loading."""
    stages = [s for s in stages if s[1]]
    if not stages:
        return None
    loads = sum(s[1] for s in stages)
    each = ", ".join(f"{name} {n}" for name, n, _, _ in stages)
    # summed over servers: two that start side by side (evaluate's draft and
    # baseline) count twice, so the sum can pass the stages' own time
    return (f"vLLM target loads: {loads} ({each}); {duration(sum(s[2] for s in stages))} "
            f"of server starts (summed) in {duration(sum(s[3] for s in stages))} of those "
            "stages")


def num(v, digits: int = 3) -> str:
    """A figure for people: 3 significant digits, thousands separated."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 1000:
        return f"{int(v):,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def _rate(tokens_per_s) -> str:
    return f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f}"


def summary_text(stage: str, s: Summary) -> str:
    """A stage's summary as a person would write it, e.g. `acceptance 3.02
    measured, 3.00 estimated · speedup 0.96x`; figures a stage does not
    name here are listed rounded."""
    if s.skipped:
        return f"skipped: {s.skipped}"
    if s.error:
        return str(s.error)
    parts = _STAGE_PARTS[stage](s) if stage in _STAGE_PARTS else []
    if not parts:
        parts = [f"{k} {num(v)}" for k, v in s.figures().items()]
    return " · ".join(parts)


def _evaluate_parts(s: EvaluateSummary) -> list[str]:
    if s.acceptance_length is None:
        return []
    est = s.acceptance_estimate
    parts = [f"acceptance {s.acceptance_length:.2f} measured"
             + (f", {est:.2f} estimated" if est is not None else "")]
    if s.worst_category:
        w = s.worst_category
        parts.append(f"lowest: {w.category} {w.acceptance_length:.2f}")
    if s.speedup:
        parts.append(f"speedup {s.speedup:.2f}x")
    if s.prompts:
        parts.append(f"{s.prompts} prompts")
    return parts


def _train_parts(s: TrainSummary) -> list[str]:
    if s.checkpoint_step is not None:   # cancelled mid-training
        name = str(s.resume_checkpoint or "").rstrip("/").rsplit("/", 1)[-1]
        return [f"stopped at step {s.checkpoint_step}",
                f"checkpoint {name}" if name else "no checkpoint yet",
                "resume: r (eagle-panel resume)"]
    if not s.checkpoint:
        return []
    parts = []
    if s.val_loss is not None:
        parts.append(f"validation loss {s.val_loss:.3f}")
    if s.acceptance_length is not None:
        parts.append(f"acceptance {s.acceptance_length:.2f} estimated")
    algo = s.algorithm or "eagle3"
    layer = s.draft_layer
    if algo != "eagle3" or layer:   # "llama draft", "eagle3.1 mla draft", "peagle draft"
        parts.append(" ".join(w for w in (algo if algo != "eagle3" else "",
                                          layer if layer != "own" else "") if w) + " draft")
    parts.append(f"checkpoint {str(s.checkpoint).rstrip('/').rsplit('/', 1)[-1]}")
    if s.stopped:
        parts.append(f"stopped: {s.stopped}")
    return parts


def _extract_parts(s: ExtractSummary) -> list[str]:
    if s.samples is None:
        return []
    parts = [f"{s.samples:,} samples ({s.reused or 0:,} kept from before)"]
    if s.tokens:
        parts.append(f"{s.tokens:,} tokens at {_rate(s.tokens_per_s or 0)} tokens/s")
    if s.backend:
        parts.append(f"backend {s.backend}")
    return parts


def _prepare_parts(s: PrepareSummary) -> list[str]:
    if s.samples is None:
        return []
    return [f"{s.samples:,} rows from {s.rows_in or 0:,}"
            + (f" ({s.skipped_rows} skipped)" if s.skipped_rows else ""),
            f"{s.tokens or 0:,} tokens, {s.supervised_tokens or 0:,} supervised"]


def _vocab_parts(s: VocabSummary) -> list[str]:
    if s.coverage is None:
        return []
    return [f"{s.draft_vocab_size or 0:,} of {s.target_vocab_size or 0:,} tokens "
            f"cover {s.coverage:.1%} of the supervised ones"]


def _regenerate_parts(s: RegenerateSummary) -> list[str]:
    if s.conversations is None:
        return []
    return [f"{s.regenerated or 0:,} of {s.conversations:,} conversations answered "
            f"by the target: {s.rows or 0:,} rows, {s.generated_tokens or 0:,} tokens"
            + (f", {s.failed} failed" if s.failed else "")]


# Each stage's own words for its summary (summary_text); a stage not here, or a
# summary its function does not recognise, is listed figure by figure.
_STAGE_PARTS = {"evaluate": _evaluate_parts, "train": _train_parts, "extract": _extract_parts,
                "prepare": _prepare_parts, "vocab": _vocab_parts,
                "regenerate": _regenerate_parts}
