"""A draft checkpoint's validation metrics, and the acceptance length they estimate.

Train writes them (speculators' val_metrics.json, beside a checkpoint only
when its validation loss improved; every epoch's estimate also goes to
train/out/plateau.json) and decides its plateau stop by the estimate;
evaluate reads them back to put the estimate beside what vLLM measured. Both
stage entry points import this.
"""

from __future__ import annotations

import json
from pathlib import Path


def acceptance_length(val: dict, positions: int, algorithm: str = "eagle3") -> float | None:
    """The acceptance length `algorithm`'s own validation metrics estimate
    over `positions` draft tokens (pipeline.train.algorithms); None without them."""
    from pipeline.train.algorithms import get
    return get(algorithm).estimate(val, positions)


def read_val_metrics(folder: Path) -> dict:
    """The checkpoint folder's val_metrics.json, keys without speculators'
    `_epoch` suffix; {} when it is missing or unreadable (an estimate is
    optional, never a failure)."""
    try:
        raw = json.loads((folder / "val_metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return {(k[:-6] if k.endswith("_epoch") else k): v for k, v in raw.items()}


def estimate(cfg, val: dict) -> float | None:
    """The run's estimate from `val`: its algorithm's, over the positions it
    is measured at (EAGLE-3's TTT steps; a parallel or block draft's served
    `num_speculative_tokens`)."""
    from pipeline.train.algorithms import get
    train = cfg.stages.train
    algo = get(train.algorithm)
    positions = train.ttt_steps if algo.eagle3_layers else cfg.stages.evaluate.num_speculative_tokens
    return algo.estimate(val, positions)
