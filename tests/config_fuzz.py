"""Hostile input, the kinds a new user (or a damaged disk) gives, in five
families: config values (wrong types, unknown keys, typos, negative / huge /
non-finite / meaningless numbers, missing files, GPUs not there, escaping
run names, server flags eagle-panel owns), config files (empty, binary,
non-UTF-8, broken TOML, generated damage of the bundled config, folders,
devices, FIFOs), CLI arguments (run ids that leave the runs folder, bad
options), data rows (the row normalizer: every bad row a counted RowError,
never a crash) and run-directory damage (state.json of the wrong shape,
files that are folders or links out of the run).

Every case must exit 2 (or its documented code) with a message naming the
file and the key (or line), no traceback, no file created, changed or
removed, and no process signalled. The cases run in one process
(`app.cli.main`, a launch replaced by an error: an accepted case shows as
"would launch"); tests/integration/test_fuzz.py runs them, and a few through the real
CLI where its exit status is the point. `python -m tests.config_fuzz DIR`
prints the tally by family for a note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

RUN = '[run]\nname = "t"\nruns_dir = "runs"\n'
ROOT = Path(__file__).resolve().parents[1]

VALUES, FILES, CLI, ROWS, RUNDIR = ("config values", "config files", "CLI arguments",
                                    "data rows", "run-directory damage")
FAMILIES = (VALUES, FILES, CLI, ROWS, RUNDIR)


@dataclass
class Case:
    family: str
    label: str
    needle: str                    # what the message must name
    config: bytes | None = None    # FOLDER/config.toml (None: the fuzz's valid one)
    argv: list[str] = field(default_factory=lambda: ["run"])
    code: int = 2
    file: str = "config.toml"      # the file the message must name ("": none)
    setup: typing.Callable | None = None   # (folder, sentinel pid) before the command
    row: object = None             # data rows: the row given to the normalizer
    changes: bool = False          # the command is for changing the run (cancel): not checked
    xfail: str = ""                # known not done yet, and why


def _key(section: str, key: str, value: str, needle: str | None = None):
    """One key of one section set to a bad TOML value."""
    if section == "run":
        rest = "".join(ln + "\n" for ln in RUN.splitlines()[1:] if not ln.startswith(key + " "))
        return f"[run]\n{rest}{key} = {value}\n", needle or f"run.{key}"
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
    ("stages.train", "draft_layer", '"lama"'), ("stages.extract", "hidden_states_dtype", '"fp16"'),
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
    ("cluster", "lost_after_s", "0"), ("cluster", "collective_timeout_s", "0"),
    ("cluster", "rendezvous_timeout_s", "-1"), ("cluster", "min_nodes", "-1"),
    ("stages.train", "ranks_per_node", "-2"),
    # zero where zero means nothing: a rate, a frequency, a timeout
    ("stages.train", "lr", "0"), ("stages.train", "checkpoint_freq", "0"),
    ("stages.train", "log_freq", "0"), ("stages.train", "online_max_inflight", "0"),
    ("stages.prepare", "render_timeout_s", "0"),
    ("stages.extract", "startup_timeout_s", "0"), ("stages.extract", "request_timeout_s", "0"),
    ("stages.evaluate", "startup_timeout_s", "0"), ("stages.evaluate", "request_timeout_s", "0"),
    ("stages.regenerate", "startup_timeout_s", "0"), ("stages.regenerate", "stall_after_s", "0"),
    ("stages.extract", "stall_after_s", "0"), ("stages.extract", "max_inflight", "0"),
    ("stages.evaluate", "num_speculative_tokens", "0"), ("stages.evaluate", "concurrency", "0"),
    ("stages.regenerate", "concurrency", "0"), ("stages.regenerate", "max_tokens", "0"),
    ("stages.evaluate", "max_tokens", "0"), ("stages.evaluate", "max_prompts", "0"),
    ("stages.extract", "max_num_seqs", "0"), ("stages.train", "position_decay", "-0.5"),
    ("stages.train", "ttt_steps", "0"), ("stages.extract", "gpu_memory_utilization", "0"),
    ("gpus", "memory_gb", "-1"), ("stages.train", "keep_generated_gb", "-1"),
    # no validation sample left; a process count past any machine
    ("stages.train", "train_ratio", "1.0"), ("stages.extract", "workers", "100000"),
    # text that says nothing, or is not what it must be
    ("data", "path", '""'), ("data", "path", '"  "'), ("run", "runs_dir", '""'),
    ("stages.prepare", "render_endpoint", '"not a url"'),
    ("stages.prepare", "render_endpoint", '"ftp://host:1"'),
]
# whole snippets: (TOML after [run], what the error must name)
SNIPPETS = [
    ("[stages.evaluate]\nnum_speculative_tokens = 3\nmin_acceptance = 4.5\n",
     "stages.evaluate.min_acceptance"),
    ("[stages.evaluate]\nnum_speculative_tokens = 1\nmin_acceptance = 2.01\n",
     "stages.evaluate.min_acceptance"),
    ("[stages.prepare]\nseq_length = 2048\n[stages.train]\ntotal_seq_len = 1024\n",
     "stages.train.total_seq_len"),
    ('[stages.extract]\nserver_args = ["--host", "0.0.0.0"]\n', "stages.extract.server_args"),
    ('[stages.extract]\nserver_args = ["--host=0.0.0.0"]\n', "stages.extract.server_args"),
    ('[stages.evaluate]\nserver_args = ["--port", "80"]\n', "stages.evaluate.server_args"),
    ('[stages.evaluate]\nserver_args = ["--api-key", "k"]\n', "stages.evaluate.server_args"),
    ('[stages.regenerate]\nserver_args = ["--api_key=k"]\n', "stages.regenerate.server_args"),
    ('[stages.extract]\nserver_args = ["--uds", "/tmp/s"]\n', "stages.extract.server_args"),
    ('[stages.extract]\nserver_args = ["--HOST", "::"]\n', "stages.extract.server_args"),
    ('[stages.extract]\nserver_args = ["--hos", "0.0.0.0"]\n', "stages.extract.server_args"),
    ('[stages.extract]\nserver_args = ["--max-num-seqs", "4", "--port=1"]\n',
     "stages.extract.server_args"),
    ('[runtime]\nenv = { VLLM_SERVER_DEV_MODE = "1" }\n', "runtime.env"),
    ('[stages.evaluate]\nenv = { VLLM_SERVER_DEV_MODE = "true" }\n', "stages.evaluate.env"),
    ('[stages.extract]\noverride_server_flags = "yes"\n', "stages.extract.override_server_flags"),
    ('[runtime]\npython = "/bin/false"\n', "[runtime] python"),
    ('[runtime]\npython = "/dev/null"\n', "runtime.python"),
    ("[cluster]\nnodes = 2\n", "cluster.nodes"),
    ('[pipeline]\nmode = "online"\n[cluster]\nnodes = 2\nscheduler = "slurm"\n', "cluster.nodes"),
    ("[gpus]\nregenerate = [5]\n", "gpus.regenerate"),
    ('[model]\ntarget = "builtin:tiny-llama"\nrevision = "main"\n', "model.revision"),
    ('[model]\ntarget = "builtin:nothere"\n', "model.target"),
    ('[stages.evaluate]\nprompts = "mt-bnech"\n', "stages.evaluate.prompts"),
]
UNKNOWN = [
    (RUN + "\n[stages.trian]\nepochs = 3\n", "stages.trian"),
    (RUN + "\n[trian]\nx = 1\n", "trian"),
    (RUN + "\n[stages.train]\nepoch = 3\n", "stages.train.epoch"),
    ('[run]\nnmae = "t"\n', "run.nmae"),
    (RUN + "\n[gpu]\ndevices = []\n", "gpu"),
    (RUN + '\n[model]\ntarge = "x"\n', "model.targe"),
    (RUN + "\n[stages]\ntrain = 3\n", "stages.train"),
    (RUN + "\n[stages.extract]\nserver_arg = []\n", "stages.extract.server_arg"),
    (RUN + "\n[runtime]\npyhton = \"x\"\n", "runtime.pyhton"),
    (RUN + "\nsource = \"x\"\n", "run.source"),
    (RUN + "\n[stages.train]\nsource = 1\n", "stages.train.source"),
    (RUN + "\n[stages.train.deep]\nx = 1\n", "stages.train.deep"),
]
MISSING = [
    ("model", "target", '"models/nothere"', "models/nothere"),
    ("data", "path", '"my data/çà.jsonl"', "my data/çà.jsonl"),
    ("model", "target", '"模型/目标"', "模型/目标"),
    ("data", "path", '"builtin:conversation"', "data.path"),
    ("stages.evaluate", "prompts", '"held out.jsonl"', "held out.jsonl"),
    ("runtime", "python", '"/nonexistent/bin/python"', "runtime.python"),
    ("runtime", "vllm_python", '"/tmp"', "runtime.vllm_python"),
    ("data", "path", '"~/surely-not-here.jsonl"', "data.path"),
]
RUNS_DIRS = [   # [run] runs_dir that cannot hold runs: a file, a device
    ('[run]\nname = "t"\nruns_dir = "config.toml"\n', "runs_dir"),
    ('[run]\nname = "t"\nruns_dir = "/dev/null"\n', "runs_dir"),
]
GPUS = [
    # (a GPU this machine lacks is doctor's launch check: its lines, not the file's)
    (RUN + "\n[gpus]\ndevices = [99]\n", "[gpus] devices"),
    (RUN + "\n[gpus]\ndevices = [0, 0]\n", "gpus.devices"),
    (RUN + "\n[gpus]\ndevices = [0]\nextract = [3]\n", "gpus.extract"),
]
NAMES = ["a/b", "..", "../escape", ".hidden", "", "a\\\\b", "tab\\tname", "/abs", "nul\\u0001",
         "x" * 300]
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
    ("UTF-16", RUN.encode("utf-16"), "config.toml"),
    ("a JSON file", b'{"run": {"name": "t"}}', "line"),
    ("a YAML file", b"run:\n  name: t\n", "line"),
    ("a run table that is a value", b'run = "t"\n', "run"),
]


def _wrong_value(tp) -> str | None:
    """A TOML value of another type than `tp` (None: nothing to give)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if origin is typing.Literal:   # a choice: a value of another type than its choices'
        tp, origin = type(typing.get_args(tp)[0]), None
    if origin is list:
        return '"a"' if typing.get_args(tp)[0] is int else "[1]"
    if origin is dict:
        return "[1]"
    return {bool: '"yes"', int: '"3"', float: '"0.5"', str: "7"}.get(tp)


