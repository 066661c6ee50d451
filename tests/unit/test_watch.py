"""`eagle-panel watch`'s figures from vLLM's /metrics text (issue 54):
counters' deltas between two reads, a restart seen as counters going back,
gauges summed over engines, the measured draft beside the live figures
(only the positions the server reports); not vLLM and no speculative
decoding said, not raised. The same counters against a real server:
tests/vllm/test_vllm_pipeline.py."""

import json

import pytest

from pipeline.vllm import contract_strings as vs
from pipeline.watch.figures import NotVllm, between, read
from pipeline.watch.measured import Measured
from pipeline.watch.report import Report


def metrics_text(drafts, accepted, per_pos, generated, engines=1, running=2, kv=0.25) -> str:
    """A /metrics body as vLLM 0.32 writes it (names from the contract)."""
    lines = []
    for e in range(engines):   # data-parallel ranks: each engine's own counters
        lab = f'engine="{e}",model_name="m"'
        lines += [f"{vs.METRIC_SPEC_DRAFTS}{{{lab}}} {drafts / engines}",
                  f"{vs.METRIC_SPEC_DRAFT_TOKENS}{{{lab}}} {3 * drafts / engines}",
                  f"{vs.METRIC_SPEC_ACCEPTED}{{{lab}}} {accepted / engines}",
                  f"{vs.METRIC_GENERATION_TOKENS}{{{lab}}} {generated / engines}",
                  f"{vs.METRIC_RUNNING}{{{lab}}} {running}",
                  f"{vs.METRIC_WAITING}{{{lab}}} 0.0",
                  f"{vs.METRIC_KV_USAGE}{{{lab}}} {kv}"]
        lines += [f'{vs.METRIC_SPEC_PER_POSITION}{{{lab},position="{k}"}} {n / engines}'
                  for k, n in enumerate(per_pos)]
    return "# HELP vllm:x y\n" + "\n".join(lines) + "\n"


def test_an_interval_is_the_counters_deltas():
    a = read(metrics_text(100, 200, [90, 70, 40], 350), 10.0)
    b = read(metrics_text(150, 290, [135, 100, 55], 500), 15.0)
    w = between(a, b)
    assert (w.seconds, w.drafts, w.accepted_tokens, w.draft_tokens) == (5.0, 50, 90, 150)
    assert w.acceptance_length == pytest.approx(1 + 90 / 50)
    assert w.acceptance_rate == pytest.approx(90 / 150)
    assert w.per_position == pytest.approx([45 / 50, 30 / 50, 15 / 50])
    assert (w.drafted_per_s, w.accepted_per_s, w.generated_per_s) == (30.0, 18.0, 30.0)
    assert not w.restarted
    s = between(None, b)   # since the server started: no rate (its start is not in /metrics)
    assert s.drafts == 150 and s.acceptance_length == pytest.approx(1 + 290 / 150)
    assert s.drafted_per_s is None and s.seconds == 0.0
    idle = between(b, read(metrics_text(150, 290, [135, 100, 55], 500), 20.0))
    assert idle.acceptance_length is None and idle.per_position == [None] * 3


def test_a_restart_counts_from_the_restart():
    a = read(metrics_text(1000, 2000, [900, 700, 400], 3500), 10.0)
    b = read(metrics_text(20, 30, [15, 10, 5], 60), 15.0)   # a new server: counters from 0
    w = between(a, b)
    assert w.restarted and w.drafts == 20 and w.acceptance_length == pytest.approx(2.5)
    assert w.per_position == pytest.approx([0.75, 0.5, 0.25]) and w.drafted_per_s is None


def test_engines_are_summed_and_the_kv_share_is_their_mean():
    r = read(metrics_text(100, 200, [90, 70, 40], 350, engines=2, running=3, kv=0.5), 0.0)
    assert (r.drafts, r.accepted, r.running, r.kv_usage) == (100, 200, 6, 0.5)
    assert r.per_position == {0: 90, 1: 70, 2: 40}


def test_not_vllm_and_no_speculative_decoding_are_said():
    with pytest.raises(NotVllm, match="no vllm: metric"):
        read("# HELP go_goroutines x\ngo_goroutines 12\n", 0.0)
    plain = read(f'{vs.METRIC_RUNNING}{{engine="0"}} 1\n{vs.METRIC_GENERATION_TOKENS} 9\n', 0.0)
    assert not plain.spec_decode
    lines = Report("http://h:1", "m", between(plain, plain), between(None, plain), plain,
                   None).lines()
    assert "no speculative decoding on this server" in lines[1], lines


