"""What evaluate measured for the draft a server is serving, for `watch` to
set the live figures beside: from a run (`--run`: the checkpoint evaluate
chose, read as `export` reads it) or from an exported folder (`--draft`:
its measured.json, which `export` writes beside the model card). vLLM names
no draft in /metrics or /v1/models, so the user names it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import export
from pipeline.run.rundir import RunDir
from pipeline.run.snapshot import read_run

MEASURED_FILE = export.MEASURED_FILE   # in an export folder, beside the model card


class MeasuredError(ValueError):
    """The draft's measurement cannot be read (exit 2, with the fix)."""


@dataclass(frozen=True)
class Measured:
    acceptance_length: float
    per_position: list[float | None]
    num_speculative_tokens: int | None
    source: str                      # "run demo, checkpoint 7" / "export /path"

    def to_json(self) -> dict:
        return asdict(self)


def of_measurement(m: dict, results: dict, source: str) -> Measured:
    return Measured(float(m["acceptance_length"]), list(m.get("per_position") or []),
                    results.get("num_speculative_tokens"), source)


def from_run(rd: RunDir) -> Measured:
    """The measurement of the checkpoint evaluate chose in this run."""
    try:
        results = export.read_results(rd)
        name, m = export.measured_checkpoint(results, None,
                                             read_run(rd).stages["evaluate"].summary.checkpoint)
    except export.ExportError as e:
        raise MeasuredError(str(e)) from None
    return of_measurement(m, results, f"run {rd.id}, checkpoint {name}")


def from_export(folder: Path) -> Measured:
    """An exported draft's measured.json."""
    path = Path(folder) / MEASURED_FILE
    try:
        data = json.loads(path.read_text())
        return Measured(float(data["acceptance_length"]), list(data.get("per_position") or []),
                        data.get("num_speculative_tokens"), f"export {Path(folder).resolve()}")
    except FileNotFoundError:
        raise MeasuredError(f"{path} is missing: --draft names a folder `eagle-panel export` "
                            "wrote (exports before 2026-12-07 lack it: export again)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MeasuredError(f"{path} cannot be read ({e}); export the draft again") from None
