"""Readings a person takes from the panel (issue 50, item 7): the training
chart's trend first (EMA over the raw means, which stay faint), the total
loss alone until the positions are asked for, a y range that the first
steps' loss does not flatten (Tukey's fences, the clipped columns marked at
the edge); a finished train's row saying how it ended, not a part-filled
bar; the KV tab's figures saying whose they are, and adding up."""

import numpy as np

from pipeline.run.rundir import Status
from pipeline.run.series import Series
from widgets.kv_panel import KVReport, figure_rows, server_rows
from widgets.loss_chart import CLIPPED_DOWN, CLIPPED_UP, LossChart, plot
from widgets.stage_table import COLUMNS, StageTable

LABEL_W = 8
X = np.arange(2000.0)
# a loss from 17 down to ~1 in its first 5% of steps, then noisy around 1
LOSS = 1.0 + 16 * np.exp(-X / 40) + np.random.default_rng(0).normal(0, 0.05, len(X))


def top_label(lines) -> float:
    return float(lines[0].plain[:LABEL_W].strip())


def test_the_first_steps_loss_is_clipped_and_marked_not_the_range():
    whole = plot([("loss", X, LOSS)], 78, 14)
    fenced = plot([("loss", X, LOSS)], 78, 14, fence=True)
    assert top_label(whole) > 15                        # every value: the bulk is a flat line
    assert top_label(fenced) < 2, fenced[0].plain       # the bulk of the curve
    top = fenced[0].plain[LABEL_W:]
    marked = [c for c, ch in enumerate(top) if ch == CLIPPED_UP]
    assert marked and marked[0] == 0 and max(marked) < len(top) // 4, top   # where it started
    assert f"{CLIPPED_UP}{CLIPPED_DOWN} clipped" in fenced[-1].plain
    assert "clipped" not in whole[-1].plain
    # where the curve is now is never clipped: flat, then a late drop past the fences
    late = np.where(X < 1950, 1.0, 0.2)
    low = plot([("loss", X, late)], 78, 14, fence=True)
    assert float(low[-2].plain[:LABEL_W].strip()) == 0.2, low[-2].plain
    assert CLIPPED_DOWN not in low[-2].plain
    # a short curve has no bulk to speak of: its whole range
    few = plot([("loss", X[:5], LOSS[:5])], 78, 14, fence=True)
    assert top_label(few) > 15 and "clipped" not in few[-1].plain


def test_smoothing_draws_the_trend_over_the_faint_raw_means():
    raw = plot([("loss", X, LOSS)], 78, 14)
    smooth = plot([("loss", X, LOSS)], 78, 14, smooth=True)
    styles = {str(span.style) for ln in smooth[:-1] for span in ln.spans}
    assert any(st.startswith("dim ") for st in styles if st != "dim"), styles   # faint raw
    assert any(st == "cyan" for st in styles), styles                           # the trend
    assert not any(str(sp.style).startswith("dim ") for ln in raw[:-1] for sp in ln.spans)
    assert smooth[-1].plain.count("■ loss") == 1        # one legend entry per series


def _series(values) -> Series:
    s = Series()
    for i, v in enumerate(values):
        s.add(i, v)
    return s


def test_the_total_loss_alone_until_the_positions_are_asked_for():
    chart = LossChart()
    chart.metrics = {("train", k): _series([3.0, 2.0, 1.0])
                     for k in ("loss", "loss_0", "loss_1", "loss_2", "full_acc_0")}
    assert chart.smooth and [s[0] for s in chart.series()] == ["loss"]
    chart.positions = True
    assert [s[0] for s in chart.series()] == ["loss", "loss_0", "loss_1", "loss_2"]
    chart.metric = "full_acc"   # accuracy has no total: its positions always
    assert [s[0] for s in chart.series()] == ["full_acc_0"]