def _sections():
    """(TOML section, its dataclass) for every section of the config."""
    from pipeline import config as c
    out = []
    for f in dataclasses.fields(c.Config):
        tp = typing.get_type_hints(c.Config).get(f.name)
        if f.name == "stages":
            for s in dataclasses.fields(c.StagesSection):
                out.append((f"stages.{s.name}", typing.get_type_hints(c.StagesSection)[s.name]))
        elif dataclasses.is_dataclass(tp):
            out.append((f.name, tp))
    return out


def generated_values() -> list[tuple[str, str, str]]:
    """Every key of every section: a value of the wrong type; every number:
    negative (but the -1 = auto ones) and far too large."""
    out = []
    for section, cls in _sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            bad = _wrong_value(tp)
            if bad is not None:
                out.append((section, f.name, bad))
            if tp in (int, float):
                floor = f.metadata.get("floor", 0)   # (-1 where -1 means auto)
                out.append((section, f.name, str(floor - 1)))
                out.append((section, f.name, "10_000_000_000_000" if tp is int else "1e13"))
    return out


def value_cases() -> list[Case]:
    out = []
    for group, items in (("wrong type", WRONG_TYPES + generated_values()),
                         ("one letter off", TYPOS), ("number", NUMBERS)):
        for section, key, value in items:
            text, needle = _key(section, key, value)
            out.append(Case(VALUES, f"{group}: {section}.{key} = {value}", needle, text.encode()))
    for text, needle in SNIPPETS:
        # (an interpreter that does not run is doctor's launch check: its lines, not the file's)
        out.append(Case(VALUES, f"snippet: {text.strip()!r}", needle, (RUN + "\n" + text).encode(),
                        file="" if "/bin/false" in text else "config.toml"))
    for text, needle in UNKNOWN:
        out.append(Case(VALUES, f"unknown: {needle}", needle, text.encode()))
    for section, key, value, needle in MISSING:
        text, _ = _key(section, key, value, needle)
        out.append(Case(VALUES, f"missing: {section}.{key} = {value}", needle, text.encode()))
    for text, needle in RUNS_DIRS:
        # (checked where the runs are looked for: it names the key and the path, not the file)
        out.append(Case(VALUES, f"runs_dir: {text.splitlines()[-1]}", needle, text.encode(),
                        file=""))
    for text, needle in GPUS:
        out.append(Case(VALUES, f"GPUs: {text.splitlines()[-1]}", needle, text.encode(),
                        file="" if needle.startswith("[gpus]") else "config.toml"))
    for name in NAMES:
        text = f'[run]\nname = "{name}"\nruns_dir = "runs"\n'
        out.append(Case(VALUES, f"run name {name!r}", "run.name", text.encode()))
    return _dedupe(out)


