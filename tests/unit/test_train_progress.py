"""The train stage's progress events (pipeline.train.in_process.MetricEvents):
what the panel's Rate / ETA and `status` show while speculators trains."""

from __future__ import annotations


def test_train_progress_rate_counts_steps_since_this_attempts_first(monkeypatch):
    """A resumed train stage starts at step 300 after a minute of loading: its
    rate and ETA come from the steps it has taken since its first, not from
    the stage's start (which read as an ETA of a quarter of an hour)."""
    from pipeline.drive.stage_context import StageContext
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


def test_saving_checkpoint_is_said_only_when_speculators_saves(tmp_path):
    """The phase comes from the save itself, so an epoch speculators' own rule
    does not save (checkpoint_freq 3: epochs 2, 5, ...) names no save."""
    from speculators.train import trainer as tr_mod

    from pipeline.train.trainer import announce_saves, panel_trainer

    phases, saved = [], []

    class Hooks:
        def on_phase(self, name):
            phases.append(name)

    class Checkpointer:
        path = tmp_path

        def save_checkpoint(self, model, optimizers, epoch):
            saved.append(epoch)

    cls = panel_trainer(tr_mod.Trainer, Hooks())
    t = cls.__new__(cls)   # the real maybe_save_checkpoint; nothing else of a Trainer
    t.config, t.checkpointer, t.schedulers = tr_mod.TrainerConfig(
        lr=1e-3, num_epochs=6, save_path=str(tmp_path), checkpoint_freq=3), Checkpointer(), None
    announce_saves(t.checkpointer, Hooks().on_phase)   # as the trainer's __init__ does
    t.model = t.optimizers = None
    t._save_training_state = lambda epoch, local_step: None
    t.is_distributed = False
    for epoch in range(3):
        phases.clear()
        t.maybe_save_checkpoint(epoch)
        assert phases == (["saving checkpoint"] if epoch in saved else []), (epoch, saved)
    assert saved == [0, 2]


def test_the_step_total_is_each_epochs_own_packing_counted_once():
    """speculators packs each epoch's batches anew (seeded by the epoch): the
    total is counted once from every epoch's own packing, so it equals the
    steps training will take and does not move from epoch to epoch."""
    import random

    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader

    from pipeline.train.trainer import epoch_steps
    rng = random.Random(0)
    lengths = [rng.randint(20, 500) for _ in range(300)]
    sampler = MultipackDistributedBatchSamplerV2(1024, lengths, 1, 0, seed=0)
    loader = DataLoader(list(range(len(lengths))), batch_sampler=sampler)
    sampler.set_epoch(0)
    counts = epoch_steps(loader, 6)
    assert sampler.epoch == 0   # left at the epoch it was at
    taken = []
    for e in range(6):
        sampler.set_epoch(e)
        taken.append(sum(1 for _ in loader))
    assert counts == taken
    assert len(set(counts)) > 1, counts   # it does change by epoch: a count from epoch 0 alone is off
