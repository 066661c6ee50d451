"""What a config key is, declared on its field, and the one loader that
enforces it.

A field says everything about its key in one place: its type (a `Literal`
for a fixed set of choices), the rules its value must meet (`opt(default,
POSITIVE)`), how low a number may go (`floor=-1` for "-1 = auto"), and
whether it decides a stage's output (`fingerprint=`). `fill` reads those
declarations; no list of key names lives apart from the keys. So adding an
option is one field in pipeline/config.py and its row in docs/config.md
(tests/unit/test_config.py checks that every key has one).

What one field cannot say — two keys that must agree, a path that must
exist, the GPUs a stage may use — stays in pipeline/config.py's checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Any

# A rule: (value, "section.key", the config file's name) -> None, or ConfigError.
Rule = Callable[[Any, str, str], None]

# Whether a key decides its stage's output (the stage's fingerprint, pipeline/config.py):
ALWAYS = "always"                  # yes: changing it redoes the stage
UNLESS_DEFAULT = "unless_default"  # yes, but left out at its default: a run made
                                   # before the key existed stays up to date
NEVER = "never"                    # no: how the work is done, not what it makes

HUGE = 10 ** 12   # no count, size or time in a config comes near this


class ConfigError(Exception):
    """A config problem a user must fix; the message says where and how."""


def opt(default, *rules: Rule, floor: int = 0, fingerprint: str = ALWAYS):
    """A config field: its default (a list or dict: a fresh copy per config),
    the rules its value meets, the lowest number it takes (0 for every
    count, size and time; -1 where -1 means auto) and whether it decides the
    stage's output."""
    meta = {"rules": rules, "floor": floor, "fingerprint": fingerprint}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def rule(ok: Callable[[Any], bool], says: str) -> Rule:
    """The rule that `ok(value)` holds; else the error "<file>: `<key>` <says>",
    with {where} and {value} filled in."""
    def check(value, where: str, src: str) -> None:
        if not ok(value):
            raise ConfigError(f"{src}: `{where}` " + says.format(where=where, value=value))
    return check


# The rules more than one key shares.
POSITIVE = rule(lambda v: v > 0, "must be positive, got {value}. Set `{where}` to 1 or more.")
# a time, a rate or a frequency: its zero would never happen or never end
NOT_ZERO = rule(lambda v: v > 0, "must be above 0 (a time, a rate or a frequency: 0 would "
                "never happen or never end), got {value}. Set `{where}` to a positive value, "
                "or remove it for the default.")


def fingerprinted(section) -> dict:
    """A section's keys as they decide its stage's output: NEVER keys left
    out, UNLESS_DEFAULT keys left out at their defaults."""
    out = dataclasses.asdict(section)
    for f in dataclasses.fields(section):
        how = f.metadata.get("fingerprint", ALWAYS)
        if how == NEVER or (how == UNLESS_DEFAULT and out[f.name] == _default(f)):
            del out[f.name]
    return out


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# -- the loader --------------------------------------------------------------------

def fill(cls, table: dict, prefix: str, src: str, skip: tuple[str, ...] = ()):
    """An instance of the dataclass `cls` from a TOML table: every key known,
    of its type, within its floor and HUGE, and meeting its field's rules;
    nested dataclasses are nested tables. `skip`: fields that are no keys."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    kwargs = {}
    for key, value in table.items():
        where = f"{prefix}{key}"
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f" Did you mean `{prefix}{near[0]}`?" if near else ""
            raise ConfigError(f"{src}: unknown key `{where}`.{hint} Valid keys here: "
                              f"{', '.join(fields)}.")
        tp, meta = hints[key], fields[key].metadata
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{src}: `{where}` must be a table ([{where}]), got {value!r}.")
            kwargs[key] = fill(tp, value, f"{where}.", src)
            continue
        kwargs[key] = check_value(value, tp, where, src, meta.get("floor", 0))
        for check in meta.get("rules", ()):
            check(kwargs[key], where, src)
    return cls(**kwargs)


def type_name(tp) -> str:
    """How an error names a type: "an integer", "a list of strings"."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return type_name(type(typing.get_args(tp)[0]))
    if origin is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}s"
    if origin is dict:
        return f"a table of {type_name(typing.get_args(tp)[1]).split(' ', 1)[1]}s"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def check_value(value, tp, where: str, src: str, floor: int = 0):
    """`value` as the type `tp` takes it (an int for a float: a float), or
    the error naming the key, the type wanted and the value given."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return check_value(value, args[0], where, src, floor)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        check_value(value, type(allowed[0]), where, src, floor)
        choice(value, allowed, where, src)
        return value
    bad = ConfigError(
        f"{src}: `{where}` must be {type_name(tp)}, got {type(value).__name__} {value!r}. "
        f"Fix the value of `{where}` in {src}."
    )
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, int if tp is int else (int, float)):
            raise bad
        check_number(value, where, src, floor)
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item,) = typing.get_args(tp)
        return [check_value(v, item, f"{where}[{i}]", src, floor) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        item = typing.get_args(tp)[1]
        if item is str and not all(isinstance(v, str) for v in value.values()):
            raise bad
        return {k: check_value(v, item, f"{where}.{k}", src, floor) for k, v in value.items()}
    raise AssertionError(f"unsupported config type {tp}")


def check_number(value, where: str, src: str, floor: int = 0) -> None:
    """Finite, at least `floor` (0: a count, size or time; -1: -1 = auto),
    and nowhere near HUGE."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{src}: `{where}` = {value} is not a finite number. "
                          f"Give `{where}` a real value.")
    if value < floor:
        allowed = "-1 (auto) or a count" if floor == -1 else "a count, size or time: never negative"
        raise ConfigError(f"{src}: `{where}` = {value} is out of range ({allowed}). "
                          f"Fix `{where}`.")
    if value > HUGE:
        raise ConfigError(f"{src}: `{where}` = {value} is far too large. Check `{where}`.")


def choice(value, allowed, where: str, src: str) -> None:
    """`value` is one of `allowed`; else the error with the nearest one."""
    if value not in allowed:
        near = difflib.get_close_matches(str(value), list(map(str, allowed)), n=1, cutoff=0.6)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ConfigError(
            f"{src}: `{where}` = {value!r} is not one of {', '.join(map(repr, allowed))}.{hint} "
            f"Set `{where}` to one of them."
        )
