"""The event protocol: stages append JSON lines, the panel and CLI tail them.

Writer: one `os.write` per event on an O_APPEND descriptor, so concurrent
writers never interleave inside a line and a crash loses at most the line
being written. Reader: remembers a byte offset, returns only complete lines
and keeps a half-written last line for the next poll.
The event types and their fields are the contract between the stages and
every reader (README: "Events"): `EventType` names them, one TypedDict per
type describes its fields, and the writer refuses an unknown type or a
missing required field, so a typo fails where it is written.
Standard library only (stages import it from any interpreter).
"""

from __future__ import annotations

import enum
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

from pipeline.run import summaries
from pipeline.run.diskspace import DiskFull, is_full_errno


class EventType(str, enum.Enum):
    STAGE_STARTED = "stage_started"
    PROGRESS = "progress"
    METRIC = "metric"
    KV_CACHE = "kv_cache"
    KV_USAGE = "kv_usage"
    ARTIFACT = "artifact"
    ONLINE = "online"
    BACKEND = "backend"
    SERVER = "server"
    WARNING = "warning"
    ERROR = "error"
    STAGE_FINISHED = "stage_finished"

    def __str__(self) -> str:
        return self.value


# A server event's phases that readers count (pipeline.vllm.startup names the rest):
# here, so the read model below the vLLM code needs nothing from above it.
SERVER_READY, SERVER_STOPPED = "ready", "stopped"


# -- the fields of each event type (optional ones in the *Extra base) --------

class StageStartedEvent(TypedDict):
    stage: str
    attempt: int
    argv: list[str]
    devices: list[int]


class _ProgressExtra(TypedDict, total=False):
    rate: float | None
    eta_s: float | None
    epoch: Any
    phase: str            # what the stage does between counted units ("validating", ...)
    tokens_per_s: float
    bytes_written: int
    bytes_per_token: int
    disk_needed_bytes: int
    disk_free_bytes: int


class ProgressEvent(_ProgressExtra):
    done: int
    total: int | None
    unit: str


class _MetricExtra(TypedDict, total=False):
    epoch: Any
    split: str            # "train" (the default) | "val"


class MetricEvent(_MetricExtra):
    step: int | None
    values: dict[str, float]


class _KvCacheExtra(TypedDict, total=False):
    server: int | str     # its number in the stage ("node/k" across nodes)
    devices: list[int]
    pool: str | None
    cache_dtype: str | None
    label: str            # what the server is for ("vLLM server (checkpoint 7)")
    planned: dict         # the server's KV plan (pipeline.run.plans.KvPlan.to_json)


class KvCacheEvent(_KvCacheExtra):
    num_blocks: int | None
    block_size: int | None
    bytes_per_block: int | None
    total_bytes: int | None
    tokens_capacity: int | None
    max_concurrency: float | None
    max_model_len: int | None
    groups: list[dict]
    source: str           # "engine" | "log" | "log+metrics"


class KvUsageEvent(TypedDict):
    usage_perc: float
    running: int
    waiting: int


class _OnlineExtra(TypedDict, total=False):
    running: int
    waiting: int
    kv_usage_perc: float | None
    consumed_tokens_per_s: float | None
    server_idle_share: float
    buffer_bytes: int
    servers: int
    server_devices: list[int]
    trainer_devices: list[int]
    restarts: int


class OnlineEvent(_OnlineExtra):   # online training: the producer/consumer view
    produced_tokens_per_s: float
    trainer_wait_share: float | None
    buffer_peak_bytes: int
    verdict: str


class _ServerExtra(TypedDict, total=False):
    done: int             # safetensors shards loaded (while loading weights)
    total: int
    stalled_s: float      # no log line, no GPU memory change for this long while starting
    took: dict            # vLLM's own timings ("Loading weights took" -> s)
    label: str            # what the server is for ("vLLM server", "checkpoint 2", ...)
    expected_s: float     # the last start of this target on this machine, whole
    log: str              # its log file
    devices: list[int]


