"""Saying why a process failed: the log lines that explain it, and a death
by signal in words. Used wherever a stage reports a process it started (a
vLLM server, the stage itself from its supervisor). Standard library only:
the shape of a program's log lines (vLLM's prefix and its wrapper errors) is
handed down as data by whoever knows it (`LogShape`; pipeline.vllm.log_shape
for vLLM's), so run/ knows nothing of vLLM.
"""

from __future__ import annotations

import functools
import re
import signal
from dataclasses import dataclass

# Lines a dying interpreter prints after the error that matters (triton's
# nanobind leak report, multiprocessing's resource tracker), never quoted.
_NOISE = re.compile(r"nanobind|^ - leaked |^ - \.\.\. skipped|resource_tracker|leaked semaphore|"
                    r"^\s*\^+\s*$|^\s*$")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)|Killed|core dumped|"
                        r"^Aborted")
# Wrapper errors that only point elsewhere ("see root cause above"), whatever the program.
_POINTER = r"root cause|See stack trace"


@dataclass(frozen=True)
class LogShape:
    """How a program's log lines look: `prefix`, a regex matched at a line's
    start with a `level` group (what precedes the message: a process, a log
    level, a time), and `pointer`, its wrapper errors that only point at the
    cause. Handed down by the package that knows the program."""
    prefix: str = r"(?P<level>)"
    pointer: str = ""

    def compiled(self) -> tuple[re.Pattern, re.Pattern]:
        return _compiled(self.prefix, self.pointer)


PLAIN = LogShape()   # a line is its message; only the generic pointers


@functools.lru_cache(maxsize=8)
def _compiled(prefix: str, pointer: str) -> tuple[re.Pattern, re.Pattern]:
    return re.compile(prefix), re.compile(_POINTER + (f"|{pointer}" if pointer else ""))


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


def _split(line: str, prefix: re.Pattern) -> tuple[str, str | None]:
    """(what the line says, its log level) without the program's prefix."""
    m = prefix.match(line)
    if not m:
        return line, None
    return line[m.end():], m.group("level") or None


def _explains(content: str, level: str | None) -> bool:
    if _EXCEPTION.search(content.strip()) and not content.startswith((" ", "\t")):
        return True
    # An ERROR log line that is not part of a traceback it prints.
    return level in ("ERROR", "CRITICAL") and bool(content.strip()) and not content.startswith(
        (" ", "\t", "Traceback"))


def quote_error(lines: list[str], most: int = 8, shape: LogShape = PLAIN) -> str:
    """The lines of a log that explain a failure: exception lines and ERROR
    messages (the root cause before the wrappers that point at it), each
    with the indented detail lines under it (pydantic puts the reason
    there), without traceback frames or the noise a dying interpreter
    prints after them; else the last lines. `shape`: how the log's lines
    look (vLLM's: pipeline.vllm.log_shape.VLLM)."""
    prefix, pointer = shape.compiled()
    rows = [(ln.rstrip(), *_split(ln.rstrip(), prefix)) for ln in lines]
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
    causes = [b for b in hits if not pointer.search(b[0])] or hits
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
