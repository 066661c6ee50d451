"""A stop asked of real training (speculators' Trainer under the train stage)
is honoured even where speculators' interrupt is swallowed on its way."""

import os
import signal

from pipeline.run.stage_context import EXIT_INTERRUPTED

CFG = ("[data]\nmax_samples = 24\n[stages.extract]\nlayer_ids = [1, 2, 3]\n"
       "[stages.vocab]\ndraft_vocab_size = 200\n"
       "[stages.train]\nlr = 0.001\nepochs = 3\ntotal_seq_len = 512\n")


def test_a_sigint_landing_inside_a_logging_handler_still_stops_training(tmp_path, monkeypatch):
    """speculators' SIGINT handler raises its TrainingInterruptedError
    wherever the main thread is; inside a logging handler's emit (our metric
    events catch every Exception: metrics must never stop training) it was
    swallowed, every later SIGINT/SIGTERM ignored as a re-send, and training
    ran to its end: a cancel recorded as success (CI, the e2e run). Here the
    signal is sent from inside that emit, at step 2: training stops after the
    step it is in, saves, and the stage is cancelled, resumable."""
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
            sent.append(2)
            os.kill(os.getpid(), signal.SIGINT)   # handled here, inside emit's try
            assert self.ctx.stop_requested, "the handler ran after emit returned: no test"
    monkeypatch.setattr(in_process.MetricEvents, "_train", train_metric)

    code, rd, evs = run_body(tmp_path, "train", train.body, CFG)
    assert sent, "training never reached step 2"
    steps = [e["step"] for e in evs if e["type"] == "metric" and e.get("split") == "train"]
    # stopped at the step boundary after the signal, not at training's end
    assert code == EXIT_INTERRUPTED and max(steps) == 2, (code, steps)
    s = finished(evs)
    assert s["status"] == "cancelled" and s["summary"]["checkpoint_step"] == 3, s
    # the save it made on the way out is where a resume goes on
    assert s["summary"]["resume_checkpoint"], s


def test_a_later_signal_raises_again_where_the_first_was_lost(monkeypatch):
    """Where no step comes to raise the lost interrupt again (validation, a
    save), the cancel's next signal does: speculators' handler (the real one,
    under ours) would ignore it as one of torchrun's instant re-sends."""
    import pytest
    from speculators.train.graceful_shutdown import GracefulShutdownHandler, TrainingInterruptedError

    from pipeline.train import trainer
    told = []
    handler = trainer.recording_shutdown_handler(GracefulShutdownHandler, lambda: told.append(1))()
    clock = [100.0]
    monkeypatch.setattr(trainer.time, "monotonic", lambda: clock[0])
    handler.install()
    try:
        try:   # the first, lost on its way (as inside a logging handler's emit)
            os.kill(os.getpid(), signal.SIGINT)
        except TrainingInterruptedError:
            pass
        else:
            pytest.fail("speculators' handler did not raise")
        clock[0] += 0.2   # a re-send at once: ignored, as speculators does
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += handler.resend_s   # the cancel's SIGTERM, a grace later: raised again
        with pytest.raises(TrainingInterruptedError):
            os.kill(os.getpid(), signal.SIGTERM)
        assert len(told) == 3   # each recorded as a stop
    finally:
        handler.restore()
