"""One torchrun rank of the train stage (see pipeline.stages.train.run_torchrun).

Every rank trains; rank 0 alone writes events, so the panel sees one stream.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from pipeline.drive.stage_context import Interrupted, load_context
from pipeline.train.in_process import run_in_process


class _NoEvents:
    def emit(self, *a, **kw):
        return None

    warning = error = emit

    def close(self):
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    ctx = load_context("train", ["--run-dir", a.run_dir])
    if int(os.environ.get("RANK", "0")) != 0:
        ctx.events.close()
        ctx.events = _NoEvents()

    def stop(_signum, _frame):
        ctx.stop_requested = True

    signal.signal(signal.SIGINT, stop)
    try:
        run_in_process(ctx, argv, "cpu" if ctx.devices == ["cpu"] else "cuda")
    except Interrupted:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
