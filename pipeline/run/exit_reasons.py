"""Saying why a process failed: the log lines that explain it, and a death
by signal in words. Used wherever a stage reports a process it started (a
vLLM server, the stage itself from its supervisor). Standard library only
(and vLLM's two log shapes from pipeline.vllm.contract_strings, which is too).
"""

from __future__ import annotations

import re
import signal

from pipeline.vllm import contract_strings as vs

# Lines a dying interpreter prints after the error that matters (triton's
# nanobind leak report, multiprocessing's resource tracker), never quoted.
_NOISE = re.compile(r"nanobind|^ - leaked |^ - \.\.\. skipped|resource_tracker|leaked semaphore|"
                    r"^\s*\^+\s*$|^\s*$")
# vLLM's log prefix: "(EngineCore_DP0 pid=12) ERROR 11-29 10:00:00 [core.py:1] "
_PREFIX = re.compile(vs.LOG_LINE_PREFIX)
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)|Killed|core dumped|"
                        r"^Aborted")
# Wrapper errors that only point elsewhere ("see root cause above"), vLLM's among them.
_POINTER = re.compile(r"root cause|See stack trace|" + vs.LOG_ERROR_POINTER)

SIGNAL_MEANING = {
    signal.SIGILL: "this build uses CPU instructions this machine lacks (vLLM's CPU build "
                   "needs AVX2; a GPU build of vLLM cannot run without a GPU)",
    signal.SIGKILL: "killed from outside, often by the kernel's out-of-memory killer "
                    "(see `dmesg`)",
    signal.SIGSEGV: "a crash in native code (a driver, kernel or library mismatch)",
    signal.SIGBUS: "a memory fault (often /dev/shm too small in a container)",
    signal.SIGABRT: "aborted by a failed check in native code",
}


def explain_exit(code: int | None) -> str:
    """`exited with code 1` / `was killed by SIGILL: <what it means>`."""
    if code is None:
        return "is still running"
    if code >= 0:
        return f"exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"was killed by signal {-code}"
    meaning = SIGNAL_MEANING.get(sig)
    return f"was killed by {sig.name}" + (f": {meaning}" if meaning else "")


def _split(line: str) -> tuple[str, str | None]:
    """(what the line says, its log level) without a vLLM-style prefix."""
    m = _PREFIX.match(line)
    return line[m.end():], m.group("level")


def _explains(content: str, level: str | None) -> bool:
    if _EXCEPTION.search(content.strip()) and not content.startswith((" ", "\t")):
        return True
    # An ERROR log line that is not part of a traceback it prints.
    return level in ("ERROR", "CRITICAL") and bool(content.strip()) and not content.startswith(
        (" ", "\t", "Traceback"))


def quote_error(lines: list[str], most: int = 8) -> str:
    """The lines of a log that explain a failure: exception lines and ERROR
    messages (the root cause before the wrappers that point at it), each
    with the indented detail lines under it (pydantic puts the reason
    there), without traceback frames or the noise a dying interpreter
    prints after them; else the last lines."""
    rows = [(ln.rstrip(), *_split(ln.rstrip())) for ln in lines]
    rows = [r for r in rows if not _NOISE.search(r[1])]
    hits: list[list[str]] = []
    for i, (line, content, level) in enumerate(rows):
        if not _explains(content, level):
            continue
        block = [line]
        for more, detail, _ in rows[i + 1:i + 4]:
            if not detail.startswith((" ", "\t")) or detail.lstrip().startswith(("File ", "^")) \
                    or "For further information" in detail:
                break
            block.append(more)
        hits.append(block)
    causes = [b for b in hits if not _POINTER.search(b[0])] or hits
    picked: list[str] = []
    for block in causes:
        for ln in block:
            if ln not in picked:
                picked.append(ln)
    picked = picked[-most:]
    if not picked:
        picked = [r[0] for r in rows[-most:]]
    return "\n".join(map(shorten, picked)) if picked else "(the log is empty)"


LINE_MAX = 300


def shorten(line: str, most: int = LINE_MAX) -> str:
    """A line a person reads: one of several KB (vLLM logs its whole engine
    config in an error line) keeps its start and its end."""
    if len(line) <= most:
        return line
    head, tail = most * 2 // 3, most // 4
    return f"{line[:head]} … [{len(line) - head - tail:,} characters cut] … {line[-tail:]}"
