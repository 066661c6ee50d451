"""Where the stages' input rows come from: [data] (a JSONL file or a
`datasets` folder), or the regenerate stage's rows, which prepare reads in
its place when regenerate is on."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.data.chat_mask import RowError
from pipeline.stage_error import StageError


def regenerated_rows(run) -> Path:
    """The regenerate stage's output in a run directory."""
    return run.out_dir("regenerate") / "rows.jsonl"


def iter_raw(path: Path):
    """(row number, parsed object or RowError): JSONL line numbers from 1, or
    row indices of a datasets folder."""
    if path.is_dir():
        try:
            from datasets import load_from_disk
            ds = load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001
            raise StageError(f"{path}: not a readable datasets folder ({e})",
                             hint="give a JSONL file or a folder saved with save_to_disk") from None
        if hasattr(ds, "keys"):  # a DatasetDict: take the train split
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        for i, row in enumerate(ds):
            yield i, row
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, RowError(f"invalid UTF-8 at byte {e.start}")
                continue
            if n == 1:
                text = text.removeprefix("\ufeff")   # a byte-order mark (Windows tools)
            if not text.strip():
                yield n, RowError("empty line")
                continue
            try:
                yield n, json.loads(text)
            except ValueError as e:
                yield n, RowError(f"bad JSON ({e.msg} at column {e.colno})")


def count_rows(path: Path) -> int:
    if path.is_dir():
        return sum(1 for _ in iter_raw(path))
    with open(path, "rb") as f:
        return sum(1 for _ in f)
