"""A config-only stand-in for the draft the train stage will make, asked of
the stages' speculators before training (pipeline.train.draft_shape runs in
[runtime] python's interpreter), and remembered.

doctor uses it twice: speculators' refusal of the stage's flags is a block
in speculators' words, and the stand-in's folder is the draft vLLM's
validation reads for evaluate's server (pipeline/doctor/validation.py):
the speculative config as evaluate will pass it, over a config.json of the
shape the trained checkpoint will have. The answer is cached by what
decides it (the interpreter, its speculators, the target's config.json and
the flags), most of its time being speculators' import (~5 s on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.paths import PROJECT_ROOT, cache_dir
from pipeline.run.rundir import atomic_write_json
from pipeline.train.flags import draft_flags, wrapper_mask_token

# The flags speculators' parser needs that no question here reads: placeholders.
PLACEHOLDERS = ["--data-path", "<prepare>/data", "--hidden-states-path",
                "<extract>/hidden_states", "--save-path", "<train>/checkpoints"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class StandIn:
    """speculators' answer: the stand-in's folder (ok), or its refusal."""
    ok: bool
    folder: str = ""
    error: str = ""           # speculators' words
    step: str = ""            # "resolve" (the flags) or "config" (the draft's config)
    import_s: float = 0.0
    seconds: float = 0.0
    cached: bool = False
    failed: str = ""          # the asking itself failed: no answer either way


def planned_argv(cfg, layer_ids: list[int]) -> list[str]:
    """The train stage's draft-shaping flags for this config (its data and
    schedule flags left out: placeholders)."""
    mask = wrapper_mask_token(cfg.target_path(), cfg.model.trust_remote_code)
    return [*draft_flags(cfg, layer_ids, mask), *PLACEHOLDERS]


def cache_key(python: str, speculators: str, target: Path, argv: list[str]) -> str | None:
    try:
        config = (target / "config.json").read_bytes()
    except OSError:
        return None
    h = hashlib.sha256()
    for part in (python, speculators, config.hex(), json.dumps(argv)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def ask(python: str, speculators: str, cfg, layer_ids: list[int],
        timeout: float = 300.0) -> StandIn:
    """speculators' answer for this config's draft (cached); `speculators`
    names the installed one (version and folder) for the cache."""
    argv = planned_argv(cfg, layer_ids)
    key = cache_key(python, speculators, cfg.target_path(), argv)
    root = cache_dir() / "draft-stand-ins"
    if key is not None:
        try:
            answer = StandIn(**{**json.loads((root / f"{key}.json").read_text()), "cached": True})
            if not answer.ok or (Path(answer.folder) / "config.json").is_file():
                return answer
        except (OSError, ValueError, TypeError):
            pass
    folder = root / (key or "uncached") / "draft"
    request = {"argv": argv, "folder": str(folder)}
    answer = _run(python, request, timeout)
    if key is not None and not answer.failed:
        try:
            atomic_write_json(root / f"{key}.json", asdict(answer))
        except OSError:
            pass   # the answer stands; only the next doctor asks again
    return answer


def _run(python: str, request: dict, timeout: float) -> StandIn:
    """One pipeline.train.draft_shape process."""
    Path(request["folder"]).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagle-panel-draft-shape-") as tmp:
        out = Path(tmp) / "out.json"
        try:
            p = subprocess.run([python, "-m", "pipeline.train.draft_shape", str(out)],
                               input=json.dumps(request), capture_output=True, text=True,
                               timeout=timeout, cwd=str(PROJECT_ROOT), check=False,
                               env={**os.environ, **OFFLINE})
        except subprocess.TimeoutExpired:
            return StandIn(False, failed=f"speculators took over {timeout:.0f} s to answer")
        try:
            got = json.loads(out.read_text())
        except (OSError, ValueError):
            tail = (p.stderr or p.stdout)[-600:]
            return StandIn(False, failed=f"speculators stopped without an answer: {tail}")
    return StandIn(got["ok"], request["folder"] if got["ok"] else "", got["error"], got["step"],
                   got["import_s"], got["seconds"])
