"""The few places where eagle-panel adjusts speculators 0.9's Trainer, in one
module, by subclassing and by replacing names in speculators' module
namespaces at run time (never by editing site-packages).

CPU (docs/FACTS.md): the Trainer assumes an accelerator in three places —
  1. `model.to(local_rank)` with an int rank (means cuda:N)  -> the CPU device
  2. `_StepTimer` calls `torch.accelerator.synchronize()`    -> skipped without one
  3. the checkpointer loads onto `get_current_device()`      -> "cpu"
plus autocast on device type "cuda", which becomes "cpu".

Everywhere (resume that never redoes or corrupts work):
  - a checkpoint write first removes the folder's training_state.json, which
    speculators writes last, so a folder cut short by a kill is recognisably
    incomplete (`complete_checkpoint`) and is set aside before resuming;
  - SIGINT saves a mid-epoch checkpoint under the epoch's number with its
    step (speculators' own `interrupted` folder is not resumable), so resume
    continues at the same global step.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from pipeline.diskspace import ensure_room

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


def install(cpu: bool, hooks) -> None:
    """Patch speculators' training modules for this process.

    hooks: an object with `on_total_steps(n)`, `should_stop()` and
    `on_interrupted(epoch, local_step, global_step)`.
    """
    import torch
    from speculators.train import checkpointer as ck_mod
    from speculators.train import cli as cli_mod
    from speculators.train import trainer as tr_mod

    class SafeCheckpointer(ck_mod.SingleGPUCheckpointer):
        def save_checkpoint(self, model, optimizer, epoch, float_dtype=torch.bfloat16):
            ensure_room(self.path, checkpoint_bytes(model, optimizer, float_dtype),
                        f"checkpoint {epoch}")
            (self.path / str(epoch) / STATE_FILE).unlink(missing_ok=True)
            super().save_checkpoint(model, optimizer, epoch, float_dtype)

    tr_mod.SingleGPUCheckpointer = SafeCheckpointer

    class PanelTrainer(tr_mod.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            steps = len(self.train_loader) * self.config.num_epochs
            if self.config.max_steps:
                steps = min(steps, self.config.max_steps)
            hooks.on_total_steps(steps, len(self.train_loader))
            self._epoch = self.current_epoch
            self._epoch_origin = self.global_step - self._resume_local_step

        def train_epoch(self, epoch, **kwargs):
            self._epoch = epoch
            self._epoch_origin = self.global_step - (
                self._resume_local_step if epoch == self.current_epoch else 0)
            # The packed batches are drawn anew each epoch and their number
            # changes with them: the total is re-counted from this epoch's
            # (later epochs estimated alike), so progress never ends at 118/117.
            sampler = self.train_loader.batch_sampler
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            per_epoch = len(self.train_loader)
            total = self._epoch_origin + per_epoch * (self.config.num_epochs - epoch)
            if self.config.max_steps:
                total = min(total, self.config.max_steps)
            hooks.on_total_steps(total, per_epoch)
            return super().train_epoch(epoch, **kwargs)

        def run_training(self):
            if hooks.should_stop():
                hooks.on_interrupted(self._epoch, 0, self.global_step)
                return None
            return super().run_training()

        def maybe_save_checkpoint(self, epoch, local_step=0):
            if epoch != "interrupted":
                return super().maybe_save_checkpoint(epoch, local_step)
            local = self.global_step - self._epoch_origin
            hooks.on_interrupted(self._epoch, local, self.global_step)
            if local <= 0:
                return None  # nothing done since the last checkpoint
            steps = len(self.train_loader)
            saved = self.config
            # Save now whatever the checkpoint frequency says: a mid-epoch
            # checkpoint (or the epoch's end) that speculators resumes from.
            self.config = saved._replace(checkpoint_freq=1, save_best=False)
            try:
                return super().maybe_save_checkpoint(self._epoch, 0 if local >= steps else local)
            finally:
                self.config = saved

    cli_mod.Trainer = PanelTrainer

    if cpu:
        cpu_device = torch.device("cpu")
        tr_mod.get_local_rank = lambda: cpu_device
        ck_mod.get_current_device = lambda: "cpu"

        class CpuStepTimer(tr_mod._StepTimer):
            def mark(self, name):
                if self.enabled:
                    self._marks[name] = time.perf_counter()

            def now(self):
                return time.perf_counter() if self.enabled else None

        tr_mod._StepTimer = CpuStepTimer
        real_autocast = torch.autocast

        def autocast(device_type, *args, **kwargs):
            return real_autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

        tr_mod.torch = _TorchProxy(torch, autocast=autocast)


class _TorchProxy:
    """speculators' trainer module sees `torch` with one attribute replaced."""

    def __init__(self, real, **overrides):
        self._real, self._overrides = real, overrides

    def __getattr__(self, name):
        return self._overrides.get(name) or getattr(self._real, name)
