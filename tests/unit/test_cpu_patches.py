"""pipeline.train.cpu_patches: what speculators' trainer needs on a machine
without an accelerator, checked against the code it replaces."""

from __future__ import annotations

import torch
from torch.optim import _muon

from pipeline.train import cpu_patches


def _restore(real):
    _muon._zeropower_via_newtonschulz = real


def test_muon_orthogonalises_in_float32_on_cpu_as_torch_does_in_bf16(monkeypatch):
    """The float32 iteration is torch's step for step: on the same gradients it
    lands where torch's bf16 one does (within bf16's precision), tall and wide
    matrices alike, and the optimizer step that uses it still moves the
    weights as torch's does."""
    before = _muon._zeropower_via_newtonschulz   # (a training in this process may have patched it)
    real = getattr(before, "__wrapped__", before)
    try:
        cpu_patches.muon_in_float32()
        cpu_patches.muon_in_float32()   # idempotent: wraps torch's own, once
        patched = _muon._zeropower_via_newtonschulz
        assert patched is not real and patched.__wrapped__ is real
        torch.manual_seed(0)
        coeffs = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
        for shape in ((96, 256), (576, 256), (128, 128)):
            g = torch.randn(shape)
            ours, theirs = patched(g, coeffs, 5, 1e-7), real(g, coeffs, 5, 1e-7)
            assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16
            assert ours.shape == theirs.shape == shape
            rel = (ours - theirs.float()).norm() / theirs.float().norm()
            assert rel < 0.05, (shape, float(rel))
        calls = []
        iteration = cpu_patches._float32_iteration
        monkeypatch.setattr(cpu_patches, "_float32_iteration",
                            lambda *a: calls.append(a[0].shape) or iteration(*a))
        w = torch.nn.Parameter(torch.randn(64, 32))
        before = w.detach().clone()
        opt = torch.optim.Muon([w], lr=0.02)
        w.grad = torch.randn(64, 32)
        opt.step()
        assert w.dtype == torch.float32 and not torch.equal(w.detach(), before)
        assert calls == [(64, 32)]   # torch's Muon step went through the float32 iteration
    finally:
        _restore(before)