def test_the_measured_draft_beside_the_live_figures_on_the_positions_served():
    a = read(metrics_text(100, 200, [90, 70, 40], 350), 10.0)
    b = read(metrics_text(150, 290, [135, 100, 55], 500), 15.0)
    m = Measured(3.2, [0.95, 0.75, 0.5, 0.3], 4, "run demo, checkpoint 7")   # 4 measured
    r = Report("http://h:1", "tiny", between(a, b), between(None, b), b, m)
    d = r.difference()
    assert d["acceptance_length"] == pytest.approx(2.8 - 3.2)
    assert d["per_position"] == pytest.approx([0.9 - 0.95, 0.6 - 0.75, 0.3 - 0.5])   # 3 served
    text = "\n".join(r.lines())
    assert "acceptance length 2.80 (measured 3.20: -0.40) · accept rate 0.60" in text, text
    assert "per position 1: 0.90 (0.95)  2: 0.60 (0.75)  3: 0.30 (0.50)" in text, text
    assert "requests running 2 · waiting 0 · KV cache 25.0%" in text
    assert "measured: run demo, checkpoint 7" in text
    j = r.to_json()
    assert j["window"]["drafts"] == 50 and j["measured"]["acceptance_length"] == 3.2
    assert Report("u", None, between(b, b), between(None, b), b, m).difference() is None


def test_windows_over_the_hour_and_a_restart_clears_what_came_before():
    from pipeline.watch.history import History
    h = History(interval=30.0)
    for i in range(200):   # 100 minutes, a read each 30 s: 10 drafts, 20 accepted each
        h.add(read(metrics_text(10 * i, 20 * i, [8 * i, 7 * i, 5 * i], 30 * i), 30.0 * i))
    assert len(h.readings) <= 3600 / 30 + 2   # bounded: an hour
    w = h.windows()
    assert w["1 min"].seconds == 60 and w["1 min"].drafts == 20
    assert w["10 min"].drafts == 200 and w["1 h"].seconds == 3600
    assert w["1 h"].acceptance_length == pytest.approx(3.0)
    assert h.add(read(metrics_text(10, 20, [8, 7, 5], 30), 6000.0))   # counters went back
    w = h.windows()
    assert h.restarts == 1 and w["1 h"].drafts == 10 and w["1 min"].seconds == 30.0


def test_the_drift_rule_holds_before_it_speaks_and_says_which_positions_fell(tmp_path):
    from pipeline.watch.drift import Drift
    from pipeline.watch.state import Watcher
    m = Measured(3.0, [0.9, 0.7, 0.4], 3, "run demo, checkpoint 7")
    log = tmp_path / "drift.jsonl"
    w = Watcher("http://h:1", 60.0, m, log, Drift(margin=0.10, hold_s=300.0))
    drafts = accepted = 0
    per = [0.0, 0.0, 0.0]
    for minute, rates in enumerate([(0.9, 0.7, 0.4)] * 3 + [(0.9, 0.4, 0.2)] * 8
                                   + [(0.9, 0.7, 0.4)] * 2):
        drafts += 100
        per = [p + 100 * r for p, r in zip(per, rates, strict=True)]
        accepted = sum(per)
        w.answered(read(metrics_text(drafts, accepted, per, 4 * drafts), 60.0 * minute))
        state = w.state()
        if minute == 4:   # below since minute 3: said, not yet a drift
            assert state.drift.startswith("below 90% of the measured acceptance for 60 s")
            assert not log.exists()
        if minute == 8:   # 300 s below: a drift, positions 2 and 3 fell
            assert state.drifting and "positions 2, 3 fell" in state.drift, state.drift
    events = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["drift", "recovered"], events
    assert events[0]["positions_fell"] == [2, 3] and events[0]["t"] == 8 * 60.0
    assert events[0]["acceptance_length"] == pytest.approx(2.5) and events[0]["measured"] == 3.0
    assert events[0]["url"] == "http://h:1" and events[1]["t"] == 11 * 60.0


def test_a_silence_is_not_the_last_minute_and_restarts_the_drift_hold():
    from pipeline.watch.drift import Drift
    from pipeline.watch.history import History
    from pipeline.watch.state import Watcher
    h = History(interval=5.0)
    h.add(read(metrics_text(100, 200, [90, 70, 40], 350), 0.0))
    h.add(read(metrics_text(110, 215, [99, 76, 40], 380), 1200.0))   # 20 minutes later
    assert h.window(60.0) is None and h.window(3600.0).drafts == 10
    m = Measured(3.0, [0.9, 0.7, 0.4], 3, "x")
    w = Watcher("u", 60.0, m, None, Drift(hold_s=300.0))
    w.answered(read(metrics_text(100, 300, [90, 70, 40], 350), 0.0))
    w.answered(read(metrics_text(200, 450, [180, 110, 60], 700), 60.0))   # 2.5: below
    assert w.drift.below_since == 60.0
    w.failed("no answer", 0.0)
    assert w.silent_since == 0.0 and w.drift.below_since is None   # (t = 0 kept, not lost)
    w.failed("still none", 30.0)
    assert w.silent_since == 0.0


def test_a_line_the_sample_pattern_half_matches_is_skipped():
    text = metrics_text(100, 200, [90, 70, 40], 350) + "vllm:build_info 1.2.3\n" + \
        f'{vs.METRIC_SPEC_PER_POSITION}{{position="x"}} 5\n'
    r = read(text, 0.0)
    assert r.drafts == 100 and r.per_position == {0: 90, 1: 70, 2: 40}


def test_a_port_that_is_not_a_number_is_bad_input():
    from pipeline.watch.scrape import WatchInputError, target
    with pytest.raises(WatchInputError, match="the port is not a number"):
        target("http://127.0.0.1:abc", None)
    assert target("https://h.example:8443/metrics", None).url == "https://h.example:8443"