def _dedupe(cases: list[Case]) -> list[Case]:
    seen, out = set(), []
    for c in cases:
        if (c.config, tuple(c.argv)) not in seen:
            seen.add((c.config, tuple(c.argv)))
            out.append(c)
    return out


# -- config files ------------------------------------------------------------

def _damaged(text: str, kind: str, rng: random.Random) -> bytes:
    """The bundled config.toml with one kind of damage at a random place."""
    lines = text.splitlines(keepends=True)
    headers = [i for i, ln in enumerate(lines) if ln.startswith("[")]
    strings = [i for i, ln in enumerate(lines) if '= "' in ln.split("#")[0]]
    i = rng.choice(headers[1:] if kind == "duplicate table" else headers)
    if kind == "NUL byte":
        at = rng.randrange(len(text))
        return (text[:at] + "\x00" + text[at:]).encode()
    if kind == "invalid UTF-8":
        at = rng.randrange(len(text))
        return text[:at].encode() + b"\xc3\x28" + text[at:].encode()
    if kind == "duplicate table":
        return "".join(lines + ["\n", lines[i]]).encode()
    if kind == "broken header":
        lines[i] = lines[i].replace("]", "", 1)
    elif kind == "unterminated string":
        j = rng.choice(strings)
        end = lines[j].index('"', lines[j].index('= "') + 3)   # the value's closing quote
        lines[j] = lines[j][:end] + lines[j][end + 1:]
    return "".join(lines).encode()