class ServerEvent(_ServerExtra):   # a vLLM server's start, phase by phase
    server: int | str     # its number in the stage ("node/k" across nodes)
    phase: str            # starting | loading weights | loading the draft |
                          # profiling / KV cache | warm-up | ready; stopped
    elapsed_s: float
    phase_s: float
    last_line: str


class BackendEvent(TypedDict):   # the backend a stage resolved ("auto" -> what runs)
    backend: str
    why: str


class ArtifactEvent(TypedDict):
    path: str
    kind: str
    bytes: int


class _MessageExtra(TypedDict, total=False):
    hint: str | None
    disk_full: bool   # an error: the disk ran out (the launcher exits 4)


class MessageEvent(_MessageExtra):   # warning / error
    message: str


class _FinishedExtra(TypedDict, total=False):
    source: str


class StageFinishedEvent(_FinishedExtra):
    status: str
    duration_s: float
    summary: dict


FIELDS: dict[EventType, type] = {
    EventType.STAGE_STARTED: StageStartedEvent, EventType.PROGRESS: ProgressEvent,
    EventType.METRIC: MetricEvent, EventType.KV_CACHE: KvCacheEvent,
    EventType.KV_USAGE: KvUsageEvent, EventType.ARTIFACT: ArtifactEvent,
    EventType.ONLINE: OnlineEvent, EventType.BACKEND: BackendEvent,
    EventType.SERVER: ServerEvent,
    EventType.WARNING: MessageEvent, EventType.ERROR: MessageEvent,
    EventType.STAGE_FINISHED: StageFinishedEvent,
}


_REQUIRED = {kind: frozenset(td.__required_keys__) for kind, td in FIELDS.items()}


def check_event(type: EventType | str, fields: dict) -> EventType:
    """The event's type, once it is a known one with its required fields."""
    kind = EventType(type)   # ValueError names an unknown type
    if _REQUIRED[kind] <= fields.keys():
        return kind
    missing = sorted(_REQUIRED[kind] - fields.keys())
    if missing:
        raise ValueError(f"a {kind.value} event needs {', '.join(missing)}")
    return kind


def _type_ok(value, annotation: str) -> bool:
    """`value` against one TypedDict annotation (a string: this module uses
    postponed annotations): int, float, str, bool, dict[...], list[X],
    Any, and unions of them. A float may be null (the writer turns NaN and
    infinities into null), an int a float (JSON does not tell 3 from 3.0
    across writers); a dict's contents are its reader's to check."""
    return _checker(annotation)(value)


@functools.lru_cache(maxsize=None)
def _checker(annotation: str) -> Callable[[Any], bool]:
    """The check of one annotation, parsed once: every line a reader reads
    is checked (a million-event run: a million times), and parsing the
    annotation's text at each check was most of `status`'s time."""
    alts = [_alternative(a.strip()) for a in annotation.split("|")]
    if len(alts) == 1:
        return alts[0]
    return lambda value: any(ok(value) for ok in alts)


def _alternative(alt: str) -> Callable[[Any], bool]:
    base, _, inner = alt.partition("[")
    if base == "Any":
        return lambda value: True
    if base == "None":
        return lambda value: value is None
    if base in ("int", "float"):
        return lambda value: value is None or (isinstance(value, (int, float))
                                               and not isinstance(value, bool))
    if base in ("str", "bool", "dict"):
        kind = {"str": str, "bool": bool, "dict": dict}[base]
        return lambda value: isinstance(value, kind)
    if base == "list":
        item = _checker(inner.rstrip("]") or "Any")
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    return lambda value: False


def _annotations(kind: EventType) -> dict[str, str]:
    out: dict[str, str] = {}
    for klass in reversed(FIELDS[kind].__mro__):
        out.update({k: getattr(v, "__forward_arg__", v if isinstance(v, str) else "Any")
                    for k, v in getattr(klass, "__annotations__", {}).items()})
    return out


