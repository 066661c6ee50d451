"""The read model of a long run: bounded metric series that keep their spikes,
and the checkpoint a reader starts from instead of replaying every event
(pipeline.run.series, stage_fold, read_checkpoint).

The parts in other tiers: tests/integration/test_read_model.py."""

from __future__ import annotations

import json
import os
import random

import pytest

from pipeline.run import read_checkpoint
from pipeline.run.events import EventWriter
from pipeline.run.rundir import RunDir
from pipeline.run.series import BUCKETS, Series
from pipeline.run.snapshot import RunReader, read_run
from tests.configs import write
from tests.helpers import wait_for

# -- the series ------------------------------------------------------------------------

def test_a_series_stays_bounded_and_keeps_every_spike():
    s = Series()
    spikes = {1_234: 9.0, 250_001: 7.5, 999_998: -3.0}
    for i in range(1_000_000):
        s.add(i, spikes.get(i, 1.0 / (i + 1)))
    xs, ys = list(s.x), list(s.y)
    assert len(s) <= 2 * BUCKETS and s.added == 1_000_000
    assert xs == sorted(xs) and xs[0] == 0 and xs[-1] >= 999_998   # the whole span
    for step, value in spikes.items():   # each one, at its own step
        assert (step, value) in zip(xs, ys, strict=True)
    assert (s.last_x, s.last_y) == (999_999, 1.0 / 1_000_000)       # the latest, whatever its bucket


def test_a_short_series_is_every_point_once():
    s = Series()
    for i in range(100):
        s.add(i, float(i % 7))
    assert list(s.x) == list(range(100)) and list(s.y) == [float(i % 7) for i in range(100)]


@pytest.mark.parametrize("seed", [0, 1])
def test_each_bucket_holds_its_points_lowest_and_highest_even_when_steps_go_back(seed):
    """Against the definition: buckets of `per` points in arrival order, each
    its lowest and highest point (a resumed attempt's steps restart lower)."""
    rng = random.Random(seed)
    points, step = [], 0
    for _ in range(3 * BUCKETS + 5):
        step = step - rng.randrange(50) if rng.random() < 0.01 else step + 1
        points.append((float(step), rng.random()))
    s = Series()
    for x, y in points:
        s.add(x, y)
    b = list(s._b)
    got = [{(b[i], b[i + 1]), (b[i + 2], b[i + 3])} for i in range(0, len(b), 4)]
    chunks = [points[i:i + s.per] for i in range(0, len(points), s.per)]
    want = [{min(c, key=lambda p: p[1]), max(c, key=lambda p: p[1])} for c in chunks]
    assert s.per == 4 and got == want   # (halved twice)
    assert all(b[i] <= b[i + 2] for i in range(0, len(b), 4))   # each bucket in step order


def test_a_series_round_trips_exactly_and_copies_are_independent():
    s = Series()
    rng = random.Random(3)
    for i in range(30_000):
        s.add(i, rng.random())
    back = Series.from_json(json.loads(json.dumps(s.to_json())))
    twin = s.copy()
    for t in (back, twin):
        assert (list(t.x), list(t.y), t.added, t.last_y) == (list(s.x), list(s.y), s.added, s.last_y)
    for i in range(30_000, 40_000):   # continuing from the copy or the json: the same series
        v = rng.random()
        s.add(i, v)
        back.add(i, v)
    assert (list(back.x), list(back.y)) == (list(s.x), list(s.y)) != (list(twin.x), list(twin.y))
    with pytest.raises(ValueError):
        Series.from_json({**s.to_json(), "per": 3})


def test_step_less_metrics_count_on_past_the_buckets(tmp_path):
    """A metric event without a step takes the next one, counted over every
    point offered, not over the points the buckets kept."""
    reader = RunReader(RunDir(tmp_path / "run"))
    for _ in range(3 * 2 * BUCKETS):
        reader._apply("train", {"type": "metric", "split": "train", "values": {"loss": 1.0}})
    s = reader.snapshot().metrics[("train", "loss")]
    xs = list(s.x)
    assert len(xs) <= 2 * BUCKETS and xs[0] == 0 and s.last_x == 3 * 2 * BUCKETS - 1
    assert xs == sorted(set(xs))


# -- the checkpoint ----------------------------------------------------------------------

