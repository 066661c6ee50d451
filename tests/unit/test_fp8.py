"""FP8 hidden states ([stages.extract] hidden_states_dtype = "fp8"):
speculators' own layout (hs_connectors 0.9: float8_e4m3fn with a float32
scale per token), written by our path bit for bit as speculators' quantizer
writes it, validated on resume, read by the train stage through speculators'
FP8 loader, and about half of bf16 on disk.

The parts in other tiers: tests/integration/test_fp8.py."""


import torch

from pipeline.model import fp8
from pipeline.model.hsfile import validate_file, write_sample


def test_our_quantizer_is_speculators_bit_for_bit(tmp_path):
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
    from hs_connectors.transfer import FP8Transfer
    assert fp8.SCALES_KEY == SCALES_KEY and fp8.available() is None
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(37, 4, 128, generator=g) * 3).to(dtype)
        q, s = fp8.quantize(x)
        q2, s2 = quantize_tensor_to_fp8(x)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    # a file of ours, read by speculators' FP8 loader: dequantized, close to the original
    ids = list(range(37))
    write_sample(tmp_path / "hs_0.safetensors", x, ids, fp8=True)
    assert validate_file(tmp_path / "hs_0.safetensors", ids, 4, 128, torch.float8_e4m3fn) is None
    assert "tensors" in validate_file(tmp_path / "hs_0.safetensors", ids, 4, 128, torch.bfloat16)
    got = FP8Transfer(tmp_path).get_cached(0)
    assert set(got) == {"hidden_states", "token_ids"} and got["hidden_states"].dtype == \
        torch.bfloat16
    err = (got["hidden_states"].float() - x.float()).abs() / x.float().abs().amax(
        dim=(1, 2), keepdim=True)
    assert err.max() < 0.07   # e4m3: 3 mantissa bits, relative to each token's largest value
    assert fp8.bytes_per_token(4, 7168) * 2 < 4 * 7168 * 2 + 8 + 100   # half of bf16


