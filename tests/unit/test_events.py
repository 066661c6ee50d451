"""Event writer and tail reader: partial lines, growth, truncation, concurrency."""

import json
import os
import subprocess
import sys

import pytest

from pipeline.run.events import EventTail, EventWriter, last_event, read_events, tail_lines
from tests.helpers import ROOT


def test_writer_lines_are_json_and_nan_safe(tmp_path):
    p = tmp_path / "e.jsonl"
    with EventWriter(p) as w:
        w.emit("metric", step=1, epoch=0, values={"loss": float("nan"), "acc": 0.5}, split="train")
        w.warning("disk low", hint="free space")
    lines = p.read_text().splitlines()
    assert len(lines) == 2
    ev = json.loads(lines[0])
    assert ev["type"] == "metric" and ev["values"] == {"loss": None, "acc": 0.5}
    assert isinstance(ev["t"], float)
    assert json.loads(lines[1])["hint"] == "free space"


def test_tail_keeps_half_written_line_for_next_poll(tmp_path):
    p = tmp_path / "e.jsonl"
    tail = EventTail(p)
    assert tail.poll() == []  # missing file is fine
    with open(p, "wb") as f:
        f.write(b'{"t":1,"type":"progress","done":1}\n{"t":2,"type":"prog')
        f.flush()
        got = tail.poll()
        assert [e["done"] for e in got] == [1]
        assert tail.poll() == []
        f.write(b'ress","done":2}\n')
        f.flush()
        got = tail.poll()
    assert [e["done"] for e in got] == [2]
    assert tail.bad_lines == 0


def test_tail_restarts_on_truncation_and_counts_garbage(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_bytes(b'{"type":"a"}\nnot json\n{"type":"b"}\n')
    tail = EventTail(p)
    assert [e["type"] for e in tail.poll()] == ["a", "b"]
    assert tail.bad_lines == 1
    p.write_bytes(b'{"type":"c"}\n')
    assert [e["type"] for e in tail.poll()] == ["c"]


def test_last_event_reads_backwards_only(tmp_path):
    p = tmp_path / "e.jsonl"
    with EventWriter(p) as w:
        w.emit("progress", done=1, total=10, unit="x")
        for i in range(20000):
            w.emit("metric", step=i, values={"loss": 1.0})
        w.emit("progress", done=7, total=10, unit="x")
        for i in range(5):
            w.emit("metric", step=i, values={"loss": 1.0})
    assert last_event(p, ("progress",))["done"] == 7
    # Beyond the window it gives up rather than read the whole file.
    with EventWriter(p) as w:
        for i in range(30000):
            w.emit("metric", step=i, values={"loss": 1.0})
    assert last_event(p, ("progress",), window=64 << 10) is None
    assert last_event(tmp_path / "missing", ("progress",)) is None


def test_tail_lines(tmp_path):
    p = tmp_path / "log"
    p.write_bytes(b"".join(b"line %d\n" % i for i in range(100000)))
    lines, size = tail_lines(p, 3)
    assert lines == [b"line 99997", b"line 99998", b"line 99999"]
    assert size == p.stat().st_size
    p.write_bytes(b"a\nb")
    assert tail_lines(p, 5)[0] == [b"a", b"b"]


def test_concurrent_writers_no_lost_or_duplicated_events(tmp_path):
    p = tmp_path / "e.jsonl"
    n_writers, n_events = 4, 5000
    code = ("import sys; from pipeline.run.events import EventWriter\n"
            "w = EventWriter(sys.argv[1]); k = int(sys.argv[2])\n"
            "for i in range(int(sys.argv[3])):\n"
            "    w.emit('metric', step=i, writer=k, seq=i, values={'pad': 'x' * (i % 300)})\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p), str(k), str(n_events)], env=env)
             for k in range(n_writers)]
    tail, seen = EventTail(p, chunk=4096), []
    while any(proc.poll() is None for proc in procs):
        seen += tail.poll(max_bytes=8192)  # small reads: many cuts inside lines
    seen += tail.poll()
    assert tail.bad_lines == 0
    pairs = [(e["writer"], e["seq"]) for e in seen]
    assert len(pairs) == len(set(pairs)) == n_writers * n_events
    for k in range(n_writers):
        assert [s for w, s in pairs if w == k] == list(range(n_events))
    assert len(read_events(p)) == n_writers * n_events


def test_writer_refuses_unknown_types_and_missing_fields(tmp_path):
    """The event contract is checked where an event is written: a typo in a
    type, or a missing required field, is an error, not a line readers skip."""
    import pytest

    from pipeline.run.events import EventType, check_event
    with EventWriter(tmp_path / "e.jsonl") as w:
        with pytest.raises(ValueError, match="progres"):
            w.emit("progres", done=1, total=2, unit="x")
        with pytest.raises(ValueError, match="needs total, unit"):
            w.emit(EventType.PROGRESS, done=1)
        w.emit(EventType.PROGRESS, done=1, total=None, unit="x")
    assert [e["type"] for e in read_events(tmp_path / "e.jsonl")] == ["progress"]
    assert check_event("kv_usage", {"usage_perc": 0.1, "running": 1, "waiting": 0}) \
        is EventType.KV_USAGE


@pytest.mark.parametrize("ev, ok", [
    ({"type": "progress", "t": 1.0, "done": 3, "total": None, "unit": "steps"}, True),
    ({"type": "progress", "t": 1.0, "done": 3.0, "total": 7, "unit": "steps"}, True),  # 3 == 3.0
    ({"type": "progress", "t": 1.0, "done": "lots", "unit": "steps"}, False),
    ({"type": "progress", "t": 1.0, "done": True, "unit": "steps"}, False),   # a bool is no count
    ({"type": "progress", "t": "now", "done": 3}, False),
    ({"type": "progress", "t": None, "done": 3}, True),          # a NaN time, written as null
    ({"type": "kv_cache", "t": 1.0, "server": 0, "devices": [0, 1]}, True),
    ({"type": "kv_cache", "t": 1.0, "server": "n0/1", "devices": [0, "1"]}, False),
    ({"type": "kv_cache", "t": 1.0, "server": [0]}, False),      # int | str: neither
    ({"type": "kv_cache", "t": 1.0, "pool": None, "cache_dtype": "auto"}, True),
    ({"type": "kv_cache", "t": 1.0, "groups": {"a": 1}}, False),  # list[dict]
    ({"type": "metric", "t": 1.0, "step": None, "values": {"loss": 0.5}, "epoch": "any"}, True),
    ({"type": "metric", "t": 1.0, "values": [0.5]}, False),
    ({"type": "no_such_type", "t": 1.0, "done": "anything"}, True),   # unknown: only t and type
    ({"type": "stage_finished", "t": 1.0, "status": "succeeded", "duration_s": 2,
      "summary": {"acceptance_length": "high"}}, False),
    ({"type": "stage_finished", "t": 1.0, "status": "succeeded", "duration_s": 2,
      "summary": {"acceptance_length": 3.1, "per_position": [0.9, None]}}, True),
    (["not", "an", "object"], False),
])
def test_each_field_is_checked_against_its_declared_type(ev, ok):
    """valid_event, whose checks are built once from the TypedDicts'
    annotations: each kind of annotation (int | None, int | str, list[int],
    list[dict], dict, Any) accepts what the writer writes and refuses damage."""
    from pipeline.run.events import valid_event
    assert valid_event(ev) is ok
