"""Test and benchmark configs built from tables, not pasted TOML: `render`
writes nested dicts as TOML, `merged` lays one config's tables over another's
(so a test says only what differs), and `tiny_pipeline` is the built-in
target's pipeline at a test's size, which the real-vLLM tests and the
benchmarks start from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def merged(base: dict, over: dict | str) -> dict:
    """`over` (tables, or TOML text) laid over `base`, table by table."""
    if isinstance(over, str):
        over = tomllib.loads(over)
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {v!r}")


def render(tables: dict, prefix: str = "") -> str:
    """TOML for nested dicts: at the top every dict is a table ([run]); a
    table holding only dicts holds tables ([stages] -> [stages.extract]);
    any other dict is an inline table (env = { A = "1" })."""
    only_tables = prefix == "" or (bool(tables) and all(isinstance(v, dict)
                                                        for v in tables.values()))
    keys = [f"{k} = {_value(v)}" for k, v in tables.items()
            if not (only_tables and isinstance(v, dict))]
    out = "\n".join(keys) + ("\n" if keys else "")
    for k, v in tables.items():
        if only_tables and isinstance(v, dict):
            head = "" if v and all(isinstance(x, dict) for x in v.values()) else \
                f"\n[{prefix}{k}]\n"
            out += head + render(v, f"{prefix}{k}.")
    return out


def write(path: Path, tables: dict) -> Path:
    path.write_text(render(tables) or "# all defaults\n")
    return path


def tiny_pipeline(name: str = "p", samples: int = 48, **over) -> dict:
    """The built-in tiny target's pipeline at a test's size (CPU): the common
    ground of the real-vLLM tests and the benchmarks; `over` by table."""
    base = {
        "run": {"name": name},
        "data": {"max_samples": samples},
        "stages": {
            "prepare": {"seq_length": 192},
            "extract": {"backend": "auto", "layer_ids": [1, 2, 3]},
            "vocab": {"draft_vocab_size": 256},
            "train": {"epochs": 2, "lr": 0.001, "total_seq_len": 1024},
            "evaluate": {"max_prompts": 12, "max_tokens": 48},
        },
    }
    return merged(base, over)
