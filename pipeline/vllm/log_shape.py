"""vLLM's log lines as pipeline.run.exit_reasons reads them, handed down to
it as data (run/ knows nothing of vLLM): the prefix vLLM's logger puts before
a message, "(EngineCore_DP0 pid=12) ERROR 11-29 10:00:00 [core.py:1] ", and
the wrapper errors that only point at the cause. Both are contract strings,
checked against vLLM's source releases."""

from __future__ import annotations

from pipeline.run.exit_reasons import LogShape
from pipeline.vllm import contract_strings as vs

VLLM = LogShape(prefix=vs.LOG_LINE_PREFIX, pointer=vs.LOG_ERROR_POINTER)
