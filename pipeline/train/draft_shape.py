"""speculators asked, before training, what the train stage's flags mean and
what draft they make: `python -m pipeline.train.draft_shape OUT.json <
request.json`, run with the stages' interpreter ([runtime] python).

Two questions, each answered by speculators' own code, never by ours:
1. `TrainConfig.resolve(argv)`: speculators' own parser and validation of the
   flags the stage will pass (a renamed flag, a conflict between two, a
   value it refuses), in its words (argparse's `error:` line).
2. The draft's config as its trainer builds it: `build_draft_model` from the
   resolved flags, the speculator class constructed on the meta device (no
   memory) and stopped there, before the verifier's weights are read. It is
   saved with its own `save_pretrained` and no tensors: a config-only
   folder, which speculators itself knows (`is_config_only_dir`) and which
   vLLM's speculative config reads like a trained checkpoint's (equal to a
   trained checkpoint's config.json: tests/unit/test_algorithms.py). doctor
   hands that folder to vLLM's own validation of evaluate's server with the
   draft (pipeline/doctor/validation.py), so a method or key the installed
   vLLM refuses for this algorithm is found before hours of training.

Input: {"argv": [...], "folder": "<where the config goes>"}. Output
(OUT.json): {"ok", "error", "step": "resolve" or "config", "import_s",
"seconds"}. The flags' paths (data, hidden states, save path) need not
exist: neither question reads them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path


class Shaped(BaseException):
    """Raised once speculators has constructed the draft (on the meta device:
    no memory, no weights read), before it loads the vocabulary mappings and
    the verifier's weights (BaseException: no `except Exception` on the way
    takes it)."""

    def __init__(self, model):
        super().__init__("shaped")
        self.model = model


def capturing(model_class):
    """`model_class`, constructed on the meta device and handed back."""
    import torch

    class Capture(model_class):
        def __init__(self, *args, **kwargs):
            with torch.device("meta"):
                super().__init__(*args, **kwargs)
            raise Shaped(self)
    Capture.__name__ = Capture.__qualname__ = model_class.__name__
    return Capture


def resolve(argv: list[str]):
    """speculators' TrainConfig for `argv`, or (None, its refusal)."""
    from speculators.train.config import TrainConfig
    err, real = io.StringIO(), sys.stderr
    sys.stderr = err
    try:
        return TrainConfig.resolve(argv), None
    except SystemExit as e:
        return None, parser_error(err.getvalue()) or \
            f"speculators' parser exited with status {e.code}"
    finally:
        sys.stderr = real


def parser_error(text: str) -> str:
    """argparse's `error:` line and what follows it (speculators puts the
    reason for an invalid configuration on the next lines), as one line."""
    lines = text.splitlines()
    at = max((i for i, ln in enumerate(lines) if "error:" in ln), default=None)
    if at is None:
        return ""
    said = [lines[at].split("error:", 1)[1].strip(), *(ln.strip() for ln in lines[at + 1:])]
    return " ".join(x for x in said if x)


def shape(cfg, folder: str) -> None:
    """The draft's config, built by speculators' build_draft_model, saved to
    `folder`. The draft vocabulary's size is the flag's; without one (an
    algorithm on the target's whole vocabulary) speculators' own
    parse_vocab_mappings finds it, as its trainer does."""
    from speculators.model import SpeculatorModel
    from speculators.train import cli
    args = argparse.Namespace(**cfg.flatten())
    model_class = SpeculatorModel.registry[args.speculator_type]
    n = args.draft_vocab_size
    if n is None and not (args.d2t_path or args.t2d_path):
        _, _, n = cli.parse_vocab_mappings(args)
    try:
        cli.build_draft_model(args, capturing(model_class), None, None, n)
    except Shaped as s:
        save_config_only(s.model, folder)
        return
    raise RuntimeError("speculators' build_draft_model returned without building the draft")


def save_config_only(model, folder: str) -> None:
    """The model saved by its own save_pretrained with no tensors (the
    config.json a checkpoint carries: its architectures, its fields set as the
    model was built), in the dtype speculators' checkpointer saves in
    (bfloat16, its save_checkpoint's default, patched by its own
    patch_config_dtype); written whole, then renamed into place."""
    import torch
    from speculators.train.checkpointer import patch_config_dtype
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict={})
    patch_config_dtype(Path(tmp) / "config.json", torch.bfloat16)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def main(out: str) -> None:
    request = json.load(sys.stdin)
    t0 = time.monotonic()
    import speculators.train.cli  # noqa: F401 - its import, timed apart from the answer
    import_s = time.monotonic() - t0
    t = time.monotonic()
    cfg, error = resolve(request["argv"])
    step = "resolve"
    if error is None:
        step = "config"
        try:
            shape(cfg, request["folder"])
        except Exception as e:  # noqa: BLE001 - any refusal is speculators' answer
            error = f"{type(e).__name__}: {e}"
    answer = {"ok": error is None, "error": error or "", "step": step,
              "import_s": round(import_s, 3), "seconds": round(time.monotonic() - t, 3)}
    with open(f"{out}.tmp", "w") as f:
        json.dump(answer, f)
    os.replace(f"{out}.tmp", out)


if __name__ == "__main__":
    main(sys.argv[1])