DAMAGE = {"NUL byte": "NUL", "invalid UTF-8": "UTF-8", "duplicate table": "line",
          "broken header": "line", "unterminated string": "line"}


def _fifo(folder: Path, _pid) -> None:
    os.mkfifo(folder / "fifo.toml")


def _binary(folder: Path, _pid) -> None:
    (folder / "binary.toml").write_bytes(bytes(range(256)) * 4)


def _loop(folder: Path, _pid) -> None:
    (folder / "loop.toml").symlink_to(folder / "loop.toml")


def file_cases() -> list[Case]:
    out = [Case(FILES, label, needle, data) for label, data, needle in SYNTAX]
    text = (ROOT / "config.toml").read_text()
    for kind, needle in DAMAGE.items():
        for seed in range(6):
            out.append(Case(FILES, f"bundled config, {kind} (seed {seed})", needle,
                            _damaged(text, kind, random.Random(seed))))
    named = [("--config \"\"", [""], "--config", ""),
             ("--config  (blank)", ["  "], "--config", ""),
             ("--config a folder", ["."], "folder", ""),
             ("--config /dev/null", ["/dev/null"], "/dev/null", "/dev/null"),
             ("--config /dev/zero", ["/dev/zero"], "/dev/zero", "/dev/zero"),
             ("--config missing", ["nothere.toml"], "not found", "nothere.toml"),
             ("--config a FIFO", ["fifo.toml"], "regular file", "fifo.toml"),
             ("--config a link to itself", ["loop.toml"], "loop.toml", "loop.toml")]
    named.append(("--config a binary file", ["binary.toml"], "binary.toml", "binary.toml"))
    for label, value, needle, file in named:
        setup = {"fifo.toml": _fifo, "loop.toml": _loop, "binary.toml": _binary}.get(value[0])
        for command in (["run"], ["status"], ["doctor"], ["runs"]):
            out.append(Case(FILES, f"{label} {command[0]}", needle, argv=["--config", *value,
                            *command], file=file, setup=setup))
    out.append(Case(FILES, "doctor --json on a bad config", "{", b"[run]\nname = 3\n",
                    argv=["doctor", "--json"], file=""))
    return out


