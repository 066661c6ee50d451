"""Speculators' trainer in this process, its metrics as the stage's events.

The train stage runs it itself on one device; under torchrun every rank does
(pipeline.train.worker). Either way the process gets the same hooks: the
plateau stop, stop requests, total steps for progress, and with an MLA draft
its layer registered in speculators and each checkpoint exported for vLLM.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pipeline import tracking
from pipeline.drive.stage_context import Interrupted, StageContext, StageError
from pipeline.run.events import EventType
from pipeline.run.summaries import TrainSummary
from pipeline.train.budget import PlateauWatch
from pipeline.train.mla_draft import draft_config_path
from pipeline.train.val_metrics import estimate


def plateau_watch(ctx: StageContext) -> PlateauWatch:
    """Each epoch's estimate, on disk; the plateau stop only for epochs the
    rule chose (an explicit `epochs` is trained in full: patience 0)."""
    sec = ctx.section
    return PlateauWatch(ctx.out / "plateau.json", 0 if sec.epochs else sec.patience,
                        sec.min_delta, writer=int(os.environ.get("RANK", "0")) == 0)


def per_step_quiet(record: logging.LogRecord) -> bool:
    """A console filter: speculators' per-step metric dict is not printed.
    Its figures are events (the chart; the Logs tab's step line), and
    printed they drowned the stage's own lines: 16 wrapped lines a step,
    41,885 lines for the demo's 2,592 steps. Validation's dict (once an
    epoch) and every other record still print."""
    return not (record.name == "speculators.metrics" and isinstance(record.msg, dict)
                and "train" in record.msg)


class MetricEvents(logging.Handler):
    """speculators.metrics records -> `metric` and `progress` events."""

    def __init__(self, ctx: StageContext, servers=None):
        super().__init__()
        self.ctx = ctx
        self.servers = servers   # online: the trainer's side of the producer/consumer view
        self.waits: list[float] = []   # share of each logged step spent waiting for data
        self.total_steps = None
        self.steps_per_epoch = None
        self.epochs = None          # planned (a plateau may stop before)
        self.first_step, self.first_step_at = None, 0.0
        self.last_progress: dict | None = None
        self.last_val: dict = {}
        self.first_loss = self.last_loss = None

    def emit(self, record):
        msg = record.msg
        if not isinstance(msg, dict):
            return
        try:
            if "train" in msg:
                self._train(msg)
            elif "val" in msg:
                self._val(msg, getattr(record, "step", None))
        except Exception:  # noqa: BLE001 - metrics must never stop training
            self.handleError(record)

    def _train(self, msg):
        step = int(msg.get("global_step", 0))
        values = {k: v for k, v in msg["train"].items() if isinstance(v, (int, float))}
        lr = msg.get("lr")
        if isinstance(lr, dict):
            values.update({f"lr_{k}": v for k, v in lr.items()})
        elif lr is not None:
            values["lr"] = lr
        prof = msg.get("profile") or {}
        for k in ("tokens_per_s", "step_ms"):
            if k in prof:
                values[k] = prof[k]
        if prof.get("step_ms"):
            # waiting for the dataloader (vLLM, online): speculators' queue time
            values["data_wait_share"] = prof.get("queue_ms", 0.0) / prof["step_ms"]
            self.waits.append(values["data_wait_share"])
            if self.servers is not None:
                recent = self.waits[-20:]
                self.servers.trainer.update(wait=round(sum(recent) / len(recent), 3),
                                            tokens_per_s=round(prof.get("tokens_per_s", 0), 1))
        self.ctx.events.emit(EventType.METRIC, step=step, epoch=msg.get("epoch"), split="train",
                             values=values)
        if "loss" in values:
            self.first_loss = values["loss"] if self.first_loss is None else self.first_loss
            self.last_loss = values["loss"]
        now = time.monotonic()
        if self.first_step is None:
            self.first_step, self.first_step_at = step, now
        # the rate over the steps this attempt has taken since its first: the model
        # load, the dataloader's start and a resume's skipped steps are not steps
        taken = step - self.first_step
        rate = taken / (now - self.first_step_at) if taken and now > self.first_step_at \
            else None
        total = max(self.total_steps, step + 1) if self.total_steps else None
        self.last_progress = {"done": step + 1, "total": total, "epoch": msg.get("epoch")}
        self.ctx.progress(step + 1, total, "steps", rate=rate, epoch=msg.get("epoch"),
                          epochs=self.epochs, steps_per_epoch=self.steps_per_epoch)

    def phase(self, name: str) -> None:
        """A progress event naming what training does between steps (the count
        stands still; the next step's event has no phase)."""
        last = self.last_progress
        if last is not None:
            self.ctx.progress(last["done"], last["total"], "steps", rate=None, phase=name,
                              epoch=last["epoch"], epochs=self.epochs,
                              steps_per_epoch=self.steps_per_epoch)

    def _val(self, msg, step):
        values = {(k[:-6] if k.endswith("_epoch") else k): v for k, v in msg["val"].items()
                  if isinstance(v, (int, float))}
        est = estimate(self.ctx.cfg, values)   # the algorithm's own (the panel's curve)
        if est is not None:
            values["acceptance_estimate"] = est
        self.last_val = values
        self.ctx.events.emit(EventType.METRIC, step=step, epoch=msg.get("epoch"), split="val",
                             values=values)


class Hooks:
    """What pipeline.train.trainer asks the stage while speculators trains:
    whether to stop (a plateau, a stop request), and what to record."""

    def __init__(self, ctx: StageContext, metrics: MetricEvents,
                 plateau: PlateauWatch | None = None):
        self.ctx, self.metrics, self.plateau = ctx, metrics, plateau
        self.interrupted_at = None
        self.signalled = False

    def on_validation(self, epoch: int, val: dict | None) -> bool:
        """After epoch `epoch`'s validation: stop here (a plateau)?"""
        if self.plateau is None or not val:
            return False
        clean = {(k[:-6] if k.endswith("_epoch") else k): v for k, v in val.items()}
        reason = self.plateau.update(epoch, estimate(self.ctx.cfg, clean))
        if reason:
            print(f"train: {reason}: stopping (checkpoint {epoch} is complete)", flush=True)
        return reason is not None

    def stopped_before(self, epoch: int) -> bool:
        if self.plateau is not None and self.plateau.stopped_before(epoch):
            print(f"train: {self.plateau.stopped['reason']} (decided before this resume)",
                  flush=True)
            return True
        return False

    def on_phase(self, name: str) -> None:
        self.metrics.phase(name)

    def on_total_steps(self, n: int, per_epoch: int) -> None:
        self.metrics.total_steps, self.metrics.steps_per_epoch = n, per_epoch

    def on_epochs(self, n: int) -> None:
        self.metrics.epochs = n

    def should_stop(self) -> bool:
        return self.ctx.stop_requested or self.signalled

    def request_stop(self) -> None:
        """speculators' signal handler took a SIGINT/SIGTERM (it replaces the
        stage's while training): recorded for the step boundary's check. Not
        in ctx.stop_requested: the stage's handler, back for the interrupt's
        save, takes a signal after a recorded stop as "stop now" and the
        cancel's SIGTERM would cut the save short."""
        self.signalled = True

    def on_interrupted(self, epoch, local_step, global_step) -> None:
        self.interrupted_at = {"epoch": epoch, "local_step": local_step, "global_step": global_step}


def run_in_process(ctx: StageContext, argv: list[str], device_type: str,
                   servers=None) -> MetricEvents:
    """Train with speculators' own CLI entry in this process, patched to
    report through `ctx` (metrics, progress, stop requests); raises
    Interrupted after a stop that saved a checkpoint. `servers`: online
    mode's vLLM servers, which feed the dataloader."""
    from speculators.train import cli as cli_mod
    from speculators.train.config import TrainConfig

    from pipeline.train import trainer as panel_trainer

    metrics = MetricEvents(ctx, servers)
    if servers is not None:
        from speculators.train import dataloader as dl_mod

        from pipeline.train.online import keyed_dataset_class
        dl_mod.ArrowDataset = keyed_dataset_class()   # our key, our servers
    hooks = Hooks(ctx, metrics, plateau_watch(ctx))
    panel_trainer.install(cpu=device_type == "cpu", hooks=hooks,
                          collective_timeout_s=ctx.cfg.cluster.collective_timeout_s)
    if draft_config_path(argv) is not None:
        # the MLA draft: its layer in speculators' registry, for this
        # process (in-process training, or this torchrun rank), and each
        # checkpoint's vLLM export written as soon as the checkpoint is
        from pipeline.train.mla_draft import argv_value, exporting_trainer
        from pipeline.train.mla_layer import register
        register()
        cli_mod.Trainer = exporting_trainer(cli_mod.Trainer, Path(argv_value(argv, "--save-path")),
                                            ctx.out / "vllm")
    real_setup = cli_mod.setup_metric_logger

    def setup_metric_logger(*a, **kw):
        # speculators' setup replaces the metric logger's handlers: add ours after it,
        # and keep its per-step dicts off the console (the stage log) it set up before
        real_setup(*a, **kw)
        logging.getLogger("speculators.metrics").addHandler(metrics)
        for handler in logging.getLogger().handlers:   # first: its next filter makes the
            handler.filters.insert(0, per_step_quiet)    # dict a string (FormatDictFilter)

    cli_mod.setup_metric_logger = setup_metric_logger
    try:
        cfg = TrainConfig.resolve(argv)
    except SystemExit:
        raise StageError("speculators rejected the training flags (see the log above)",
                         hint="check [stages.train] in config.toml") from None
    try:
        cli_mod.main(cfg)
    finally:   # the trackers' last figures written (event files, the MLflow run ended)
        tracking.close()
    if hooks.interrupted_at is not None:
        raise Interrupted(_interrupted_summary(hooks.interrupted_at, argv))
    return metrics


def _interrupted_summary(at: dict, argv: list[str]) -> TrainSummary:
    """Where a stopped training can be resumed from, said in the log (where
    speculators' own line names an `interrupted` folder it does not keep)
    and in the stage's summary."""
    from pipeline.train.checkpoints import complete_checkpoint
    from pipeline.train.mla_draft import argv_value
    save = Path(argv_value(argv, "--save-path") or "")
    done = [d for d in save.iterdir() if d.name.isdigit() and complete_checkpoint(d)] \
        if save.is_dir() else []
    ckpt = max(done, key=lambda d: int(d.name)) if done else None   # the one resume takes
    where = f"checkpoint {ckpt}" if ckpt else "no checkpoint yet (resume starts the epoch over)"
    print(f"train: stopped at epoch {at['epoch'] + 1} step {at['global_step']}; {where}; "
          "`eagle-panel resume` (r in the panel) continues from it", flush=True)
    # not `checkpoint`: that names a trained draft (status' outcome, evaluate)
    return TrainSummary(resume_checkpoint=str(ckpt) if ckpt else None,
                        checkpoint_step=at["global_step"],
                        resume="eagle-panel resume (r in the panel)")
