"""Prepare on long agent traces: time per row against the number of turns.

The boundary method (pipeline/data/chat_mask.py) renders the conversation
through each assistant turn, which costs the square of the turns; prepare
stops at the first turn that begins past `seq_length`, where rows are cut
anyway. This times prepare's own row step (`process_chunk`, the built-in
target's tokenizer and chat template) on one synthetic tool-using trace per
turn count, at each `--seq-length`, with and without that bound (`--unbounded`
turn counts only: they take the square of the turns):

    python bench/long_rows.py [--turns 200 10000] [--seq-length 256 4096] [--unbounded 200 1000]

What still grows with the trace is rendering it whole once (the template)
and normalizing its rows: linear, milliseconds a thousand turns.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.builtin.tiny_model import ensure_built
from pipeline.data.chat_mask import LocalRenderer
from pipeline.stages.prepare import process_chunk


def trace(turns: int) -> dict:
    """A user question, then the assistant and a tool in turn, as agents run."""
    roles = ["user"] + [("assistant", "tool")[i % 2] for i in range(turns - 1)]
    return {"messages": [{"role": r, "content": f"{r} step {i}: checked file_{i}.py, 3 matches"}
                         for i, r in enumerate(roles)]}


class Unbounded(LocalRenderer):
    """Every turn rendered, as before the bound (for the comparison)."""

    def rows(self, msgs, tools=None, limit=None):
        return super().rows(msgs, tools)


def time_row(renderer, turns: int, seq_length: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = process_chunk([(0, trace(turns))], renderer, seq_length, "auto")
    took = time.perf_counter() - t0
    assert not out["skipped"], out["skipped"]
    return took, sum(map(sum, out["loss_mask"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[200, 10000])
    ap.add_argument("--seq-length", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--unbounded", type=int, nargs="*", default=[200, 1000],
                    help="turn counts also timed without the bound")
    a = ap.parse_args(argv)
    if min(a.turns + a.seq_length + (a.unbounded or [2])) < 2:
        ap.error("--turns, --seq-length and --unbounded take counts of 2 or more")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ensure_built()))
    bounded = LocalRenderer(tok)
    print("prepare's row step on one synthetic agent trace (built-in tokenizer and template)")
    for seq in a.seq_length:
        per = {}
        for turns in a.turns:
            took, supervised = time_row(bounded, turns, seq)
            per[turns] = took
            print(f"seq_length {seq:>6,}  {turns:>7,} turns: {took * 1000:9.1f} ms a row, "
                  f"{supervised:,} supervised tokens")
        for turns in a.unbounded or []:
            took, _ = time_row(Unbounded(tok), turns, seq)
            print(f"seq_length {seq:>6,}  {turns:>7,} turns, every turn rendered: "
                  f"{took * 1000:9.1f} ms a row")
        lo, hi = min(a.turns), max(a.turns)
        print(f"seq_length {seq:>6,}  {hi:,} turns / {lo:,} turns: "
              f"{per[hi] / per[lo]:.2f}x the time a row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