# -- CLI arguments -----------------------------------------------------------

def cli_cases() -> list[Case]:
    out = []
    for rid in ("../../elsewhere/x", "/abs/path", "..", ".hidden", "a/b", "", ".", "x\ny",
                "../t", "t/../../x", "a\\b", "x" * 300):
        out.append(Case(CLI, f"run --run {rid!r}", "--run", argv=["run", "--run", rid], file=""))
    for argv, needle in (
        (["run", "--stage", "trian"], "trian"), (["status", "nosuchrun"], "nosuchrun"),
        (["logs", "t", "trian"], "trian"), (["logs", "t", "train", "-n", "x"], "-n"),
        (["logs", "t", "extract", "--server", "9"], "9"), (["cancel", "--stage", "x"], "x"),
        (["cancel", "t", "--grace", "abc"], "--grace"), (["resume", "nosuchrun"], "nosuchrun"),
        (["bogus"], "bogus"), (["run", "--frobnicate"], "--frobnicate"),
        (["--runs-dir", "", "runs"], "--runs-dir"), (["--runs-dir", "config.toml", "runs"],
                                                     "--runs-dir"),
        (["--runs-dir", "nothere", "status"], "nothere"), (["status", "t", "--json", "x"], "x"),
        (["status", "/etc"], "/etc"), (["logs", "../..", "train"], ".."),
        (["cancel", "t", "--grace", "-1"], "--grace"), (["logs", "t", "train", "-n", "-5"], "-n"),
        # an empty id is refused like a blank one (never "the newest run")
        (["status", ""], "RUN ''"), (["cancel", ""], "RUN ''"), (["resume", ""], "RUN ''"),
        # numbers the panel takes, out of range: refused before it opens
        (["--simulate-gpus", "-3"], "--simulate-gpus"), (["--interval", "0"], "--interval"),
        (["--refresh", "nan"], "--refresh"), (["ui", "--interval", "-1"], "--interval"),
    ):
        out.append(Case(CLI, "eagle-panel " + " ".join(map(repr, argv)), needle, argv=argv,
                        file=""))
    return out


# -- data rows -----------------------------------------------------------------

ROWS_BAD = [
    None, 3, "text", [], {}, {"messages": None}, {"messages": "hi"}, {"messages": []},
    {"messages": [1, 2]}, {"messages": [{"content": "x"}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]},
                  {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]},
                  {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": [{"text": ["nested"]}]},
                  {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": "only a question"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": {"a": 1}}]},
    {"messages": [{"role": 7, "content": "q"}, {"role": "assistant", "content": "a"}]},
    {"conversations": [{"from": "human", "value": 1}, {"from": "gpt", "value": "a"}]},
    {"conversations": "x"}, {"conversations": [{"value": "x"}]},
    {"input_ids": [1, 2], "loss_mask": [1]}, {"input_ids": [], "loss_mask": []},
    {"input_ids": ["a"], "loss_mask": [1]}, {"input_ids": 5, "loss_mask": 5},
    {"input_ids": [1.5], "loss_mask": [1]},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "a", "tool_calls": "notjson{"}]},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "a", "tool_calls": 5}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "tools": "notjson{"},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "tools": 5},
]


