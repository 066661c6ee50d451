"""The stages, in pipeline order, and what each reads from the others.
Standard library only: the config, the run directory and the runner share it.

    [regenerate] -> prepare -> extract -> vocab -> train -> evaluate
"""

from __future__ import annotations

STAGE_NAMES = ("regenerate", "prepare", "extract", "vocab", "train", "evaluate")
# Each stage's inputs: its fingerprint folds in theirs, so a change upstream
# invalidates everything downstream.
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "regenerate": (),
    "prepare": ("regenerate",),
    "extract": ("prepare",),
    "vocab": ("prepare",),
    "train": ("prepare", "extract", "vocab"),
    "evaluate": ("prepare", "train"),
}
# Stages that can be turned off ([stages.X] enabled = false): they are then
# skipped, and what reads them reads what they would have replaced.
OPTIONAL = ("regenerate", "evaluate")
# Stages that run a vLLM server and are skipped, saying why, without one.
NEED_VLLM = ("regenerate", "evaluate")
