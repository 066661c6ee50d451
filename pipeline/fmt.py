"""Plain-text formatting shared by the CLI, the panel and its widgets (no
terminal library: the CLI runs without one)."""

from __future__ import annotations

import time

from pipeline.run.diskspace import fmt_bytes


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


def progress_text(ev: dict | None) -> str:
    if not ev:
        return "-"
    done, total, unit = ev.get("done"), ev.get("total"), ev.get("unit", "")
    parts = [f"{done}/{total} {unit}" if total else f"{done} {unit}"]
    if ev.get("rate"):
        parts.append(f"{ev['rate']:.1f}/s")
    if ev.get("eta_s") is not None:
        parts.append(f"ETA {duration(ev['eta_s'])}")
    return "  ".join(parts)


def outcome_lines(train: dict, evaluate: dict, evaluate_state: dict) -> list[str]:
    """What a finished pipeline made: the draft, its acceptance length as
    vLLM measured it beside train's estimate, and the speedup."""
    lines = []
    if train.get("checkpoint"):
        lines += ["", f"trained draft: {train['checkpoint']}"]
    est = train.get("acceptance_length")
    measured = evaluate.get("acceptance_length")
    if measured is not None:
        per_pos = " ".join(f"{r:.2f}" for r in evaluate.get("per_position") or [])
        lines.append(f"acceptance length: {measured:.2f} measured by vLLM (checkpoint "
                     f"{evaluate.get('checkpoint')}, {evaluate.get('prompts')} prompts)"
                     + (f", {evaluate['acceptance_estimate']:.2f} estimated by train"
                        if evaluate.get("acceptance_estimate") is not None else "")
                     + (f"; accepted at each draft position: {per_pos}" if per_pos else ""))
        if evaluate.get("speedup"):
            lines.append(f"decode: {evaluate['decode_tokens_per_s']:.0f} tokens/s with the draft, "
                         f"{evaluate['baseline_tokens_per_s']:.0f} without: "
                         f"{evaluate['speedup']:.2f}x")
    elif est is not None:
        lines.append(f"estimated acceptance length (greedy chain, validation): {est:.2f}")
        if evaluate.get("skipped"):
            lines.append(f"not measured: evaluate was skipped: {evaluate['skipped']}")
        elif str(evaluate_state.get("reason") or "").startswith("off"):
            lines.append(f"not measured: evaluate is {evaluate_state['reason']}")
    return lines
