"""The train stage's progress events (pipeline.train.in_process.MetricEvents):
what the panel's Rate / ETA and `status` show while speculators trains."""

from __future__ import annotations


def test_train_progress_rate_counts_steps_since_this_attempts_first(monkeypatch):
    """A resumed train stage starts at step 300 after a minute of loading: its
    rate and ETA come from the steps it has taken since its first, not from
    the stage's start (which read as an ETA of a quarter of an hour)."""
    from pipeline.run.stage_context import StageContext
    from pipeline.train import in_process

    emitted = []

    class Events:
        def emit(self, kind, **fields):
            emitted.append(fields)

    ctx = StageContext.__new__(StageContext)
    ctx.events, ctx.started = Events(), 0.0
    clock = iter([1000.0, 1010.0, 1020.0])
    monkeypatch.setattr(in_process.time, "monotonic", lambda: next(clock))
    m = in_process.MetricEvents(ctx)
    m.total_steps, m.steps_per_epoch = 600, 200
    for step in (300, 310, 320):
        m._train({"train": {"loss": 1.0}, "global_step": step, "epoch": 1})
    progress = [e for e in emitted if "done" in e]
    assert [p["done"] for p in progress] == [301, 311, 321]
    assert progress[0]["rate"] is None and progress[0]["eta_s"] is None   # one step: no rate yet
    assert progress[1]["rate"] == 1.0 and progress[2]["rate"] == 1.0     # 10 steps in 10 s
    assert progress[2]["eta_s"] == 600 - 321

    m.phase("validating")   # the epoch's end: the count stands, the phase is named
    last = [e for e in emitted if "done" in e][-1]
    assert last["done"] == 321 and last["phase"] == "validating" and last["rate"] is None
    from pipeline.fmt import progress_text
    assert progress_text(last) == "321/600 steps  validating"