_NUMBER = _checker("float")
# each known type's fields and their checks, built once (valid_event runs on every line read)
_CHECKS = {kind: {k: _checker(a) for k, a in _annotations(kind).items()} for kind in FIELDS}


def valid_event(ev) -> bool:
    """Whether a line read back is an event a reader may trust: a JSON object
    with a numeric `t`, a string `type` and, for a known type, each field it
    has of its declared type. A damaged file (`"done": "lots"`, `"t": "now"`)
    must not crash `status` or the panel: such a line is skipped like a
    half-written one."""
    if not isinstance(ev, dict) or not isinstance(ev.get("type"), str) or \
            not _NUMBER(ev.get("t", 0)):
        return False
    fields = _CHECKS.get(ev["type"])
    if fields is not None and not all(ok(ev[k]) for k, ok in fields.items() if k in ev):
        return False
    return ev["type"] != EventType.STAGE_FINISHED or summaries.valid(ev.get("summary") or {})


def _clean(value):
    # JSON has no NaN/inf; a diverged loss must still be a valid line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# One encoder, built once: json.dumps builds one per call with these options.
# It refuses NaN and infinities, so only an event that has one (rare: a
# diverged loss) pays for _clean's walk over every field.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str, allow_nan=False)


def _line(event: dict) -> str:
    try:
        return _ENCODER.encode(event) + "\n"
    except (ValueError, TypeError):   # NaN / inf; or a key that is not a string
        return _ENCODER.encode(_clean(event)) + "\n"


class EventWriter:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._cut = False   # a full disk cut a line short: the next one starts afresh

    def emit(self, type: EventType | str, **fields) -> dict:
        kind = check_event(type, fields)
        event = {"t": time.time(), "type": kind.value, **fields}
        line = _line(event)
        data = ("\n" + line if self._cut else line).encode()
        try:
            written = os.write(self._fd, data)
        except OSError as e:
            if is_full_errno(e):
                raise DiskFull(self.path, len(data)) from None
            raise
        if written < len(data):
            # ENOSPC part way (one write is one line, so only the disk does
            # this): readers skip the cut line once a newline follows it.
            self._cut = True
            raise DiskFull(self.path, len(data))
        self._cut = False
        return event

    def warning(self, message: str, hint: str | None = None, **fields) -> dict:
        return self.emit(EventType.WARNING, message=message, hint=hint, **fields)

    def error(self, message: str, hint: str | None = None, **fields) -> dict:
        return self.emit(EventType.ERROR, message=message, hint=hint, **fields)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EventTail:
    """Follow an events file from a byte offset (0 = from the start)."""

    def __init__(self, path: str | os.PathLike, offset: int = 0, chunk: int = 1 << 20):
        self.path = Path(path)
        self.offset = offset
        self.chunk = chunk
        self._partial = b""
        self._ino = None
        self.bad_lines = 0

    def poll(self, max_bytes: int | None = None) -> list[dict]:
        """Events completed since the last call (possibly none)."""
        try:
            f = open(self.path, "rb")
        except OSError:   # not there yet; or damaged (a folder): nothing to read
            return []
        with f:
            st = os.fstat(f.fileno())
            if self._ino is not None and (st.st_ino != self._ino or st.st_size < self.offset):
                # Replaced or truncated: start over rather than read garbage.
                self.offset, self._partial = 0, b""
            self._ino = st.st_ino
            f.seek(self.offset)
            data = f.read(max_bytes if max_bytes is not None else -1)
        if not data:
            return []
        self.offset += len(data)
        data = self._partial + data
        end = data.rfind(b"\n")
        if end < 0:
            self._partial = data
            return []
        self._partial = data[end + 1:]
        return self._parse(data[:end])

    def _parse(self, block: bytes) -> list[dict]:
        # One json.loads over the whole block is ~2x faster than one per line;
        # only a block with a damaged line pays for the line-by-line pass.
        try:
            body = block.strip(b"\n")
            events = json.loads(b"[" + body.replace(b"\n", b",") + b"]")
            # one event per line: `{..}, {..}` on one line is a damaged line, not two events
            if len(events) == body.count(b"\n") + 1 and all(valid_event(e) for e in events):
                return events
        except (ValueError, RecursionError):
            pass
        events = []
        for line in block.split(b"\n"):
            if not line:
                continue
            try:
                ev = json.loads(line)
            except (ValueError, RecursionError):
                ev = None
            if valid_event(ev):
                events.append(ev)
            else:
                self.bad_lines += 1
        return events