def _random_events(w: EventWriter, rng: random.Random, n: int, attempt: list) -> None:
    """n events of every kind a reader folds, as stages write them."""
    for _ in range(n):
        k = rng.random()
        if k < 0.02:
            attempt[0] += 1
            w.emit("stage_started", stage="train", attempt=attempt[0], argv=[], devices=[0])
        elif k < 0.6:
            step = None if rng.random() < 0.05 else rng.randrange(100_000)
            w.emit("metric", step=step, split=rng.choice(["train", "val"]),
                   values={"loss": rng.random() * 3, "full_acc_0": rng.random(), "lr": 1e-4})
        elif k < 0.7:
            w.emit("progress", done=rng.randrange(1000), total=1000, unit="steps")
        elif k < 0.75:
            w.warning(f"w{rng.randrange(100)}")
        elif k < 0.77:
            w.error("boom", hint="h")
        elif k < 0.85:
            w.emit("server", server=rng.randrange(3), phase=rng.choice(["starting", "ready",
                                                                         "stopped"]),
                   elapsed_s=rng.random() * 60, phase_s=1.0, last_line="x")
        elif k < 0.88:
            w.emit("kv_cache", server=rng.randrange(3), num_blocks=rng.randrange(100),
                   block_size=16, bytes_per_block=1, total_bytes=1, tokens_capacity=1,
                   max_concurrency=1.0, max_model_len=1, groups=[], source="log")
        elif k < 0.9:
            w.emit("kv_usage", usage_perc=rng.random(), running=1, waiting=0)
        elif k < 0.92:
            w.emit("online", produced_tokens_per_s=1.0, trainer_wait_share=0.1,
                   buffer_peak_bytes=1, verdict="ok")
        elif k < 0.94:
            w.emit("backend", backend=rng.choice(["vllm", "hf"]), why="auto")
        elif k < 0.97:
            w.emit("stage_finished", status=rng.choice(["succeeded", "failed"]),
                   duration_s=rng.random(), summary={"acceptance_length": rng.random() + 1})
        else:
            w.emit("artifact", path="p", kind="k", bytes=1)


def _run(tmp_path) -> RunDir:
    cfg = write(tmp_path / "config.toml", {"run": {"name": "r", "runs_dir": "runs"}})
    rd = RunDir(tmp_path / "runs" / "r")
    rd.create(cfg.read_text(), tmp_path)
    return rd


def picture(snap) -> dict:
    """Everything a snapshot shows, as plain values."""
    stages = {}
    for name, st in snap.stages.items():
        stages[name] = (st.attempts, st.progress, st.summary, st.warnings, st.last_error,
                        st.servers, dict(st.kv_reports), st.kv_usage, st.online, st.backend,
                        st.target_loads, st.loading_s, st.finished)
    metrics = {k: (list(s.x), list(s.y), s.added, s.last_x, s.last_y)
               for k, s in snap.metrics.items()}
    return {"stages": stages, "metrics": metrics, "error": snap.state_error}


def replayed(rd: RunDir) -> dict:
    """The run read from its events alone (no checkpoint)."""
    path = read_checkpoint.path_of(rd, "train")
    kept = path.read_bytes() if path.exists() else None
    path.unlink(missing_ok=True)
    try:
        return picture(read_run(rd))
    finally:
        if kept is not None:
            path.write_bytes(kept)


def _reads(rd: RunDir) -> tuple[dict, int]:
    """The run as a reader shows it, and how many events that reader read."""
    reader, seen = RunReader(rd), []
    reader.on_event = lambda stage, ev: seen.append(ev)
    reader.read_all()
    return picture(reader.snapshot()), len(seen)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_reader_from_the_checkpoint_shows_what_a_full_replay_shows(tmp_path, seed):
    rd, rng, attempt = _run(tmp_path), random.Random(seed), [0]
    with EventWriter(rd.events_path("train")) as w:
        _random_events(w, rng, 20_000, attempt)
        read_checkpoint.refresh(rd, "train")
        _random_events(w, rng, 300, attempt)   # after the checkpoint: read from the events
    shown, read = _reads(rd)
    assert shown == replayed(rd) and read == 300
    assert shown["metrics"][("train", "loss")][2] > 2 * BUCKETS   # (the buckets did merge)


