"""vLLM's usual shutdown, told apart from a failure: once a server says it
is stopping, the lines every stop prints (0.32 kills its engine with a
timeout of 0, so the API server's output handler logs an EngineDeadError
traceback; multiprocessing warns of leaked semaphores) are known harmless.
The panel hides them from its view of the log and says it did; the file
keeps every line, and exit_reasons reads the file, not this view."""

from __future__ import annotations

import re

from pipeline.vllm import contract_strings as vs

_BEGIN = re.compile(vs.LOG_SHUTDOWN_BEGIN)
_NOISE = re.compile(vs.LOG_SHUTDOWN_NOISE)
_START = re.compile(vs.LOG_SERVER_ARGS)
MARK = "(vLLM's usual shutdown messages are hidden here from this point: the file has them)"


class ShutdownNoise:
    """Per log followed: `shown(line)` is the line, None for a known-harmless
    shutdown line (MARK in place of a stop's first); `hidden` counts them. A
    server started again in the same file (its arguments line) is watched
    afresh."""

    def __init__(self) -> None:
        self.stopping = False
        self.marked = False
        self.hidden = 0

    def shown(self, line: str) -> str | None:
        if not self.stopping:
            self.stopping = bool(_BEGIN.search(line))
            self.marked = False
            return line
        if _NOISE.search(line):
            self.hidden += 1
            if self.marked:
                return None
            self.marked = True
            return MARK
        if _START.search(line):   # a new start in the same file
            self.stopping = False
        return line
