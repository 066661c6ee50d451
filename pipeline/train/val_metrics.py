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


def acceptance_length(val: dict, ttt_steps: int) -> float | None:
    """Greedy-chain estimate: 1 + sum over draft positions of full accuracy."""
    accs = [val.get(f"full_acc_{i}") for i in range(ttt_steps)]
    if not accs or any(a is None for a in accs):
        return None
    return 1.0 + sum(accs)


def read_val_metrics(folder: Path) -> dict:
    """The checkpoint folder's val_metrics.json, keys without speculators'
    `_epoch` suffix; {} when it is missing or unreadable (an estimate is
    optional, never a failure)."""
    try:
        raw = json.loads((folder / "val_metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return {(k[:-6] if k.endswith("_epoch") else k): v for k, v in raw.items()}
