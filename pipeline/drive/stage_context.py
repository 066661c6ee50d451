"""What every stage process shares: arguments, config, events, stop requests, errors.

A stage is `python -m pipeline.stages.NAME --run-dir R --config C`; it runs
the same under the runner or by hand. The entry modules in pipeline/stages/
are entry points only: what they share lives here, below them, so a library
that needs a stage's context (pipeline.train's worker and online servers)
never imports an entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import config as config_mod
from pipeline.config import Config
from pipeline.run import provenance
from pipeline.run.diskspace import DiskFull, explain
from pipeline.run.events import EventType, EventWriter
from pipeline.run.rundir import RunDir, Status, atomic_write_bytes
from pipeline.run.summaries import Summary, read
from pipeline.stage_error import StageError

__all__ = ["StageError", "Interrupted", "Skipped", "StageContext", "main_for", "run_stage",
           "torch_dtype"]

EXIT_INTERRUPTED = 130


class Interrupted(Exception):
    """A stop was requested (SIGINT/SIGTERM) and the stage stopped cleanly.
    `summary`: what the cancelled stage's summary adds (train: the checkpoint
    a resume continues from), which the panel and `status` show."""

    def __init__(self, summary: Summary | Mapping | None = None):
        super().__init__()
        self.summary = summary   # (a mapping: a user's own stage entry's, read as its stage's)


class Skipped(Exception):
    """Nothing to run the stage with here (no usable vLLM): it ends as
    `skipped`, not failed, and says why in one line."""


@dataclass
class StageContext:
    name: str
    cfg: Config
    run: RunDir
    events: EventWriter
    started: float = field(default_factory=time.time)
    stop_requested: bool = False

    @property
    def section(self):
        return self.cfg.stage(self.name)

    @property
    def devices(self) -> list[str]:
        """Torch devices for this stage: the GPUs it was given, else the CPU."""
        n = len(self.cfg.stage_devices(self.name))
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]

    @property
    def out(self) -> Path:
        return self.run.out_dir(self.name)

    def out_of(self, stage: str) -> Path:
        return self.run.out_dir(stage)

    def check_stop(self) -> None:
        """Call between units of work: raises Interrupted once a stop is asked."""
        if self.stop_requested:
            raise Interrupted()

    def progress(self, done: int, total: int | None, unit: str, **extra) -> None:
        """A progress event; the rate is the caller's (`rate`, None: not known
        yet) or done since the stage started (less `done_before`: a resume's)."""
        if "rate" in extra:
            rate = extra.pop("rate")
        else:
            elapsed = max(time.time() - self.started, 1e-9)
            rate = (done - extra.pop("done_before", 0)) / elapsed
        eta = (total - done) / rate if total and rate else None
        self.events.emit(EventType.PROGRESS, done=done, total=total, unit=unit, rate=rate,
                         eta_s=eta, **extra)

    def write_json(self, path: Path, obj) -> None:
        atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def torch_dtype(cfg: Config, on_gpu: bool):
    import torch
    return getattr(torch, cfg.dtype_name(on_gpu))


def parse_args(name: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m pipeline.stages.{name}")
    ap.add_argument("--run-dir", required=True, help="the run directory (created if missing)")
    ap.add_argument("--config", help="config file (default: the run's frozen config.toml)")
    return ap.parse_args(argv)


def load_context(name: str, argv=None) -> StageContext:
    args = parse_args(name, argv)
    run = RunDir(args.run_dir)
    if run.is_run():
        from pipeline.model import hub
        state = run.read_state()
        base = Path(state["base_dir"]) if state.get("base_dir") else None
        cfg_path = Path(args.config) if args.config else run.config_path
        frozen = cfg_path.resolve() == run.config_path
        # the run's own config: its hub target is the snapshot the run froze
        pin = state.get("target") if frozen else None
        with hub.loading_run(pin):
            cfg = config_mod.load(cfg_path, base_dir=base if frozen else None)
        hub.apply_pin(cfg, pin)
    else:
        # Run by hand on a fresh folder: make it a run directory.
        if not args.config:
            raise config_mod.ConfigError(f"{run.path} is not a run directory yet; pass --config.")
        cfg = config_mod.load(args.config)
        run.create(Path(args.config).read_text(), cfg.base_dir, cfg.run.shared)
    run.out_dir(name).mkdir(parents=True, exist_ok=True)
    if "EAGLE_PANEL_STAGE" not in os.environ:
        # Run by hand: give the stage its configured GPUs, as the runner would.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.stage_devices(name)))
    return StageContext(name, cfg, run, EventWriter(run.events_path(name)))


def run_stage(name: str, body, argv=None) -> int:
    """Run `body(ctx) -> Summary` (pipeline.run.summaries; a dict from a
    user's own stage entry is read as one) with the protocol around it: stop
    requests, a `stage_finished` event, errors as events with hints, exit
    codes."""
    try:
        ctx = load_context(name, argv)
    except config_mod.ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2

    def request_stop(signum, _frame):
        if ctx.stop_requested:  # a second signal: stop now
            raise KeyboardInterrupt
        ctx.stop_requested = True
        print(f"{name}: {signal.Signals(signum).name} received, stopping after the current unit",
              flush=True)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    provenance.start(ctx.run.stage_dir(name), name,
                     int(os.environ.get("EAGLE_PANEL_ATTEMPT") or 0), list(sys.argv))
    status, summary, code = _outcome(ctx, name, body)
    from pipeline.vllm.compat import fired_so_far
    provenance.finish(fired_so_far())
    try:
        ctx.events.emit(EventType.STAGE_FINISHED, status=status,
                        duration_s=round(time.time() - ctx.started, 3),
                        summary=summary.to_json())
    except DiskFull:
        pass   # the supervisor records the exit code; the panel reads it from state
    ctx.events.close()
    return code


def _outcome(ctx: StageContext, name: str, body) -> tuple[str, Summary, int]:
    """Run the body: its status, summary and exit code, whatever it raised."""
    try:
        fetch_target(ctx)
        made = body(ctx)
        return Status.SUCCEEDED, made if isinstance(made, Summary) else read(name, made), 0
    except Interrupted as e:
        said = e.summary if isinstance(e.summary, Summary) else read(name, e.summary)
        return (Status.CANCELLED, dataclasses.replace(
            said, stopped=said.stopped or "on request; resume continues from here"),
            EXIT_INTERRUPTED)
    except Skipped as e:
        if ctx.stop_requested:
            # The stop's signal reaches the stage's children too (one process
            # group): a vLLM probe it killed read as "no usable vLLM", and a
            # skip is an outcome resume keeps. Stopped, it runs again.
            print(f"{name}: stopped on request (it had found: {e})", flush=True)
            return Status.CANCELLED, Summary(stopped="on request; resume runs it again"), \
                EXIT_INTERRUPTED
        print(f"{name}: skipped: {e}", flush=True)
        ctx.events.warning(f"skipped: {e}")
        return Status.SKIPPED, Summary(skipped=str(e)), 0
    except KeyboardInterrupt:
        return Status.CANCELLED, Summary(), EXIT_INTERRUPTED
    except StageError as e:
        return Status.FAILED, _report(ctx, str(e), e.hint), 1
    except DiskFull as e:
        return Status.FAILED, _report(ctx, str(e), e.hint, disk_full=True), 1
    except Exception as e:  # noqa: BLE001 - a crash must still end with events
        full = explain(e, ctx.out)
        if full is not None:   # e.g. torch.save's "unexpected pos" on a full disk
            return Status.FAILED, _report(ctx, f"{full} ({type(e).__name__}: {str(e)[:200]})",
                                          full.hint, disk_full=True), 1
        traceback.print_exc()
        return Status.FAILED, _report(ctx, f"{type(e).__name__}: {e}",
                                      f"see {ctx.run.log_path(name)} for the traceback",
                                      quiet=True), 1


def fetch_target(ctx: StageContext) -> None:
    """[model] download = true: the first stage that runs downloads what the
    hub cache lacks of the run's snapshot, with `progress` events in bytes and
    in files; a no-op otherwise (nothing is ever downloaded without it)."""
    from pipeline.model import hub
    try:
        hub.fetch(ctx.cfg, ctx.progress, ctx.check_stop)
    except hub.RemoteError as e:
        raise StageError(f"downloading the target: {e}", e.fix) from None


def _report(ctx: StageContext, message: str, hint: str | None, quiet=False,
            disk_full=False) -> Summary:
    """An error to the log and the events; on a full disk either may fail."""
    with contextlib.suppress(OSError):
        if not quiet:
            print(f"{ctx.name}: error: {message}", file=sys.stderr, flush=True)
            if hint:
                print(f"{ctx.name}: hint: {hint}", file=sys.stderr, flush=True)
    with contextlib.suppress(DiskFull):
        ctx.events.error(message, hint=hint, **({"disk_full": True} if disk_full else {}))
    return Summary(error=message)


def main_for(name: str, body) -> None:
    sys.exit(run_stage(name, body))

