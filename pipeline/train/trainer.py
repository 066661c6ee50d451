"""speculators 0.9's Trainer as the train stage runs it: progress from the
real number of steps (the packed batches change every epoch), a stop
request honoured between steps, SIGINT saving a mid-epoch checkpoint
under the epoch's number with its step (speculators' own `interrupted`
folder is not resumable), so resume continues at the same global step,
and the plateau stop (pipeline.train.budget): after an epoch's checkpoint
and validation, the hooks may end training there (speculators has no early
stop; its epoch loop is left by an exception caught around it, so the
last checkpoint is that complete epoch's).

A stop is honoured at the next step boundary even where speculators'
interrupt is swallowed on its way (recording_shutdown_handler).

`install` puts it, the safe checkpointer and (on the CPU) the CPU patches
into speculators' module namespaces for this process — never by editing
site-packages.
"""

from __future__ import annotations

import os
import time

from pipeline.train.checkpoints import safe_checkpointer


class PlateauStop(Exception):
    """Leaves speculators' epoch loop after a validation the hooks stop at."""


def panel_trainer(base, hooks):
    """A subclass of speculators' Trainer `base` reporting to `hooks`: an
    object with `on_total_steps(n, per_epoch)`, `should_stop()` (checked
    before training and after every step) and
    `on_interrupted(epoch, local_step, global_step)` (and, for `install`,
    `request_stop()`: a stop signal came), and optionally
    `on_phase(name)` (validating, saving checkpoint: between steps),
    `on_epochs(n)` (the epochs planned: what "epoch 2/4" counts to),
    `on_validation(epoch, val_metrics) -> bool` (True: stop after this
    epoch) and `stopped_before(epoch) -> bool` (a stop already decided)."""
    class PanelTrainer(PanelHooks, base):
        _hooks = hooks
    return PanelTrainer


def capped(steps: int, max_steps: int) -> int:
    """`steps`, no more than speculators' max_steps when one is set."""
    return min(steps, max_steps) if max_steps else steps


class PanelHooks:
    """The overrides of speculators' Trainer that report to `_hooks`; mixed in
    before the Trainer (panel_trainer), so each `super()` call is speculators'
    own method."""
    _hooks = None

    def _hook(self, name: str, default=None):
        return getattr(self._hooks, name, default)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        announce_saves(self.checkpointer, self._hook("on_phase", lambda name: None))
        self._per_epoch = epoch_steps(self.train_loader, self.config.num_epochs)
        self._hooks.on_total_steps(capped(sum(self._per_epoch), self.config.max_steps),
                                   len(self.train_loader))
        self._hook("on_epochs", lambda n: None)(self.config.num_epochs)
        self._epoch = self.current_epoch
        self._epoch_origin = self.global_step - self._resume_local_step

    def train_epoch(self, epoch, **kwargs):
        self._epoch = epoch
        self._epoch_origin = self.global_step - (
            self._resume_local_step if epoch == self.current_epoch else 0)
        # The packed batches are drawn anew each epoch and their number
        # changes with them: the total is the steps before this epoch and
        # this epoch's and the later ones' as counted at the start (exact
        # up to EXACT_ROWS rows: then it never moves; past them later
        # epochs are counted as the first), so progress never ends at 118/117.
        sampler = self.train_loader.batch_sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        per_epoch = len(self.train_loader)
        later = self._per_epoch[epoch + 1:] if len(self._per_epoch) > epoch else []
        total = capped(self._epoch_origin + per_epoch + sum(later), self.config.max_steps)
        self._hooks.on_total_steps(total, per_epoch)
        check = stop_between_steps(self._hooks, kwargs.pop("step_callback", None))
        if takes_step_callback(super().train_epoch):
            return super().train_epoch(epoch, step_callback=check, **kwargs)
        # speculators 0.8: no step callback; the check runs as the next batch is drawn
        loader = self.train_loader
        self.train_loader = CheckedLoader(loader, check)
        try:
            return super().train_epoch(epoch, **kwargs)
        finally:
            self.train_loader = loader

    def run_training(self):
        if self._hooks.should_stop():
            self._hooks.on_interrupted(self._epoch, 0, self.global_step)
            return None
        stopped_before = self._hook("stopped_before")
        if stopped_before is not None and stopped_before(self.current_epoch):
            return None   # resumed after the plateau stop was decided
        try:
            return super().run_training()
        except PlateauStop:
            return None

    def val_epoch(self, epoch):
        self._hook("on_phase", lambda name: None)("validating")   # no step for a while: why
        return super().val_epoch(epoch)

    def maybe_update_best(self, epoch, val_metrics):
        super().maybe_update_best(epoch, val_metrics)
        # every rank sees the same all-reduced metrics: all stop together
        on_validation = self._hook("on_validation")
        if on_validation is not None and isinstance(epoch, int) \
                and on_validation(epoch, val_metrics):
            raise PlateauStop()

    def maybe_save_checkpoint(self, epoch, local_step=0):
        if epoch != "interrupted":
            return super().maybe_save_checkpoint(epoch, local_step)
        local = self.global_step - self._epoch_origin
        self._hooks.on_interrupted(self._epoch, local, self.global_step)
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


