"""doctor's check of the data a run reads ([data] path): a dataset is there
to read. The stages find out too, but only when prepare (or regenerate) runs;
this is one stat of a folder or a file, so the launch checks make it."""

from __future__ import annotations

from pipeline.config import BUILTIN_DATA
from pipeline.doctor.findings import BLOCK, Finding, check
from pipeline.doctor.inputs import Inputs

# what datasets' save_to_disk leaves in a folder: a DatasetDict, or a Dataset
SAVED = ("dataset_dict.json", "state.json")


@check(45, launch=15)
def check_data(x: Inputs) -> list[Finding]:
    """[data] path names a JSONL file with something in it, or a folder a
    dataset was saved in."""
    if x.cfg.data.path == BUILTIN_DATA:
        return []
    path = x.cfg.data_path()
    fix = ("name a JSONL file of conversations, or a folder saved with datasets' "
           "save_to_disk, in [data] path")
    if path.is_dir() and not any((path / name).exists() for name in SAVED):
        return [Finding("data", BLOCK, f"[data] path = {x.cfg.data.path!r} is a folder with no "
                        f"dataset in it ({path}: no {' or '.join(SAVED)}, which "
                        "save_to_disk writes)", fix)]
    if path.is_file() and path.stat().st_size == 0:
        return [Finding("data", BLOCK, f"[data] path = {x.cfg.data.path!r} is an empty file "
                        f"({path})", fix)]
    return []
