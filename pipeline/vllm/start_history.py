"""How long a vLLM server took to start on this machine, kept per target in
the project's cache (outside any run): what the panel, `status` and
`run --wait` show as the expectation while the next one starts ("loading
weights 3/16 (4m10s of ~11m last time)"). On the user's target a start is
10-20 minutes of nothing else happening; a person watching wants to know
whether 4 minutes is early or stuck.

One JSON line per finished start in `<cache>/server-starts.jsonl`
(`EAGLE_PANEL_CACHE`, else .cache/ in the project), appended in one write,
newest last; past 2 x KEEP lines (all targets together) it is cut to its last
KEEP (an atomic rewrite). A start's key is what changes its cost: the
model, the tensor-parallel size and the speculative method loaded with it
(a draft, or extract's capture). A damaged or missing file is no history,
never an error: the expectation is a nicety. Standard library only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.vllm import contract_strings as vs

FILE = "server-starts.jsonl"
KEEP = 200


def _path() -> Path:
    """EAGLE_PANEL_START_HISTORY names the file (the tests keep their own
    starts out of the project's), else the cache's."""
    if os.environ.get("EAGLE_PANEL_START_HISTORY"):
        return Path(os.environ["EAGLE_PANEL_START_HISTORY"])
    from pipeline.paths import cache_dir
    return cache_dir() / FILE


def start_key(argv: list[str]) -> str:
    """`model|tp=N|method` from a `vllm serve` command line (ours: the model
    follows `serve`)."""
    model = argv[argv.index("serve") + 1] if "serve" in argv[:-1] else "?"
    tp = _flag(argv, vs.FLAG_TENSOR_PARALLEL) or "1"
    return f"{model}|tp={tp}|{_method(_flag(argv, vs.FLAG_SPECULATIVE_CONFIG))}"


def _method(spec: str | None) -> str:
    """The speculative method a server loads beside the target ("" none): a
    draft, or extract's hidden-state capture, each a start of its own cost."""
    if not spec:
        return ""
    try:
        parsed = json.loads(spec)
    except ValueError:
        return "draft"
    return str(parsed.get("method") or "draft") if isinstance(parsed, dict) else "draft"


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def last(key: str, path: Path | None = None) -> dict | None:
    """The newest finished start with this key: {"elapsed_s", "phases", "at"}."""
    path = path or _path()
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (256 << 10)))
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("key") == key and \
                isinstance(rec.get("elapsed_s"), (int, float)):
            return rec
    return None


def record(key: str, elapsed_s: float, phases: dict[str, float],
           path: Path | None = None) -> None:
    """Append one finished start; cut the file to its last KEEP lines when
    it has twice as many. Never raises (a read-only cache keeps no history)."""
    path = path or _path()
    line = json.dumps({"key": key, "elapsed_s": round(elapsed_s, 1),
                       "phases": {k: round(v, 1) for k, v in phases.items()},
                       "at": round(time.time(), 1)}) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        if path.read_bytes().count(b"\n") > 2 * KEEP:   # (once per start: a small file)
            _compact(path)
    except OSError:
        pass


def _compact(path: Path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    if len(lines) <= KEEP:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(b"".join(lines[-KEEP:]))
    os.replace(tmp, path)
