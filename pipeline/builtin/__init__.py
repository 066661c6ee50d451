"""The embedded defaults: tiny target models and a conversation dataset.

Each built-in target is a module with `ensure_built() -> Path` (the model
folder, built on first use) and `describe() -> dict` (its config.json as it
will be, known without building: what a launch checks against).
"""

import importlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {"builtin:tiny-llama": "pipeline.builtin.tiny_model",
           "builtin:tiny-kimi": "pipeline.builtin.tiny_kimi"}


def conversations_path() -> Path:
    return HERE / "conversations.jsonl"


def broken_conversations_path() -> Path:
    return HERE / "conversations_broken.jsonl"


def target(name: str):
    """The module of the built-in target `name` ("builtin:tiny-llama")."""
    return importlib.import_module(TARGETS[name])
