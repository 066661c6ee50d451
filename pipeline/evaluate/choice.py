"""Which checkpoints evaluate measures, and which one the run names: pure
choices over train's folders and records (no vLLM, no server), so every
branch is testable on a recorded run folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.drive.stage_context import StageContext, StageError
from pipeline.run import summaries
from pipeline.run.events import last_event
from pipeline.run.rundir import RunDir
from pipeline.train.checkpoints import complete_checkpoint


def checkpoints(save_path: Path, which: str, train_chose: Path | None = None) -> list[Path]:
    """The checkpoint folders to measure, oldest first. "chosen": the one
    train's summary names (`train_chose`: its budget rule's highest
    estimate, else speculators' best or last), so that the draft train
    reports is the one measured and shipped; the last where train named none."""
    epochs = sorted((d for d in save_path.iterdir() if d.name.isdigit() and not d.is_symlink()
                     and complete_checkpoint(d)), key=lambda d: int(d.name)) \
        if save_path.is_dir() else []
    if not epochs:
        return []
    if which == "all":
        return epochs
    if which.startswith("best-"):
        return top_estimated(epochs, save_path.parent / "plateau.json", int(which[5:]))
    best = save_path / "checkpoint_best"
    if which == "best" and best.exists():
        return [best.resolve()]
    named = named_checkpoint(epochs, train_chose) if which == "chosen" else None
    return [named or epochs[-1]]


def named_checkpoint(epochs: list[Path], named: Path | None) -> Path | None:
    """The epoch folder of `epochs` that train's summary named, found by its
    name (checkpoint_best: the epoch it points to), so that a run folder
    moved or copied elsewhere still finds it; None where it is not there."""
    if named is None or not epochs:
        return None
    name = os.path.basename(os.path.realpath(epochs[0].parent / named.name)) \
        if named.name == "checkpoint_best" else named.name
    return next((d for d in epochs if d.name == name), None)


def chosen_by(which: str, named: Path | None, measured: list[Path]) -> str:
    """How the one checkpoint measured was chosen, in words ("chosen" where
    train named none, or one not there, falls back to the last and says so)."""
    if which != "chosen":
        return f"{which} checkpoint"
    return "the checkpoint train chose" if named_checkpoint(measured, named) is not None \
        else "last checkpoint (train named none)"


def recorded_tokens(ckpt: Path) -> int | None:
    """The tokens a checkpoint was trained to draft, as speculators records
    them (config.json: speculators_config.proposal_methods[0].speculative_tokens)."""
    try:
        spec = json.loads((ckpt / "config.json").read_text())["speculators_config"]
        return int(spec["proposal_methods"][0]["speculative_tokens"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def check_drafted_tokens(ctx: StageContext, algo, chosen: list[Path]) -> None:
    """`num_speculative_tokens` against what each checkpoint records: more than a
    block drafter's block holds is an error before any server starts (vLLM cannot
    draft them; the config's own check sees only today's block_size, not the one
    the draft was trained with); more than EAGLE-3's TTT steps a warning (vLLM
    drafts on, past what the draft was trained for)."""
    k = ctx.section.num_speculative_tokens
    for ckpt in chosen:
        most = recorded_tokens(ckpt)
        if most is None or k <= most:
            continue
        if algo.block:
            raise StageError(f"[stages.evaluate] num_speculative_tokens = {k}, but checkpoint "
                             f"{ckpt.name} of {algo.display} drafts at most {most} tokens (its "
                             f"config.json: speculators_config.proposal_methods[0]."
                             "speculative_tokens)",
                             hint=f"set num_speculative_tokens <= {most}, or train again with a "
                                  "larger [stages.train] block_size")
        ctx.events.warning(f"[stages.evaluate] num_speculative_tokens = {k}, but checkpoint "
                           f"{ckpt.name} was trained for {most} (its TTT steps): vLLM drafts the "
                           "rest past what the draft learned, and accepts few of them",
                           hint=f"set num_speculative_tokens <= {most}, or [stages.train] "
                                f"ttt_steps >= {k}")
        return


def train_chose(run: RunDir) -> Path | None:
    """The checkpoint train's last summary names (None: train has not
    succeeded, or named none); whether it is still there is the caller's."""
    fin = last_event(run.events_path("train"), ("stage_finished",))
    named = summaries.read("train", (fin or {}).get("summary")).checkpoint
    return Path(named) if named and fin.get("status") == "succeeded" else None


def train_estimates(history: Path) -> dict[str, float]:
    """Train's estimate per epoch (train/out/plateau.json: every epoch's;
    speculators writes a checkpoint's val_metrics.json only when its
    validation loss improved); {} without it."""
    try:
        return {str(e): v for e, v in json.loads(history.read_text())["history"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def top_estimated(epochs: list[Path], history: Path, k: int) -> list[Path]:
    """The k of `epochs` with the highest estimates in train's history
    (train/out/plateau.json), oldest first; without it, the last k."""
    est = train_estimates(history)
    ranked = sorted(epochs, key=lambda d: (est.get(d.name, float("-inf")), int(d.name)))
    return sorted(ranked[-k:], key=lambda d: int(d.name))


def best_measured(acceptance: dict[str, float | None]) -> str:
    """Of the checkpoints measured (name -> acceptance length, oldest first),
    the one with the longest acceptance (the later on a tie)."""
    names = list(acceptance)
    return max(reversed(names), key=lambda n: acceptance[n] or 0.0)


def checkpoint_id(folder: Path) -> dict:
    """What identifies a checkpoint's contents (a re-trained one differs)."""
    state = json.loads((folder / "training_state.json").read_text())
    return {"name": folder.name, "global_step": state.get("global_step"),
            "bytes": (folder / "model.safetensors").stat().st_size}
