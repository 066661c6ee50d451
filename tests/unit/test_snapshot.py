"""pipeline.run.snapshot: the one read model under `status`, `status --json`,
`run --wait` and the panel. Every attempt's time is counted, each server keeps
its own KV-cache report, and `status --json` has the outcome the text prints.

The parts in other tiers: tests/integration/test_snapshot.py."""

from __future__ import annotations

from pipeline.run.rundir import RunDir
from pipeline.run.snapshot import RunReader
from pipeline.run.summaries import TrainSummary


def _reader(tmp_path) -> RunReader:
    return RunReader(RunDir(tmp_path / "run"))


def test_attempts_servers_and_the_report_to_show(tmp_path):
    r = _reader(tmp_path)
    ev = lambda t, **kw: r._apply("evaluate", {"t": kw.pop("at", 0.0), "type": t, **kw})  # noqa: E731
    ev("stage_started", attempt=1, at=100.0)
    ev("stage_finished", status="cancelled", duration_s=51.0, summary={}, at=151.0)
    ev("stage_started", attempt=2, at=200.0)
    for k, blocks in ((0, 5825), (1, 7281)):
        ev("server", server=k, phase="ready", elapsed_s=20.0, phase_s=0.0, last_line="")
        ev("kv_cache", server=k, num_blocks=blocks)
    ev("server", server=1, phase="stopped", elapsed_s=60.0, phase_s=0.0, last_line="")
    st = r.snapshot().stages["evaluate"]
    assert [(a.number, a.status, a.seconds) for a in st.attempts] == \
        [(1, "cancelled", 51.0), (2, "running", None)]
    assert [s.name for s in st.servers] == ["0", "1"] and st.servers[1].stopped
    assert st.servers[0].kv_cache["num_blocks"] == 5825
    assert st.kv_cache()["num_blocks"] == 5825          # the server still up, not the last
    ev("server", server=0, phase="stopped", elapsed_s=70.0, phase_s=0.0, last_line="")
    assert r.snapshot().stages["evaluate"].kv_cache()["num_blocks"] == 7281   # all stopped: last
    ev("stage_started", attempt=3, at=300.0)             # a new attempt shows its own servers
    st = r.snapshot().stages["evaluate"]
    assert st.servers == () and st.kv_cache() is None and len(st.attempts) == 3
    assert r.snapshot().stages["extract"].kv_cache() is None   # another stage's stay its own


def test_target_loads_and_their_time_over_every_attempt(tmp_path):
    """Each server that came up is one target load (a `ready` said again while
    another server starts is not a second); a new attempt's add to the last's."""
    from pipeline import fmt
    r = _reader(tmp_path)
    ev = lambda t, **kw: r._apply("evaluate", {"t": kw.pop("at", 0.0), "type": t, **kw})  # noqa: E731
    ev("stage_started", attempt=1, at=100.0)
    ev("server", server=1, phase="starting", elapsed_s=0.0)
    ev("server", server=1, phase="ready", elapsed_s=40.0)
    ev("server", server=0, phase="ready", elapsed_s=45.0)
    ev("server", server=1, phase="ready", elapsed_s=40.0)     # BaselineAhead's watch, again
    ev("stage_finished", status="failed", duration_s=120.0, summary={}, at=220.0)
    ev("stage_started", attempt=2, at=300.0)
    ev("server", server=2, phase="ready", elapsed_s=50.0)
    ev("stage_finished", status="succeeded", duration_s=80.0, summary={}, at=380.0)
    st = r.snapshot().stages["evaluate"]
    assert (st.target_loads, st.loading_s) == (3, 135.0)
    line = fmt.target_loads_line([("regenerate", 1, 30.0, 90.0),
                                  ("evaluate", st.target_loads, st.loading_s, 200.0),
                                  ("train", 0, 0.0, 500.0)])
    assert line == "vLLM target loads: 4 (regenerate 1, evaluate 3); 2m45s of server starts " \
        "(summed) in 4m50s of those stages"


def test_an_engine_report_without_a_server_is_shown(tmp_path):
    r = _reader(tmp_path)
    r._apply("extract", {"t": 1.0, "type": "stage_started", "attempt": 1})
    r._apply("extract", {"t": 2.0, "type": "kv_cache", "num_blocks": 50_000, "source": "engine"})
    assert r.snapshot().stages["extract"].kv_cache()["source"] == "engine"


def test_a_snapshot_never_changes_after_it_is_handed_out(tmp_path):
    """The panel draws a snapshot on its UI thread while the file worker reads
    on: the snapshot's series and dict stay as they were (copy on write)."""
    r = _reader(tmp_path)
    metric = {"t": 1.0, "type": "metric", "split": "train", "values": {"loss": 1.0}}
    for step in range(5):
        r._apply("train", {**metric, "step": step})
    first = r.snapshot()
    series = first.metrics[("train", "loss")]
    x_buffer = memoryview(series.x)   # what a chart's np.frombuffer holds
    for step in range(5, 9):
        r._apply("train", {**metric, "step": step, "values": {"loss": 0.5, "acc": 0.1}})
    assert len(series) == 5 and ("train", "acc") not in first.metrics
    second = r.snapshot()
    assert len(second.metrics[("train", "loss")]) == 9 and ("train", "acc") in second.metrics
    x_buffer.release()


def test_an_attempt_shows_its_own_summary_and_time_since_the_last_success(tmp_path):
    r = _reader(tmp_path)
    ev = lambda t, **kw: r._apply("train", {"t": kw.pop("at", 0.0), "type": t, **kw})  # noqa: E731
    ev("stage_started", attempt=1, at=0.0)
    ev("stage_finished", status="succeeded", duration_s=100.0, summary={"acceptance_length": 3.1})
    assert r.snapshot().stages["train"].summary.acceptance_length == 3.1
    ev("stage_started", attempt=2, at=200.0)   # a forced re-run: its own summary, none yet
    assert r.snapshot().stages["train"].summary == TrainSummary()
    ev("stage_started", attempt=3, at=300.0)   # attempt 2 never finished: killed
    ev("stage_finished", status="cancelled", duration_s=20.0, summary={})
    ev("stage_started", attempt=4, at=400.0)
    attempts = r.snapshot().stages["train"].attempts
    assert [a.status for a in attempts] == ["succeeded", "killed", "cancelled", "running"]
    from pipeline.run.snapshot import _earlier_s
    assert _earlier_s(attempts, 4) == 20.0     # since the success: the cancelled 20 s
    assert _earlier_s(attempts, 5) == 20.0     # attempt 5 queued, not started: the same


