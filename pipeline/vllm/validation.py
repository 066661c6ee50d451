"""vLLM's own validation of the servers a run will start, asked before the
launch (doctor) and remembered for the launch checks.

A planned server (`Planned`: what a stage's config gives its `vllm serve`)
becomes the exact argv the stage would start (`server.serve_args`, the
function make_server uses), and pipeline.vllm.validate runs that argv
through `vllm serve` in vLLM's own interpreter up to its engine config: what
vLLM's parser, its serve checks, ModelConfig, SchedulerConfig and VllmConfig
refuse is refused here, in vLLM's words, before hours of extraction and
training. It loads no weights; most of its time is vLLM's import (10-20 s
on 2 cores), so a result is cached by what decides it: what is installed
beside vLLM, the target's config.json and the planned servers.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.paths import PROJECT_ROOT, cache_dir
from pipeline.run.rundir import atomic_write_json
from pipeline.vllm.environment import VllmEnv, process_env

# the engine config needs no weights, and a download is never doctor's to make
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Planned:
    """One server a stage will start, as its config gives it (the target's
    own flags are added from the vLLM that serves it: server.serve_args)."""
    name: str                       # what the finding calls it: "extract", "evaluate (no draft)"
    devices: tuple[int, ...]
    max_model_len: int
    flags: tuple[str, ...]          # the stage's own flags, then the section's server_args
    dtype: str
    trust_remote_code: bool = False
    env: tuple[tuple[str, str], ...] = ()   # [runtime] env and the section's env


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    error: str = ""
    seconds: float = 0.0
    step: str = "model"     # how far vLLM went: its engine "config", or the "model" built


@dataclass
class Validation:
    """vLLM's answer for each planned server, and what asking it cost."""
    results: list[Result] = field(default_factory=list)
    import_s: float = 0.0           # vLLM's import, once per environment
    seconds: float = 0.0            # the whole subprocess(es), import included
    cached: bool = False
    failed: str = ""                # the validation itself could not run (not a refusal)

    @property
    def refusals(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def part(self, names: set[str]) -> Validation:
        """The answer for the servers named (one process asked about more)."""
        return Validation([r for r in self.results if r.name in names], self.import_s,
                          self.seconds, self.cached, self.failed)

    def to_json(self) -> dict:
        return {"results": [asdict(r) for r in self.results], "import_s": self.import_s,
                "seconds": self.seconds, "failed": self.failed}

    @classmethod
    def from_json(cls, d: dict, cached: bool = False) -> Validation:
        return cls([Result(**r) for r in d.get("results", [])], d.get("import_s", 0.0),
                   d.get("seconds", 0.0), cached, d.get("failed", ""))


def installed_vllm(python: str, vllm_dir: str | None = None) -> str:
    """What is installed beside the vLLM of `python`, read from the file system
    (the dist-info folders of its site-packages, names and times; no process
    started): what the cache is keyed by, so that an install or upgrade there
    (vLLM, compressed-tensors, torch ...) asks again. `vllm_dir`: vLLM's
    package folder, where a probe found it (doctor remembers it for the
    launch checks, which probe nothing: `remembered`). "" when no vLLM is
    found there: nothing is cached then."""
    vllm_dir = vllm_dir or remembered(python)
    if vllm_dir:
        site = Path(vllm_dir).parent
    else:
        found = sorted(Path(python).absolute().parent.parent.glob(
            "lib/python3*/site-packages/vllm"))
        site = found[0].parent if found else None
    if site is None or not any(site.glob("vllm*.dist-info")):
        return ""
    h = hashlib.sha256()
    for p in sorted(site.glob("*.dist-info")):
        h.update(f"{p.name}@{p.stat().st_mtime_ns};".encode())
    return h.hexdigest()


def _where() -> dict[str, str]:
    """where.json's python -> vLLM folder entries ({} when missing or damaged:
    only speed is lost, the launch then looks in a virtual environment's layout)."""
    try:
        known = json.loads((cache_dir() / "vllm-validation" / "where.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in known.items() if isinstance(v, str)} \
        if isinstance(known, dict) else {}


def remember(python: str, vllm_dir: str | None) -> None:
    """Doctor's probe's answer to "where is this interpreter's vLLM", kept for
    the launch checks (a best effort: a cache that cannot be written is not)."""
    known = _where()
    if not vllm_dir or known.get(python) == vllm_dir:
        return
    path = cache_dir() / "vllm-validation" / "where.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**known, python: vllm_dir})
    except OSError:
        pass


def remembered(python: str) -> str | None:
    return _where().get(python)


def model_path(python: str, target: Path, vllm_dir: str | None = None) -> Path | None:
    """Where doctor records that this vLLM cannot build this target here (by
    what is installed beside it and the target's config.json), or None."""
    installed = installed_vllm(python, vllm_dir)
    try:
        config = (Path(target) / "config.json").read_bytes()
    except OSError:
        return None
    if not installed:
        return None
    key = hashlib.sha256(installed.encode() + b"\0" + config).hexdigest()[:32]
    return cache_dir() / "vllm-validation" / f"model-{key}.json"


def record_model(python: str, target: Path, refused: str | None,
                 vllm_dir: str | None = None) -> None:
    """doctor's answer on building the target's model (None: vLLM built it),
    kept for the stages: "auto" extracts on hf and evaluate is skipped where
    vLLM cannot build the target (a best effort, like the rest of the cache)."""
    path = model_path(python, target, vllm_dir)
    if path is None:
        return
    try:
        if refused is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {"refused": refused})
    except OSError:
        pass


def model_refused(python: str, target: Path, vllm_dir: str | None = None) -> str | None:
    """vLLM's words when doctor found it cannot build this target's model
    here (its kernels: Kimi-K2.5's INT4 experts on the CPU build), else None."""
    path = model_path(python, target, vllm_dir)
    try:
        said = json.loads(path.read_text()).get("refused") if path else None
    except (OSError, ValueError, AttributeError):
        return None
    return said if isinstance(said, str) and said else None


def cache_key(python: str, target: Path, servers: list[Planned],
              vllm_dir: str | None = None) -> str | None:
    """What decides vLLM's answer, hashed; None when the vLLM cannot be named."""
    installed = installed_vllm(python, vllm_dir)
    if not installed:
        return None
    try:
        config = (target / "config.json").read_bytes()
    except OSError:
        return None
    h = hashlib.sha256()
    for part in (installed, config.hex(),
                 json.dumps([asdict(s) for s in servers], sort_keys=True)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def cache_path(key: str) -> Path:
    return cache_dir() / "vllm-validation" / f"{key}.json"


def cached(key: str | None) -> Validation | None:
    """The remembered answer for `key`, or None."""
    if key is None:
        return None
    try:   # (damaged, of any shape: asked again, as if it were not there)
        return Validation.from_json(json.loads(cache_path(key).read_text()), cached=True)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def argv(env: VllmEnv, target: Path, s: Planned) -> list[str]:
    """What follows `vllm serve` for this server, as its stage would start it."""
    from pipeline.vllm.server import serve_args
    full, base = serve_args(env, target, list(s.devices), s.dtype, s.max_model_len,
                            s.trust_remote_code, list(s.flags), port=0)
    return full[base:]


def validate(env: VllmEnv, target: Path, servers: list[Planned], timeout: float = 600.0,
             key: str | None = None) -> Validation:
    """Ask `env`'s vLLM about each server (one process per environment the
    servers start with); the answer is cached under `key`."""
    import time
    t0, out = time.monotonic(), Validation()
    groups: dict[tuple, list[Planned]] = {}
    for s in servers:
        groups.setdefault((s.devices, s.env), []).append(s)
    for (devices, extra), group in groups.items():
        answer = _ask(env, target, group, dict(extra), list(devices), timeout)
        out.results += answer.results
        out.import_s = max(out.import_s, answer.import_s)
        out.failed = out.failed or answer.failed
    out.seconds = round(time.monotonic() - t0, 3)
    store(key, out)
    return out


def store(key: str | None, answer: Validation) -> None:
    """Cache an answer under `key` (not one that failed to come)."""
    if key is None or answer.failed:
        return
    try:
        cache_path(key).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache_path(key), answer.to_json())
    except OSError:
        pass   # (DiskFull is one) the answer stands; only the next doctor asks again


def _ask(env: VllmEnv, target: Path, group: list[Planned], extra: dict, devices: list[int],
         timeout: float) -> Validation:
    """One pipeline.vllm.validate process for servers sharing an environment."""
    request = json.dumps([{"name": s.name, "argv": argv(env, target, s)} for s in group])
    base = {**os.environ, **extra, **OFFLINE}
    with tempfile.TemporaryDirectory(prefix="eagle-panel-validate-") as tmp:
        out, log = Path(tmp) / "out.json", Path(tmp) / "log"
        try:
            with open(log, "w") as f:
                # a session of its own: whatever vLLM starts goes with it on a timeout
                proc = subprocess.Popen([env.python, "-m", "pipeline.vllm.validate", str(out)],
                                        stdin=subprocess.PIPE, stdout=f,
                                        stderr=subprocess.STDOUT, text=True,
                                        cwd=str(PROJECT_ROOT), start_new_session=True,
                                        env=process_env(env, devices, None, base=base))
                try:
                    proc.communicate(request, timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return Validation(failed=f"vLLM's validation took over {timeout:.0f} s")
            answer = json.loads(out.read_text())
        except (OSError, ValueError):
            tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
            return Validation(failed=f"vLLM's validation stopped without an answer: {tail}")
    return Validation([Result(**r) for r in answer["results"]], answer["import_s"])