def takes_step_callback(train_epoch) -> bool:
    """Whether speculators' `Trainer.train_epoch` calls a `step_callback`
    after each step (0.9; 0.8.1 has none: read from what is installed)."""
    import inspect
    return "step_callback" in inspect.signature(train_epoch).parameters


class CheckedLoader:
    """The train loader, calling `check` as each batch after the first is
    drawn and once after the last: after every finished step, where
    speculators' `train_epoch` takes no step callback (0.8). Everything else
    (its length, its batch sampler) is the loader's own."""

    def __init__(self, loader, check):
        self._loader, self._check = loader, check

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def __iter__(self):
        drawn = False
        for batch in self._loader:
            if drawn:
                self._check()
            drawn = True
            yield batch
        if drawn:
            self._check()


def stop_between_steps(hooks, then=None):
    """A step callback (speculators calls it after each finished step) that
    raises speculators' TrainingInterruptedError once a stop was asked: the
    one its signal handler raised can be lost on the way (see
    recording_shutdown_handler), and then training would run to its end."""
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    def check():
        if then is not None:
            then()
        if hooks.should_stop():
            raise TrainingInterruptedError("stop requested")
    return check


def recording_shutdown_handler(base, on_signal):
    """speculators' GracefulShutdownHandler `base`, telling `on_signal` of a
    stop before it raises TrainingInterruptedError from wherever the main
    thread is. That can be inside a `logging.Handler.emit` (ours, which must
    never stop training, or any other), which catches every Exception and so
    swallows it; the handler then ignores each later SIGINT and SIGTERM as a
    re-send, and training ran to its end: a cancel recorded as a success (CI,
    under load). Recorded, stop_between_steps raises it again at the next
    step; and a signal coming `resend_s` or more after the first (a cancel's
    SIGTERM: torchrun's re-sends come at once) raises it again where there is
    no step to wait for (validation, a save): still installed, this handler's
    first exception never reached speculators' wrapper, which restores the
    handlers as soon as it catches it."""
    class RecordingShutdownHandler(base):
        resend_s = 1.0
        clock = staticmethod(time.monotonic)
        _first_at = 0.0

        def _handler(self, signum, frame):
            if os.getpid() == self._owner_pid:   # (a forked dataloader worker: not ours)
                on_signal()
                now = self.clock()
                if self._interrupted and now - self._first_at >= self.resend_s:
                    self._interrupted = False   # the first was lost: raise again
                if not self._interrupted:
                    self._first_at = now
            return super()._handler(signum, frame)
    RecordingShutdownHandler.speculators_handler = getattr(base, "speculators_handler", base)
    return RecordingShutdownHandler


def epoch_steps(loader, epochs: int) -> list[int]:
    """Each epoch's steps as speculators' sampler packs that epoch (its
    batches are seeded by the epoch number): counted once, so the total shown
    is stable. Past EXACT_ROWS rows, where a packing takes seconds, every
    epoch is counted as the first (the difference is a fraction of a percent)."""
    from pipeline.train.budget import EXACT_ROWS
    sampler = getattr(loader, "batch_sampler", None)
    first = len(loader)
    if not hasattr(sampler, "set_epoch") or not hasattr(sampler, "epoch") or \
            len(getattr(loader, "dataset", ())) > EXACT_ROWS:
        return [first] * epochs
    keep, counts = sampler.epoch, []
    try:
        for e in range(epochs):
            sampler.set_epoch(e)
            counts.append(len(loader))
    finally:
        sampler.set_epoch(keep)
    return counts


def announce_saves(checkpointer, on_phase) -> None:
    """Say "saving checkpoint" when speculators really saves one: which
    epochs save is its rule (checkpoint_freq, save_best), kept there rather
    than repeated here, so the phase is sent from the save itself."""
    save = checkpointer.save_checkpoint

    def announced(*args, **kwargs):
        on_phase("saving checkpoint")
        return save(*args, **kwargs)
    checkpointer.save_checkpoint = announced


def install(cpu: bool, hooks, collective_timeout_s: float = 1800.0) -> None:
    """Patch speculators' training modules for this process: the modules
    and names pipeline/train/speculators_contract.py declares, checked
    against the installed speculators first (a name it lacks is a
    StageError naming it, not an AttributeError mid-training)."""
    from pipeline.stage_error import StageError
    from pipeline.train import speculators_contract
    why = speculators_contract.refusal(*speculators_contract.installed(), cpu=cpu)
    if why:
        raise StageError(why, hint="install the speculators eagle-panel was checked on "
                                   "(scripts/install.sh: 0.9.0) in [runtime] python's environment")
    m = speculators_contract.modules()

    from pipeline.train.cpu_patches import patch_distributed
    patch_distributed(m.dist_mod, m.cli_mod, cpu, collective_timeout_s)

    m.tr_mod.SingleGPUCheckpointer = safe_checkpointer(m.ck_mod.SingleGPUCheckpointer)
    m.cli_mod.Trainer = panel_trainer(m.tr_mod.Trainer, hooks)
    gs = m.gs_mod.GracefulShutdownHandler
    real = getattr(gs, "speculators_handler", gs)
    m.gs_mod.GracefulShutdownHandler = recording_shutdown_handler(real, hooks.request_stop)
    if cpu:
        from pipeline.train.cpu_patches import patch_for_cpu
        patch_for_cpu(m.tr_mod, m.ck_mod)