def row_cases() -> list[Case]:
    return [Case(ROWS, f"row {json.dumps(r)[:70]}", "", row=r, file="", argv=[])
            for r in ROWS_BAD]


# -- run-directory damage -------------------------------------------------------

def _state_edit(edit):
    """A setup that copies the fuzz's finished run "t" to "d" and edits its state.json."""
    def setup(folder: Path, pid: int) -> None:
        d = folder / "runs" / "d"
        shutil.copytree(folder / "runs" / "t", d, symlinks=True)
        for lock in d.glob("*.lock"):
            lock.unlink()
        p = d / "state.json"
        state = json.loads(p.read_text())
        new = edit(state, pid)
        p.write_bytes(new if isinstance(new, bytes) else json.dumps(new).encode())
    return setup


def _files_edit(edit):
    def setup(folder: Path, pid: int) -> None:
        d = folder / "runs" / "d"
        shutil.copytree(folder / "runs" / "t", d, symlinks=True)
        edit(d, folder)
    return setup


def _set(path: str, value):
    def edit(state, pid):
        keys = path.split(".")
        node = state
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value(pid) if callable(value) else value
        return state
    return edit


def _running_as(pid_field: str):
    """train marked running with the sentinel's pid and no start time:
    nothing may signal it (its identity cannot be verified)."""
    def edit(state, pid):
        st = state["stages"]["train"]
        st.update(status="running", pid=None, pgid=None, create_time=None,
                  supervisor_pid=None, supervisor_create_time=None)
        st[pid_field] = pid
        if pid_field == "pid":
            st["pgid"] = pid
        return state
    return edit


def _dir_instead(name: str):
    def edit(d: Path, _folder: Path) -> None:
        p = d / name
        if p.exists():
            p.unlink()
        p.mkdir()
    return edit


def _link_out(name: str):
    def edit(d: Path, folder: Path) -> None:
        (folder / "secret.txt").write_text("another user's file\n")
        p = d / name
        if p.exists():
            p.unlink()
        p.symlink_to(folder / "secret.txt")
    return edit


STATE_DAMAGE = [
    ("state.json not JSON", lambda s, p: b"{not json", ["status", "resume", "cancel"]),
    ("state.json empty", lambda s, p: b"", ["status", "resume"]),
    ("state.json a list", lambda s, p: [], ["status", "resume", "cancel"]),
    ("state.json stages a string", _set("stages", "x"), ["status", "resume", "cancel"]),
    ("a stage entry a string", _set("stages.train", "done"), ["status", "resume"]),
    ("a stage entry a number", _set("stages.extract", 3), ["status", "status --json"]),
    ("created_at a word", _set("created_at", "yesterday"), ["status", "resume"]),
    ("started_at a word", _set("stages.train.started_at", "noon"), ["status", "status --json"]),
    ("ended_at a list", _set("stages.train.ended_at", [1]), ["status"]),
    ("attempt a string", _set("stages.train.attempt", "2"), ["status", "resume"]),
    ("status unknown", _set("stages.train.status", "exploded"), ["status", "resume"]),
    ("status a number", _set("stages.train.status", 1), ["status"]),
    ("pid a string", _set("stages.train.pid", "123"), ["status", "cancel"]),
    ("devices a string", _set("stages.train.devices", "0"), ["status"]),
    ("driver a string", _set("driver", "me"), ["status", "resume"]),
    ("slurm_job on a local run", _set("stages.train.slurm_job", 12345), ["status", "resume"]),
]
FILE_DAMAGE = [
    ("events.jsonl a folder", _dir_instead("train/events.jsonl"), ["status --json"],
     "events.jsonl"),
    ("stage.log a folder", _dir_instead("train/stage.log"), ["logs train"], "stage.log"),
    ("stage.log a link out of the run", _link_out("train/stage.log"), ["logs train"],
     "stage.log"),
    ("config.toml a folder", _dir_instead("config.toml"), ["resume"], "config.toml"),
    ("state.json a folder", _dir_instead("state.json"), ["status", "resume"], "state.json"),
    ("train/out removed", lambda d, f: shutil.rmtree(d / "train" / "out"), ["status"], "train"),
]
# Known not done yet: label -> why (each shown as xfail by tests/integration/test_fuzz.py)
XFAIL: dict[str, str] = {}
# Answered with exit 0 on purpose, and what the answer must say: a succeeded
# stage whose outputs were deleted is listed as such, not as succeeded.
ANSWERED = {"train/out removed: status": (0, "outputs missing", "")}


