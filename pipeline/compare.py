"""`eagle-panel compare RUN [RUN ...]`: runs side by side, one row each.

A user choosing a draft algorithm (or a draft size, or a budget) for their
own target wants their own numbers, not a paper's: the same target and data
trained several ways, each measured by vLLM. Every figure here comes from
what the runs already recorded (each stage's summary through the read model,
the checkpoint's safetensors header for its size), so comparing costs no
GPU and never writes into a run. Runs of different targets or data are
compared anyway, with the difference said above the table: that is a
mistake a user should see, not a refusal.
"""

from __future__ import annotations

import json
import math
import struct
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomllib

from pipeline import fmt
from pipeline.config import BUILTIN_MODEL
from pipeline.run.rundir import RunDir
from pipeline.run.snapshot import read_run
from pipeline.train.mla_draft import safetensors_header


@dataclass
class Row:
    run: str
    algorithm: str
    draft: str                        # "llama", "mla", "own"
    parameters: int | None            # the draft checkpoint's (its safetensors header)
    train_s: float | None
    disk_bytes: int                   # the whole run folder
    val_loss: float | None
    estimate: float | None            # train's
    acceptance: float | None          # vLLM's, of the draft evaluate chose
    per_position: list = field(default_factory=list)
    per_category: dict = field(default_factory=dict)
    decode_tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    target: str = ""
    data: str = ""
    not_measured: str = ""            # why vLLM did not measure it (evaluate skipped, off)


def parameters(checkpoint: Path) -> int | None:
    """Elements in a checkpoint's safetensors files, from their headers (the
    tensors themselves are not read); None where one cannot be read."""
    files = sorted(checkpoint.glob("*.safetensors")) if checkpoint.is_dir() else []
    try:
        shapes = [s for f in files for s in safetensors_header(f).values()]
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return sum(math.prod(s) for s in shapes) if files else None


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def config_of(rd: RunDir) -> dict:
    try:
        return tomllib.loads((rd.path / "config.toml").read_text())
    except (OSError, ValueError):
        return {}


def row(rd: RunDir) -> Row:
    """One run's figures, from its records."""
    snap = read_run(rd)
    train, ev = snap.stages["train"], snap.stages["evaluate"]
    ts, es = train.summary, ev.summary
    cfg = config_of(rd)
    ckpt = Path(ts.checkpoint) if ts.checkpoint else None
    return Row(
        run=rd.id, algorithm=ts.algorithm or cfg.get("stages", {}).get("train", {}).get(
            "algorithm", "eagle3"),
        draft=ts.draft_layer or "", parameters=parameters(ckpt) if ckpt else None,
        train_s=train.seconds() or (train.finished or {}).get("duration_s"),
        disk_bytes=disk_bytes(rd.path), val_loss=ts.val_loss,
        estimate=ts.acceptance_length, acceptance=es.acceptance_length,
        per_position=list(es.per_position or []),
        per_category=dict(es.per_category or {}),
        decode_tokens_per_s=es.decode_tokens_per_s,
        baseline_tokens_per_s=es.baseline_tokens_per_s,
        target=str(cfg.get("model", {}).get("target", BUILTIN_MODEL)),
        data=str(cfg.get("data", {}).get("path", "(bundled)")),
        not_measured=not_measured(ev))


def not_measured(ev) -> str:
    """Why vLLM has no figure for the run: evaluate skipped (its reason) or
    failed (its error); "" where it measured, or has not run yet."""
    if ev.status == "skipped":
        return str(ev.summary.skipped or ev.reason or "evaluate is off")
    if ev.status == "failed":
        err = (ev.last_error or {}).get("message") or ev.reason or "see its log"
        return f"evaluate failed: {err}"
    return ""


def differences(rows: list[Row]) -> list[str]:
    """What the runs do not share that a comparison assumes they do."""
    out = []
    for what in ("target", "data"):
        values = {getattr(r, what) for r in rows}
        if len(values) > 1:
            out.append(f"the runs differ in {what}: " + ", ".join(
                f"{r.run} {getattr(r, what)}" for r in rows))
    return out


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


COLUMNS = ("run", "algorithm", "draft", "params", "train", "disk", "val", "est.", "vLLM",
           "tok/s")
WIDTHS = (-12, -9, -5, 6, 6, 8, 6, 4, 4, 9)   # the text table's (negative: left-aligned)


def cells(r: Row) -> tuple[str, ...]:
    """One row's figures as text, a cell per COLUMNS (the table here and the
    panel's compare screen)."""
    speed = "-" if r.decode_tokens_per_s is None else (
        f"{r.decode_tokens_per_s:.0f}" + (f"/{r.baseline_tokens_per_s:.0f}"
                                          if r.baseline_tokens_per_s else ""))
    return (r.run, r.algorithm, r.draft or "-",
            "-" if r.parameters is None else f"{r.parameters / 1e6:.2f}M",
            fmt.duration(r.train_s) if r.train_s else "-",
            fmt.nbytes(r.disk_bytes).replace(" ", ""), _num(r.val_loss, ".3f"),
            _num(r.estimate, ".2f"), _num(r.acceptance, ".2f"), speed)


def _line(values) -> str:
    """Cells at WIDTHS: a left-aligned one cut to its width, a figure never cut."""
    return " ".join(f"{v[:-w]:<{-w}}" if w < 0 else f"{v:>{w}}"
                    for v, w in zip(values, WIDTHS, strict=True))


def table(rows: list[Row]) -> str:
    """The rows as text (80 columns: a line per run, its per-position and
    per-category figures on the line under it)."""
    lines = [*(f"note: {d}" for d in differences(rows)), _line(COLUMNS)]
    for r in rows:
        lines.append(_line(cells(r)))
        detail = []
        if r.per_position:
            detail.append("per position " + " ".join(f"{p:.2f}" for p in r.per_position))
        if r.per_category:
            detail.append(" ".join(f"{c} {v:.2f}" for c, v in sorted(r.per_category.items())))
        if r.not_measured:
            detail.append(f"not measured: {r.not_measured}")
        if detail:
            lines.append(textwrap.fill(" · ".join(detail), 80, initial_indent=" " * 13,
                                       subsequent_indent=" " * 13))
    lines.append(textwrap.fill(
        "params: the draft checkpoint's; train: every attempt; disk: the run folder; val: "
        "last validation loss; est.: train's acceptance estimate; vLLM: the acceptance length "
        "vLLM measured; tok/s: decode with the draft/without", 80))
    return "\n".join(lines)


def as_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
