"""What the stage environment has, printed as JSON; run by `doctor` with the
interpreter the stages use (`[runtime] python`), which may be another
virtual environment than the panel's.

    python -m pipeline.envprobe

Never imports vLLM (tens of seconds, and it wants a GPU): its version comes
from the package metadata and its source folder from the import system.
torch is imported (a few seconds) for its CUDA build.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import platform
import sys

PACKAGES = ("torch", "transformers", "speculators", "vllm", "datasets", "safetensors",
            "nvidia-ml-py", "triton")


def probe() -> dict:
    out = {"python": platform.python_version(), "executable": sys.executable, "packages": {}}
    for name in PACKAGES:
        try:
            out["packages"][name] = md.version(name)
        except md.PackageNotFoundError:
            out["packages"][name] = None
    spec = importlib.util.find_spec("vllm") if out["packages"]["vllm"] else None
    out["vllm_dir"] = (list(spec.submodule_search_locations)[0]
                       if spec and spec.submodule_search_locations else None)
    if out["packages"]["torch"]:
        try:
            import torch
            out["torch_cuda"] = torch.version.cuda
        except Exception as e:  # noqa: BLE001 - a broken torch is a finding, not a crash
            out["torch_error"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    print(json.dumps(probe()))
