"""speculators 0.9's Trainer on a machine without an accelerator (docs/FACTS.md).

It assumes one in four places, each replaced in speculators' module
namespace for this process:
  0. under torchrun, `maybe_setup_distributed` sets the accelerator's device
     index and starts its backend ("No accelerator found")  -> gloo
     (`patch_distributed`, which also bounds every collective's wait)
  1. `model.to(local_rank)` with an int rank (means cuda:N)  -> the CPU device
  2. `_StepTimer` calls `torch.accelerator.synchronize()`    -> not called
  3. the checkpointer loads onto `get_current_device()`      -> "cpu"
plus autocast on device type "cuda", which becomes "cpu", and one cost that
is not arithmetic: speculators' default optimizer is Muon, and torch's Muon runs
its Newton-Schulz iteration in bfloat16, which a CPU without native bf16 matmul
(AVX2 only, as here) emulates: on 2 cores it made Muon's step ~1.7 s of a
~4.9 s training step of the tiny MLA draft. On CPU tensors the same iteration
runs in float32 (`muon_in_float32`): more precise, not slower on any CPU.
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
    muon_in_float32()


def muon_in_float32() -> None:
    """torch.optim.Muon's orthogonalisation in float32 for CPU tensors (its own
    function, called with a float32 copy; GPU tensors keep bf16). Idempotent."""
    from torch.optim import _muon

    real = getattr(_muon._zeropower_via_newtonschulz, "__wrapped__",
                   _muon._zeropower_via_newtonschulz)

    def newton_schulz(grad, ns_coefficients, ns_steps, eps):
        if grad.device.type != "cpu":
            return real(grad, ns_coefficients, ns_steps, eps)
        return _float32_iteration(grad.float(), ns_coefficients, ns_steps, eps)

    newton_schulz.__wrapped__ = real
    _muon._zeropower_via_newtonschulz = newton_schulz


def _float32_iteration(grad, ns_coefficients, ns_steps, eps):
    """torch's `_zeropower_via_newtonschulz` (torch/optim/_muon.py), step for
    step, without its cast to bfloat16."""
    import torch

    a, b, c = ns_coefficients
    wide = grad.size(0) > grad.size(1)
    x = grad.T if wide else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


def patch_distributed(dist_mod, cli_mod, cpu: bool, timeout_s: float) -> None:
    """dist_mod / cli_mod: speculators.train.distributed / .cli. Under torchrun:
    every collective waits at most `timeout_s` (a rank whose peer's node is
    lost fails instead of hanging: speculators starts its process group with the
    backend's default wait, 30 minutes for gloo), and on the CPU the group is
    gloo. speculators' own setup sets module state its getters read (rank,
    world size, the data-parallel groups its sampler and DDP use): this one
    sets the same. DDP, speculators' default, works over gloo unchanged; its
    checkpoints are the single-process format (rank 0 writes, all meet)."""
    import datetime
    import os

    import torch.distributed as dist

    real = getattr(dist_mod.maybe_setup_distributed, "__wrapped__",
                   dist_mod.maybe_setup_distributed)
    timeout = datetime.timedelta(seconds=timeout_s)

    def maybe_setup_distributed(sp_size: int = 1) -> None:
        if "LOCAL_RANK" not in os.environ:
            return real(sp_size)
        if not cpu:
            # the accelerator's own setup, with the wait bounded
            dist_mod.dist = _TorchProxy(dist, init_process_group=lambda *a, **kw: dist
                                        .init_process_group(*a, **{"timeout": timeout, **kw}))
            return real(sp_size)
        dist_mod._local_rank = int(os.environ["LOCAL_RANK"])
        dist_mod._is_distributed = True
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
        dist_mod._rank, dist_mod._world_size = dist.get_rank(), dist.get_world_size()
        dist_mod._init_sp_process_groups(dist_mod._rank, dist_mod._world_size, sp_size)
        return None

    maybe_setup_distributed.__wrapped__ = real
    dist_mod.maybe_setup_distributed = cli_mod.maybe_setup_distributed = maybe_setup_distributed


class _TorchProxy:
    """speculators' trainer module sees `torch` with one attribute replaced."""

    def __init__(self, real, **overrides):
        self._real, self._overrides = real, overrides

    def __getattr__(self, name):
        return self._overrides.get(name) or getattr(self._real, name)
