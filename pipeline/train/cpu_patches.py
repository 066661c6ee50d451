"""speculators 0.9's Trainer on a machine without an accelerator (docs/FACTS.md).

It assumes one in three places, each replaced in speculators' module
namespace for this process:
  1. `model.to(local_rank)` with an int rank (means cuda:N)  -> the CPU device
  2. `_StepTimer` calls `torch.accelerator.synchronize()`    -> not called
  3. the checkpointer loads onto `get_current_device()`      -> "cpu"
plus autocast on device type "cuda", which becomes "cpu".
"""

from __future__ import annotations

import time


def patch_for_cpu(tr_mod, ck_mod) -> None:
    """tr_mod / ck_mod: speculators.train.trainer / .checkpointer."""
    import torch

    cpu_device = torch.device("cpu")
    tr_mod.get_local_rank = lambda: cpu_device
    ck_mod.get_current_device = lambda: "cpu"

    class CpuStepTimer(tr_mod._StepTimer):
        def mark(self, name):
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self):
            return time.perf_counter() if self.enabled else None

    tr_mod._StepTimer = CpuStepTimer
    real_autocast = torch.autocast

    def autocast(device_type, *args, **kwargs):
        return real_autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    tr_mod.torch = _TorchProxy(torch, autocast=autocast)


class _TorchProxy:
    """speculators' trainer module sees `torch` with one attribute replaced."""

    def __init__(self, real, **overrides):
        self._real, self._overrides = real, overrides

    def __getattr__(self, name):
        return self._overrides.get(name) or getattr(self._real, name)
