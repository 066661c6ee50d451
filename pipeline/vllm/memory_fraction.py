"""How much of each GPU's memory a vLLM server takes when the run passes no
`--gpu-memory-utilization`: the release's own rule, read from its source
(`CacheConfig` in `config/cache.py`), never one number for every release.

Read on the source releases (tests/unit/test_memory_fraction.py):
- 0.11 to 0.18: `gpu_memory_utilization: float = 0.9`;
- 0.22 to 0.33: `Field(default=0.92)`;
- 0.34: `Field(default=None)`, resolved by `resolved_gpu_memory_utilization`
  to 1.0 where the extensible KV cache is on (by default on CUDA and ROCm,
  `VllmConfig._resolve_extensible_kv_cache`: the KV cache is then sized from
  the memory measured free after warm-up) and to the class's
  `DEFAULT_GPU_MEMORY_UTILIZATION` (0.92) elsewhere.
doctor's KV plan takes its fraction from here, so a plan made for 0.34 on a
GPU server says 100% where one for 0.32 says 92%."""

from __future__ import annotations

import ast
from dataclasses import dataclass

CACHE = "config.cache"
# Where vLLM's source cannot be read (no vLLM where doctor runs): the rule of
# every release from 0.22 to 0.33, said to be assumed.
ASSUMED = 0.92


@dataclass(frozen=True)
class MemoryFraction:
    fraction: float
    why: str           # in the release's terms, for the plan's line
    read: bool = True  # False: assumed, no source read


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def extensible_fraction(src) -> float | None:
    """What `resolved_gpu_memory_utilization` returns when the extensible KV
    cache is on (`if self.enable_extensible_kv_cache: return 1.0`); None
    where the release has no such rule."""
    fn = src.function(CACHE, "CacheConfig.resolved_gpu_memory_utilization")
    if fn is None:
        return None
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and "enable_extensible_kv_cache" in ast.unparse(node.test) \
                and node.body and isinstance(node.body[0], ast.Return) \
                and isinstance(node.body[0].value, ast.Constant):
            return float(node.body[0].value.value)
    return None


def extensible_by_default_on_cuda(src) -> bool:
    """The release turns the extensible KV cache on by itself on CUDA when the
    run does not ask (its field defaults to None and VllmConfig settles it)."""
    return (src.field_default(CACHE, "CacheConfig", "enable_extensible_kv_cache") == "None"
            and src.function("config.vllm", "VllmConfig._resolve_extensible_kv_cache")
            is not None)


def default_fraction(src, cuda: bool) -> MemoryFraction:
    """The fraction a server of this release takes by default, on CUDA GPUs
    (`cuda`) or elsewhere."""
    if src is None:
        return MemoryFraction(ASSUMED, f"vLLM's default, assumed {ASSUMED:.0%}: no vLLM "
                                       "source read here", read=False)
    v = src.version
    literal = src.field_default(CACHE, "CacheConfig", "gpu_memory_utilization")
    if (f := _float(literal)) is not None:
        return MemoryFraction(f, f"vLLM {v}'s default")
    if literal == "None":
        base = _float(src.field_default(CACHE, "CacheConfig", "DEFAULT_GPU_MEMORY_UTILIZATION"))
        ext = extensible_fraction(src)
        if cuda and ext is not None and extensible_by_default_on_cuda(src):
            return MemoryFraction(ext, f"vLLM {v}'s default with its extensible KV cache, "
                                       "on by default on CUDA: sized from memory measured free")
        if base is not None:
            return MemoryFraction(base, f"vLLM {v}'s default without the extensible KV cache")
    return MemoryFraction(ASSUMED, f"vLLM {v}'s default not read from its source "
                                   f"(CacheConfig changed): assumed {ASSUMED:.0%}", read=False)
