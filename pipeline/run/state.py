"""The one typed reader of state.json: every field the readers and the
launchers use is checked for its type before anything trusts it.

A `"created_at": "yesterday"` or a stage entry that is a number used to end
in a TypeError deep inside `status` or `resume`; here it is a StateError
naming the key (`stages.train.started_at`) and what it should be, which
rundir.read_state turns into "corrupt state file (...)" with the file left
untouched. Pure: it takes the parsed document and returns it (an older run's
missing fields filled with their defaults, in memory only); it never writes.
Standard library only (the supervisor imports it with any interpreter).
"""

from __future__ import annotations

import math
import re

STATUSES = ("pending", "running", "succeeded", "failed", "cancelled", "skipped")
# A Slurm job id as sbatch --parsable prints it (an array task: 123_4). Anything
# else would reach scancel's command line, where "--all" or "-u me" mean much more.
SLURM_JOB = re.compile(r"\d{1,20}(_\d{1,10})?")


class StateError(ValueError):
    """One field of state.json with the wrong type or value."""

    def __init__(self, where: str, value, want: str):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        super().__init__(f"`{where}` = {shown} is not {want}")
        self.where = where


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return (_int(v) or isinstance(v, float)) and math.isfinite(v)


def _opt(check):
    return lambda v: v is None or check(v)


_PID = (_opt(lambda v: _int(v) and 0 < v < 1 << 31), "a process id (a whole number > 0) or null")
_TICKS = (_opt(lambda v: _int(v) and v >= 0), "a process start time (clock ticks) or null")
_TIME = (_opt(_number), "a time (seconds since 1970) or null")
_STR = (_opt(lambda v: isinstance(v, str)), "a string or null")

STAGE_FIELDS = {
    "status": (lambda v: v in STATUSES, "one of " + ", ".join(STATUSES)),
    "attempt": (lambda v: _int(v) and v >= 0, "a whole number >= 0"),
    "pid": _PID, "pgid": _PID, "supervisor_pid": _PID,
    "create_time": _TICKS, "supervisor_create_time": _TICKS,
    "started_at": _TIME, "ended_at": _TIME,
    "exit_code": (_opt(_int), "a whole number or null"),
    "signal": _STR, "fingerprint": _STR, "out_fingerprint": _STR, "reason": _STR,
    "token": (_opt(lambda v: isinstance(v, str) and v != ""), "a non-empty string or null"),
    "devices": (lambda v: isinstance(v, list) and all(_int(d) and d >= 0 for d in v),
                "a list of GPU indices"),
    "cancel_requested": (lambda v: isinstance(v, bool), "true or false"),
    "slurm_job": (_opt(lambda v: isinstance(v, str) and SLURM_JOB.fullmatch(v) is not None),
                  "a Slurm job id (digits) or null"),
    "max_rss_kb": (_opt(_int), "a whole number or null"),
}

DRIVER_FIELDS = {
    "pid": _PID, "create_time": _TICKS, "started_at": _TIME,
    "only": _STR, "force": (lambda v: isinstance(v, bool), "true or false"),
}

TOP_FIELDS = {
    "run_id": _STR, "base_dir": _STR,
    "created_at": (_number, "a time (seconds since 1970)"),
    "cancel_requested": (lambda v: isinstance(v, bool), "true or false"),
    "driver": (_opt(lambda v: isinstance(v, dict)), "a table or null"),
    "target": (_opt(lambda v: isinstance(v, dict) and all(
        isinstance(v.get(k), str) for k in ("repo_id", "commit") if k in v)),
        "a table (repo_id, commit, ...) or null"),
}


def _check_fields(doc: dict, fields: dict, prefix: str) -> None:
    for key, (ok, want) in fields.items():
        if key in doc and not ok(doc[key]):
            raise StateError(f"{prefix}{key}", doc[key], want)


def validate(state, stage_names, defaults) -> dict:
    """The parsed state.json, checked; `defaults()` gives a new stage's
    fields (filled in for the stages and fields an older run lacks)."""
    if not isinstance(state, dict):
        raise StateError("(top level)", type(state).__name__, "a table")
    if not isinstance(state.get("stages"), dict):
        raise StateError("stages", state.get("stages"), "a table of stages")
    _check_fields(state, TOP_FIELDS, "")
    if state.get("driver") is not None:
        _check_fields(state["driver"], DRIVER_FIELDS, "driver.")
    for name, st in state["stages"].items():
        if not isinstance(st, dict):
            raise StateError(f"stages.{name}", st, "a table of the stage's fields")
        _check_fields(st, STAGE_FIELDS, f"stages.{name}.")
    for name in stage_names:   # a run made before a stage existed
        state["stages"].setdefault(name, defaults())
    for st in state["stages"].values():   # ...or before a field did
        for key, value in defaults().items():
            st.setdefault(key, value)
    return state