def rundir_cases() -> list[Case]:
    out = []
    for label, edit, commands in STATE_DAMAGE:
        for command in commands:
            out.append(Case(RUNDIR, f"{label}: {command}", "state.json", argv=[
                *command.split()[:1], "d", *command.split()[1:]], setup=_state_edit(edit),
                file="state.json"))
    for label, edit, commands, needle in FILE_DAMAGE:
        for command in commands:
            words, name = command.split(), f"{label}: {command}"
            code, said, file = ANSWERED.get(name, (2, needle, needle))
            out.append(Case(RUNDIR, name, said, argv=[words[0], "d", *words[1:]],
                            setup=_files_edit(edit), code=code, file=file,
                            xfail=XFAIL.get(name, "")))
    return out


# Accepted on purpose (each is the documented behaviour; the report lists why).
ACCEPTED = [
    # "-" is a plain folder name, as `[run] name = "-"` is: a run of that name is started
    Case(CLI, "run --run '-' (a plain name)", "", argv=["run", "--run", "-"], code="would launch",
         file="", changes=True),
    # likewise "~": never expanded (a run id is a folder name under runs_dir, not a path)
    Case(CLI, "run --run '~' (a plain name)", "", argv=["run", "--run", "~"], code="would launch",
         file="", changes=True),
    # an older run's state.json lacks a stage added since (regenerate): it reads as pending,
    # in memory only; resume then runs it (that is what "not run yet" means)
    Case(RUNDIR, "a stage missing (an older run): status", "", argv=["status", "d"], code=0,
         file="", setup=_state_edit(lambda s, p: {**s, "stages": {
             k: v for k, v in s["stages"].items() if k != "train"}})),
    Case(RUNDIR, "a stage missing (an older run): resume", "", argv=["resume", "d"],
         code="would launch", file="", changes=True, setup=_state_edit(lambda s, p: {
             **s, "stages": {k: v for k, v in s["stages"].items() if k != "train"}})),
    # a running stage whose recorded pid has no start time: its identity cannot be
    # verified, so nothing is signalled ("sent nothing") and cancel records it (exit 0)
    *[Case(RUNDIR, f"running, {what} of another process, no start time: {cmd}", "sent nothing",
           argv=cmd.split()[:1] + ["d"] + cmd.split()[1:], code=0, file="", changes=True,
           setup=_state_edit(_running_as(fld)))
      for what, fld, cmd in (("pid", "pid", "cancel"), ("pid", "pid", "cancel --stage train"),
                             ("supervisor pid", "supervisor_pid", "cancel"))],
]


def cases() -> list[Case]:
    return value_cases() + file_cases() + cli_cases() + row_cases() + rundir_cases() + ACCEPTED


# -- running them ------------------------------------------------------------------

class WouldLaunch(Exception):
    """A case got as far as starting a driver: it was accepted."""


def tree_hash(folder: Path, skip=("config.toml",)) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.parent == folder and p.name in skip:
            continue
        st = p.lstat()
        h.update(f"{p.relative_to(folder)} {st.st_mode} {st.st_size} {st.st_mtime_ns}".encode())
        if p.is_file() and not p.is_symlink():
            with contextlib.suppress(OSError):
                h.update(p.read_bytes())
    return h.hexdigest()


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """app.cli.main in this process: (exit code, stdout, stderr); a traceback
    is an exception's, in stderr; a launch is WouldLaunch's."""
    import traceback

    from app import cli
    # (binary underneath: `logs` writes bytes to sys.stdout.buffer)
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="replace")
                for _ in range(2))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:   # argparse
            code = e.code if isinstance(e.code, int) else 2
        except WouldLaunch:
            code = "would launch"
        except BaseException:  # noqa: BLE001 - the point: what a user would see
            traceback.print_exc()
            code = "traceback"
    return code, _text(out), _text(err)


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8", "replace")