def read_events(path: str | os.PathLike) -> list[dict]:
    """Every complete event in a file (for tests and small files)."""
    return EventTail(path).poll()


def last_event(path: str | os.PathLike, types: tuple[str, ...], window: int = 1 << 20) -> dict | None:
    """The newest event of one of `types`, reading backwards from the end in
    blocks, at most `window` bytes: a status check on a file of a million
    events must not read the whole file."""
    try:
        f = open(path, "rb")
    except OSError:   # not there; or damaged (a folder): no event
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        pos, tail, block = size, b"", 64 << 10
        needles = [f'"type":"{t}"'.encode() for t in types]
        while pos > 0 and size - pos < window:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step) + tail
            lines = buf.split(b"\n")
            # The first piece may be a partial line: keep it for the next block.
            tail = lines[0] if pos > 0 else b""
            for line in reversed(lines[1:] if pos > 0 else lines):
                if any(n in line for n in needles):
                    try:
                        ev = json.loads(line)
                    except (ValueError, RecursionError):
                        continue
                    if valid_event(ev) and ev["type"] in types:
                        return ev
    return None


def tail_lines(path: str | os.PathLike, n: int, max_bytes: int = 4 << 20) -> tuple[list[bytes], int]:
    """The last n lines of a (maybe huge) file and the file size, reading
    backwards at most max_bytes."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return [], 0
    except IsADirectoryError:   # damaged: `logs` checks first and says so
        return [], 0
    with f:
        size = os.fstat(f.fileno()).st_size
        pos, buf = size, b""
        while pos > 0 and buf.count(b"\n") <= n and size - pos < max_bytes:
            step = min(64 << 10, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step) + buf
    lines = buf.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if pos > 0 and lines:
        lines = lines[1:]  # the first one is cut
    return lines[-n:] if n else [], size


def tail_events(path: str | os.PathLike, n: int) -> list[dict]:
    """The events among the last n lines of a (maybe huge) file."""
    out = []
    for line in tail_lines(path, n)[0]:
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if valid_event(ev):
            out.append(ev)
    return out


class ChangeWaiter:
    """Wait until files in a folder change, or a timeout passes.

    Uses Linux inotify through ctypes when it is there (a new event reaches
    a reader in about a millisecond), and plain sleeping otherwise (the
    reader then sees it at its next poll)."""

    _IN_MODIFY, _IN_CREATE, _IN_MOVED_TO = 0x2, 0x100, 0x80

    def __init__(self, folders):
        self._fd = -1
        try:
            import ctypes
            import ctypes.util
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                return
            mask = self._IN_MODIFY | self._IN_CREATE | self._IN_MOVED_TO
            for folder in folders:
                Path(folder).mkdir(parents=True, exist_ok=True)
                libc.inotify_add_watch(fd, str(folder).encode(), mask)
            self._fd = fd
        except (OSError, AttributeError):
            self._fd = -1

    @property
    def native(self) -> bool:
        return self._fd >= 0

    def wait(self, timeout: float) -> bool:
        """True when something changed (or may have: without inotify)."""
        if self._fd < 0:
            time.sleep(timeout)
            return True
        import select
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return False
        try:
            while os.read(self._fd, 65536):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
