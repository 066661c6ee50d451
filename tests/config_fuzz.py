"""Malformed configs, the kinds people write: wrong types, unknown keys and
sections, enum values one letter off, negative / huge / non-finite numbers,
missing files (with spaces and non-ASCII in their paths), GPUs the machine
does not have, run names that escape the runs folder, empty, binary and
non-UTF-8 files, broken TOML.

Each case is (label, bytes of the file, what the error must name). Every
one of them must make `eagle-panel run` exit 2 with one paragraph naming
the file and the key (or line), and touch nothing on disk; the test is
tests/test_config.py::test_config_fuzz, and `python -m tests.config_fuzz
DIR` prints the tally for a note.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

RUN = '[run]\nname = "t"\nruns_dir = "runs"\n'


def _key(section: str, key: str, value: str, needle: str | None = None):
    """One key of one section set to a bad TOML value."""
    if section == "run":
        return RUN + f"{key} = {value}\n", needle or f"run.{key}"
    return RUN + f"\n[{section}]\n{key} = {value}\n", needle or f"{section}.{key}"


# (section, key, a value of the wrong type)
WRONG_TYPES = [
    ("stages.train", "epochs", '"3"'), ("stages.train", "lr", '"1e-4"'),
    ("run", "shared", '"yes"'), ("gpus", "devices", "0"),
    ("stages.extract", "layer_ids", '["1", "2"]'), ("runtime", "env", "{ A = 1 }"),
    ("model", "trust_remote_code", "1"), ("data", "max_samples", "1.5"),
    ("stages.evaluate", "baseline", '"false"'), ("stages.extract", "server_args", '"--x"'),
    ("stages.prepare", "seq_length", "true"), ("pipeline", "mode", "1"),
]
# (section, key, a value one letter off a valid choice)
TYPOS = [
    ("stages.extract", "backend", '"vllm-sever"'), ("pipeline", "mode", '"onlin"'),
    ("model", "dtype", '"bfloat61"'), ("data", "format", '"sharegtp"'),
    ("stages.train", "loss", '"fusde"'), ("stages.train", "attention", '"flx"'),
    ("stages.evaluate", "checkpoints", '"lats"'), ("cluster", "scheduler", '"slurn"'),
]
# (section, key, an out-of-range number)
NUMBERS = [
    ("stages.train", "epochs", "-1"), ("stages.train", "lr", "-0.1"),
    ("stages.extract", "batch_tokens", "10_000_000_000_000"), ("data", "max_samples", "-5"),
    ("stages.extract", "min_free_gb", "inf"), ("stages.train", "lr", "nan"),
    ("stages.prepare", "seq_length", "0"), ("stages.extract", "gpu_memory_utilization", "1.5"),
    ("stages.train", "train_ratio", "0"), ("runtime", "cancel_grace_s", "-1"),
    ("stages.evaluate", "temperature", "-0.5"), ("stages.extract", "layer_ids", "[2, -1]"),
    ("stages.extract", "tensor_parallel", "0"),
    ("stages.vocab", "draft_vocab_size", "99_999_999_999_999"),
    ("stages.train", "dataloader_workers", "-2"), ("stages.train", "lr", "1e400"),
    ("cluster", "nodes", "2"), ("cluster", "nodes", "0"), ("cluster", "gpus_per_node", "-8"),
    ("cluster", "lost_after_s", "0"),
]
UNKNOWN = [
    (RUN + "\n[stages.trian]\nepochs = 3\n", "stages.trian"),
    (RUN + "\n[trian]\nx = 1\n", "trian"),
    (RUN + "\n[stages.train]\nepoch = 3\n", "stages.train.epoch"),
    ('[run]\nnmae = "t"\n', "run.nmae"),
    (RUN + "\n[gpu]\ndevices = []\n", "gpu"),
    (RUN + '\n[model]\ntarge = "x"\n', "model.targe"),
    (RUN + "\n[stages]\ntrain = 3\n", "stages.train"),
]
MISSING = [
    ("model", "target", '"models/nothere"', "models/nothere"),
    ("data", "path", '"my data/çà.jsonl"', "my data/çà.jsonl"),
    ("model", "target", '"模型/目标"', "模型/目标"),
    ("data", "path", '"builtin:conversation"', "data.path"),
    ("stages.evaluate", "prompts", '"held out.jsonl"', "held out.jsonl"),
    ("runtime", "python", '"/nonexistent/bin/python"', "runtime.python"),
    ("runtime", "vllm_python", '"/tmp"', "runtime.vllm_python"),
]
GPUS = [
    (RUN + "\n[gpus]\ndevices = [99]\n", "gpus.devices"),
    (RUN + "\n[gpus]\ndevices = [0, 0]\n", "gpus.devices"),
    (RUN + "\n[gpus]\ndevices = [0]\nextract = [3]\n", "gpus.extract"),
]
NAMES = ["a/b", "..", "../escape", ".hidden", "", "a\\\\b", "tab\\tname"]
SYNTAX = [
    ("empty", b"", "empty"),
    ("whitespace only", b"  \n\n\t\n", "empty"),
    ("binary", bytes(random.Random(0).randrange(256) for _ in range(512)), "config.toml"),
    ("NUL bytes", RUN.encode() + b"\x00\x00", "NUL"),
    ("invalid UTF-8", RUN.encode() + b'\n[data]\npath = "\xff\xfe"\n', "UTF-8"),
    ("unterminated string", b'[run]\nname = "t\n', "line"),
    ("duplicate key", b'[run]\nname = "t"\nname = "u"\n', "line"),
    ("broken header", b'[run\nname = "t"\n', "line"),
    ("duplicate table", (RUN + "\n[run]\nshared = true\n").encode(), "line"),
    ("value without key", (RUN + "\n= 3\n").encode(), "line"),
]


def cases() -> list[tuple[str, bytes, str]]:
    out = []
    for group, items in (("wrong type", WRONG_TYPES), ("one letter off", TYPOS),
                         ("number", NUMBERS)):
        for section, key, value in items:
            text, needle = _key(section, key, value)
            out.append((f"{group}: {section}.{key} = {value}", text.encode(), needle))
    for text, needle in UNKNOWN:
        out.append((f"unknown: {needle}", text.encode(), needle))
    for section, key, value, needle in MISSING:
        text, _ = _key(section, key, value, needle)
        out.append((f"missing: {section}.{key} = {value}", text.encode(), needle))
    for text, needle in GPUS:
        out.append((f"GPUs: {text.splitlines()[-1]}", text.encode(), needle))
    for name in NAMES:
        text = f'[run]\nname = "{name}"\nruns_dir = "runs"\n'
        out.append((f"run name {name!r}", text.encode(), "run.name"))
    out.extend(SYNTAX)
    return out


def try_all(folder: Path, python: str = sys.executable, env=None):
    """Write each case to FOLDER/config.toml and run `eagle-panel run`;
    returns [(label, exit code, stderr, needle)]."""
    results = []
    for label, data, needle in cases():
        (folder / "config.toml").write_bytes(data)
        p = subprocess.run([python, "-m", "app.cli", "run"], cwd=folder, capture_output=True,
                           env=env, timeout=60, check=False)
        results.append((label, p.returncode, p.stderr.decode("utf-8", "replace"), needle))
    return results


def verdict(code: int, err: str, needle: str) -> str | None:
    """Why a case's answer is wrong, or None: exit 2, one paragraph that names
    the file and the key (or line), no traceback."""
    if code != 2:
        return f"exit {code}"
    if "Traceback" in err:
        return "a traceback"
    if "\n\n" in err.strip():
        return "more than one paragraph"
    if "config.toml" not in err:
        return "does not name the file"
    if needle not in err:
        return f"does not name {needle!r}"
    return None


if __name__ == "__main__":
    import os
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    results = try_all(Path(sys.argv[1]), env=env)
    bad = [(label, why) for label, code, err, needle in results
           if (why := verdict(code, err, needle))]
    for label, why in bad:
        print(f"WRONG  {label}: {why}")
    print(f"{len(results) - len(bad)} of {len(results)} malformed configs rejected as they "
          "should be (exit 2, one paragraph naming the file and the key or line)")
    sys.exit(1 if bad else 0)