def _damage_cases(rd: RunDir, tmp_path):
    """(what, how) a checkpoint goes wrong; each reads as a full replay."""
    ck, events = read_checkpoint.path_of(rd, "train"), rd.events_path("train")

    def edit(**changes):
        body = json.loads(ck.read_text())
        body.update(changes)
        ck.write_text(json.dumps(body))

    def edit_fold(key, value):
        body = json.loads(ck.read_text())
        body["fold"][key] = value
        ck.write_text(json.dumps(body))

    def rewritten():   # the same length, other bytes: a file replaced in place
        data = bytearray(events.read_bytes())
        i = data.index(b'"loss":') + len(b'"loss":')
        data[i] = ord("7") if data[i] != ord("7") else ord("6")
        events.write_bytes(bytes(data))

    def outside():
        other = tmp_path / "elsewhere.json"
        other.write_bytes(ck.read_bytes())
        ck.unlink()
        ck.symlink_to(other)

    def folder():
        ck.unlink()
        ck.mkdir()

    return [
        ("deleted", lambda: ck.unlink()),
        ("truncated", lambda: ck.write_bytes(ck.read_bytes()[: ck.stat().st_size // 2])),
        ("not json", lambda: ck.write_bytes(b"\x00\xff garbage")),
        ("another format", lambda: edit(format=99)),
        ("ahead of the events", lambda: edit(offset=events.stat().st_size + 10)),
        ("not at a line end", lambda: edit(offset=json.loads(ck.read_text())["offset"] - 5)),
        ("events rewritten, same length", rewritten),
        ("events replaced, shorter", lambda: events.write_bytes(
            events.read_bytes()[: events.stat().st_size // 3].rsplit(b"\n", 1)[0] + b"\n")),
        ("a link out of the run", outside),
        ("a folder", folder),
        ("a damaged event in it", lambda: edit_fold("progress", {"t": 1.0, "type": "progress",
                                                                 "done": "lots", "total": 1,
                                                                 "unit": "x"})),
        ("a damaged series in it", lambda: edit_fold("metrics", [["train", "loss", {"b": "!"}]])),
    ]


@pytest.mark.parametrize("case", range(12))
def test_a_damaged_stale_or_missing_checkpoint_reads_as_a_full_replay(tmp_path, case):
    rd, rng, attempt = _run(tmp_path), random.Random(case), [0]
    with EventWriter(rd.events_path("train")) as w:
        _random_events(w, rng, 3_000, attempt)
        read_checkpoint.refresh(rd, "train")
        _random_events(w, rng, 100, attempt)
    what, damage = _damage_cases(rd, tmp_path)[case]
    damage()
    assert read_checkpoint.load(rd, "train") is None, what
    shown, read = _reads(rd)
    want = replayed(rd) if what not in ("a link out of the run", "a folder") else None
    if want is not None:
        assert shown == want, what
    else:   # (replayed() would remove the damage itself: compare with the events read)
        assert read > 3_000 and shown["stages"]["train"][0], what
    assert read > 100, f"{what}: the reader must not have trusted it"


def test_a_killed_keeper_leaves_the_last_checkpoint_not_one_ahead(tmp_path):
    """A writer killed part way leaves its temp file and the previous
    checkpoint; a reader uses that one and reads the rest from the events."""
    rd, rng, attempt = _run(tmp_path), random.Random(7), [0]
    with EventWriter(rd.events_path("train")) as w:
        _random_events(w, rng, 2_000, attempt)
        read_checkpoint.refresh(rd, "train")
        _random_events(w, rng, 50, attempt)
    ck = read_checkpoint.path_of(rd, "train")
    (ck.parent / f".{ck.name}.x1y2z3.tmp").write_bytes(ck.read_bytes()[:100])   # cut short
    shown, read = _reads(rd)
    assert shown == replayed(rd) and read == 50


def test_the_keeper_saves_while_the_stage_writes_and_once_more_at_its_end(tmp_path):
    rd, rng, attempt = _run(tmp_path), random.Random(11), [0]
    w = EventWriter(rd.events_path("train"))
    keeper = read_checkpoint.Keeper(rd, "train", every_s=0.05, every_bytes=1).start()
    _random_events(w, rng, 1_000, attempt)
    wait_for(lambda: keeper.saves >= 1, what="a save while the stage writes")
    _random_events(w, rng, 500, attempt)
    w.close()
    keeper.stop()
    body = json.loads(read_checkpoint.path_of(rd, "train").read_text())
    assert body["offset"] == rd.events_path("train").stat().st_size and keeper.error is None
    shown, read = _reads(rd)
    assert shown == replayed(rd) and read == 0


def test_a_keeper_that_cannot_save_never_fails_its_supervisor(tmp_path):
    rd, rng, attempt = _run(tmp_path), random.Random(5), [0]
    with EventWriter(rd.events_path("train")) as w:
        _random_events(w, rng, 200, attempt)
    ck = read_checkpoint.path_of(rd, "train")
    ck.mkdir()   # in the way of its rename
    (ck / "x").write_text("x")
    keeper = read_checkpoint.Keeper(rd, "train").start()
    keeper.stop()   # no exception
    assert isinstance(keeper.error, OSError) and keeper.saves == 0
    assert os.path.isdir(ck)
    shown, read = _reads(rd)
    assert read == 200 and shown["stages"]["train"][0]


def test_a_spike_in_a_million_steps_reaches_the_charts_edge_at_its_step():
    """The chart draws each dot column from its mean to its extremes: one
    step's spike among a million stays a stroke where it happened."""
    from widgets.loss_chart import plot
    s = Series()
    for i in range(1_000_000):
        s.add(i, 3.0 if i == 500_000 else 1.0 - i / 2_000_000)   # 1.0 slowly down to 0.5
    width, label_w = 68, 8
    top = plot([("loss", s.x, s.y)], width, 12)[0].plain[label_w:]
    marked = [c for c, ch in enumerate(top) if ch not in " \u2800"]
    middle = (width - label_w) // 2
    assert any(abs(c - middle) <= 1 for c in marked), top   # the spike, at its step
    assert not any(middle // 2 <= c < middle - 1 for c in marked), top   # nothing else there