def test_a_train_that_stopped_on_a_plateau_says_so_not_a_part_filled_bar():
    ev = {"done": 1620, "total": 2592, "unit": "steps"}
    plateau = "plateau at epoch 5: estimate 3.10, +0.2% over the best of 2"   # train's `stopped`
    running = StageTable._progress(ev, Status.RUNNING).plain
    assert "1620/2592" in running and running != "1620 steps"   # the bar while it runs
    assert StageTable._progress(ev, Status.SUCCEEDED, plateau).plain == \
        "1620 steps, plateau at epoch 5"
    assert StageTable._progress({**ev, "done": 2592}, Status.SUCCEEDED).plain == \
        "2592 steps"                                                 # it did what it planned
    assert "1620/2592" in StageTable._progress(ev, Status.CANCELLED).plain
    # no reason given: no bar, no guess
    assert StageTable._progress({"done": 7, "total": 9, "unit": "rows"},
                                Status.SUCCEEDED).plain == "7/9 rows"
    # the row: the end runs on into the empty Rate / ETA column, the Exit column stays put
    table = StageTable()
    row = table._row_text({"Stage": "train", "Status": "succeeded", "Progress":
                           StageTable._progress(ev, Status.SUCCEEDED, plateau),
                           "Rate / ETA": "", "Exit": "exit 0"}).plain
    assert "1620 steps, plateau at epoch 5" in row, row
    exit_at = 1 + sum(w + 1 for _, w in COLUMNS[:-1])
    assert row[exit_at:].startswith("exit 0") and len(row) == exit_at + COLUMNS[-1][1] + 1
    busy = table._row_text({"Progress": "x" * 30, "Rate / ETA": "ETA 1m"}).plain
    assert "x" * 19 not in busy and "ETA 1m" in busy   # a full neighbour is not run over


def test_the_kv_figures_say_which_server_they_are_and_add_up():
    """evaluate's two servers (with the draft, without): the figures under the
    servers are headed by whose they are; the blocks give their token slots,
    and vLLM's smaller capacity says it is vLLM's count."""
    def report(k, cap, blocks, size):
        return {"server": k, "devices": [k], "tokens_capacity": cap, "num_blocks": blocks,
                "block_size": size, "total_bytes": 1 << 30, "bytes_per_block": 1 << 18}
    servers = {0: report(0, 284_672, 2224, 128), 1: report(1, 379_562, 4096, 128)}
    rows = dict((k, str(v)) for k, v in server_rows(KVReport(servers[1], servers, stage="evaluate"))
                + figure_rows(servers[1], None, several=True))
    assert rows["servers"] == "2 (data parallel): 664,234 tokens in all"
    assert rows["figures of"] == "server 1 (GPUs [1])"
    assert rows["blocks"] == "4,096 x 128 tokens = 524,288 token slots"
    assert rows["token capacity"] == "379,562 (vLLM's own count: 72% of the slots)"
    alone = dict(figure_rows(report(0, 52_416, 3276, 16), None))
    assert "figures of" not in alone and alone["token capacity"] == "52,416"


def test_a_curve_flat_over_half_its_columns_keeps_a_readable_range():
    """An accuracy that rises, then sits at exactly 1.0 (no IQR, no bulk to
    scale to): its whole range, not a range collapsed onto one value."""
    acc = np.minimum(1.0, X / 100)   # 0 -> 1 over the first 5% of steps, then 1.0
    lines = plot([("full_acc_0", X, acc)], 78, 14, fence=True)
    top, bottom = top_label(lines), float(lines[-2].plain[:LABEL_W].strip())
    assert top == 1 and bottom < 0.1 and "clipped" not in lines[-1].plain, (top, bottom)


def test_per_step_metric_dicts_stay_off_the_stage_log():
    """speculators' per-step dict is filtered from the console handlers (its
    figures are events); validation's dict and plain lines print."""
    import logging

    from pipeline.train.in_process import per_step_quiet

    def record(name, msg):
        return logging.LogRecord(name, logging.INFO, __file__, 1, msg, None, None)
    assert not per_step_quiet(record("speculators.metrics", {"train": {"loss": 1.0}}))
    assert per_step_quiet(record("speculators.metrics", {"val": {"loss": 1.0}}))
    assert per_step_quiet(record("speculators.metrics", "Training epoch 1/1 started"))
    assert per_step_quiet(record("speculators.train", {"train": {"loss": 1.0}}))