def check_row(row) -> str | None:
    """A bad row must be a RowError (skipped and counted), never a crash."""
    from pipeline.data.chat_mask import RowError, normalize
    try:
        normalize(row)
    except RowError:
        return None
    except Exception as e:  # noqa: BLE001
        return f"crashed: {type(e).__name__}: {e}"
    return "accepted"


def verdict(case: Case, code, out: str, err: str) -> str | None:
    """Why a case's answer is wrong, or None."""
    if code == "would launch" and case.code != "would launch":
        return "accepted (would launch)"
    if "Traceback" in err or code == "traceback":
        return "a traceback"
    if code != case.code:
        return f"exit {code}"
    said = err or out
    if case.family in (VALUES, FILES) and case.config is not None and "\n\n" in err.strip():
        return "more than one paragraph"
    if case.file and case.file not in said:
        return f"does not name the file {case.file!r}"
    if case.needle and case.needle not in said:
        return f"does not name {case.needle!r}"
    return None


def run_case(case: Case, folder: Path, base: bytes, sentinel: int) -> str | None:
    """Run one case in `folder`; why it is wrong, or None."""
    if case.family == ROWS:
        return check_row(case.row)
    (folder / "config.toml").write_bytes(base if case.config is None else case.config)
    try:
        if case.setup:
            case.setup(folder, sentinel)
        before = tree_hash(folder)
        code, out, err = run_cli(case.argv)
        if not _alive(sentinel):
            return "signalled an unrelated process"
        why = verdict(case, code, out, err)
        if why is None and not case.changes and tree_hash(folder) != before:
            why = "changed files"
        return why
    finally:
        _cleanup(folder)


def _cleanup(folder: Path) -> None:
    """Remove what a case set up (and what an accepted one created)."""
    for run in (folder / "runs").iterdir():
        if run.name != "t":
            shutil.rmtree(run, ignore_errors=True)
    for name in ("fifo.toml", "loop.toml", "secret.txt"):
        with contextlib.suppress(OSError):
            (folder / name).unlink()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@contextlib.contextmanager
def in_folder(folder: Path):
    """cwd = folder, and a launch raises WouldLaunch instead of starting a driver."""
    from pipeline.drive import driver
    old_cwd, real = Path.cwd(), driver.start_driver

    def refuse(*a, **k):
        raise WouldLaunch()
    driver.start_driver = refuse
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        driver.start_driver = real


def sentinel_process() -> subprocess.Popen:
    """An unrelated live process whose pid damaged runs record: never signalled."""
    return subprocess.Popen(["sleep", "3600"], start_new_session=True)


def tally(results: list[tuple[Case, str | None]]) -> dict[str, dict[str, int]]:
    out = {f: {"tried": 0, "refused": 0, "accepted": 0, "wrong": 0} for f in FAMILIES}
    for case, why in results:
        t = out[case.family]
        t["tried"] += 1
        if why is None:
            t["accepted" if case in ACCEPTED else "refused"] += 1
        else:
            t["wrong"] += 1   # (wrongly accepted ones too: "accepted (would launch)")
    return out


def try_all(folder: Path, base: bytes) -> list[tuple[Case, str | None]]:
    proc = sentinel_process()
    try:
        with in_folder(folder):
            return [(c, run_case(c, folder, base, proc.pid)) for c in cases()]
    finally:
        (folder / "config.toml").write_bytes(base)
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    results = try_all(Path(sys.argv[1]).resolve(), (Path(sys.argv[1]) / "config.toml").read_bytes())
    for case, why in results:
        if why:
            print(f"WRONG  [{case.family}] {case.label}: {why}")
    for family, t in tally(results).items():
        print(f"{family:22} tried {t['tried']:4}  refused {t['refused']:4}  accepted "
              f"{t['accepted']:3} (on purpose)  wrong {t['wrong']:3}")
