"""Checkpoints that resume without redoing or trusting half-written work.

speculators 0.9 writes `training_state.json` last in a checkpoint folder; a
checkpoint write here first removes it (`SafeCheckpointer`), so a folder cut
short by a kill is recognisably incomplete (`complete_checkpoint`) and is set
aside before resuming (`set_aside_incomplete`). A checkpoint that cannot fit
on the disk is refused before it starts rather than left half written.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from pipeline.run.diskspace import ensure_room

STATE_FILE = "training_state.json"


def complete_checkpoint(folder: Path) -> bool:
    try:
        json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (folder / "model.safetensors").is_file() and (folder / "optimizer_state_dict.pt").is_file()


def set_aside_incomplete(save_path: Path) -> list[str]:
    """Move checkpoint folders that a kill cut short out of the trainer's
    sight; returns their names. Dangling links to them are removed too."""
    moved = []
    if not save_path.is_dir():
        return moved
    aside = save_path.parent / ".incomplete_checkpoints"
    for d in sorted(save_path.iterdir()):
        if d.is_symlink() or not d.is_dir():
            continue
        if (d.name.isdigit() or d.name == "interrupted") and not (
                d.name.isdigit() and complete_checkpoint(d)):
            aside.mkdir(exist_ok=True)
            d.rename(aside / f"{d.name}-{int(time.time() * 1000)}")
            moved.append(d.name)
    for link in save_path.iterdir():
        if link.is_symlink() and not link.exists():
            link.unlink()
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    return moved


def checkpoint_bytes(model, optimizer, float_dtype) -> int:
    """What one checkpoint folder takes: the weights in `float_dtype` and
    the optimizer's state tensors as they are (Adam: two fp32 per weight),
    plus 5% for headers and the small files. The train stage refuses to
    start a checkpoint that cannot fit rather than leave half of one."""
    import torch
    weights = sum(t.numel() for t in model.state_dict().values()) * \
        torch.empty(0, dtype=float_dtype).element_size()
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    moments = sum(v.numel() * v.element_size() for opt in optimizers
                  for st in opt.state_dict()["state"].values()
                  for v in st.values() if torch.is_tensor(v))
    return int((weights + moments) * 1.05) + (64 << 10)


def latest_checkpoint(save_path: Path) -> Path | None:
    best = save_path / "checkpoint_best"
    if best.exists():
        return best.resolve()
    epochs = [d for d in save_path.iterdir() if d.name.isdigit() and complete_checkpoint(d)] \
        if save_path.is_dir() else []
    return max(epochs, key=lambda d: int(d.name)) if epochs else None


def safe_checkpointer(base):
    """speculators' checkpointer class `base`, whose saves first check the
    room and drop the completion marker."""
    import torch

    class SafeCheckpointer(base):
        def save_checkpoint(self, model, optimizer, epoch, float_dtype=torch.bfloat16):
            ensure_room(self.path, checkpoint_bytes(model, optimizer, float_dtype),
                        f"checkpoint {epoch}")
            (self.path / str(epoch) / STATE_FILE).unlink(missing_ok=True)
            super().save_checkpoint(model, optimizer, epoch, float_dtype)

    return SafeCheckpointer
