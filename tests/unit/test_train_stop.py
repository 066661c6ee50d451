"""A stop asked of real training (speculators' Trainer under the train stage)
is honoured even where speculators' interrupt is swallowed on its way."""

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from speculators.train.graceful_shutdown import GracefulShutdownHandler, TrainingInterruptedError

from pipeline.drive.stage_context import EXIT_INTERRUPTED, Interrupted, StageError
from tests.configs import render

CFG = render({"data": {"max_samples": 24},
              "stages": {"extract": {"layer_ids": [1, 2, 3]}, "vocab": {"draft_vocab_size": 200},
                         "train": {"lr": 0.001, "epochs": 3, "total_seq_len": 512}}})


def test_a_sigint_landing_inside_a_logging_handler_still_stops_training(tmp_path, monkeypatch):
    """speculators' SIGINT handler raises its TrainingInterruptedError
    wherever the main thread is; inside a logging handler's emit (our metric
    events catch every Exception: metrics must never stop training) it was
    swallowed, every later SIGINT/SIGTERM ignored as a re-send, and training
    ran to its end: a cancel recorded as success (CI, the e2e run). Here the
    signal is sent from inside that emit, at step 2: training stops after the
    step it is in, saves it, and the stage is cancelled, resumable there."""
    from pipeline.stages import extract, prepare, train, vocab
    from pipeline.train import in_process
    from tests.helpers import finished, run_body
    for name, body in (("prepare", prepare.body), ("extract", extract.body),
                       ("vocab", vocab.body)):
        code, rd, _ = run_body(tmp_path, name, body, CFG)
        assert code == 0, name

    real_train = in_process.MetricEvents._train
    sent = []

    def train_metric(self, msg):
        real_train(self, msg)
        if msg.get("global_step") == 2 and not sent:
            sent.append("sent")
            try:
                os.kill(os.getpid(), signal.SIGINT)   # handled here, inside emit's try
            except TrainingInterruptedError:
                sent.append("raised inside emit")     # ...which swallows it
                raise
    monkeypatch.setattr(in_process.MetricEvents, "_train", train_metric)

    code, rd, evs = run_body(tmp_path, "train", train.body, CFG)
    assert sent == ["sent", "raised inside emit"], "not the case under test"
    steps = [e["step"] for e in evs if e["type"] == "metric" and e.get("split") == "train"]
    # stopped at the step boundary after the signal, not at training's end
    assert code == EXIT_INTERRUPTED and max(steps) == 2, (code, steps)
    s = finished(evs)
    assert s["status"] == "cancelled" and s["summary"]["checkpoint_step"] == 3, s
    # the save it made on the way out is where a resume goes on: after step 2
    saved = json.loads((Path(s["summary"]["resume_checkpoint"]) / "training_state.json").read_text())
    assert saved["global_step"] == 3, saved


def test_a_later_signal_raises_again_where_the_first_was_lost():
    """Where no step comes to raise the lost interrupt again (validation, a
    save), the cancel's next signal does: speculators' handler (the real one,
    under ours) would ignore it as one of torchrun's instant re-sends."""
    from pipeline.train import trainer
    told = []
    real = getattr(GracefulShutdownHandler, "speculators_handler", GracefulShutdownHandler)
    handler = trainer.recording_shutdown_handler(real, lambda: told.append(1))()
    clock = [100.0]
    handler.clock = lambda: clock[0]
    handler.install()
    try:
        with pytest.raises(TrainingInterruptedError):   # the first (then lost, as in emit)
            os.kill(os.getpid(), signal.SIGINT)
        clock[0] += 0.2   # a re-send at once: ignored, as speculators does
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += handler.resend_s   # the cancel's SIGTERM, a grace later: raised again
        with pytest.raises(TrainingInterruptedError):
            os.kill(os.getpid(), signal.SIGTERM)
        assert len(told) == 3   # each recorded as a stop
    finally:
        handler.restore()


def test_an_online_give_up_fails_the_stage_with_the_servers_error(monkeypatch):
    """Online, the watchdog that gives up on its vLLM servers asks training
    to stop (it saves at the next step): the stage fails quoting the server's
    error, where a user's cancel stays a cancel. (The trainer is a stand-in
    raising what run_in_process raises after such a stop.)"""
    from pipeline.run.summaries import TrainSummary
    from pipeline.stages import train as train_stage

    class Servers:   # OnlineServers after _give_up
        def __init__(self, fatal):
            self.fatal, self.stopped = fatal, False

        def stop(self):
            self.stopped = True

    def stopped_after_a_save(ctx, argv, device_type, servers):
        raise Interrupted(TrainSummary(resume_checkpoint="checkpoints/0"))
    monkeypatch.setattr(train_stage, "run_in_process", stopped_after_a_save)
    ctx = SimpleNamespace(devices=["cpu"], section=SimpleNamespace(ranks_per_node=0),
                          cfg=SimpleNamespace(cluster=SimpleNamespace(nodes=1)))
    gave_up = Servers(StageError("vllm-0 died 3 times: CUDA out of memory", hint="lower it"))
    with pytest.raises(StageError, match=r"\(a checkpoint was saved\): vllm-0 died 3 times"):
        train_stage.run_trainer(ctx, train_stage.Training([], None, "cpu", servers=gave_up))
    assert gave_up.stopped
    cancelled = Servers(None)
    with pytest.raises(Interrupted):
        train_stage.run_trainer(ctx, train_stage.Training([], None, "cpu", servers=cancelled))
    assert cancelled.stopped
