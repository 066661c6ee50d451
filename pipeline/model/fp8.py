"""FP8 hidden states in speculators' own layout (hs_connectors 0.9's
`FP8HiddenStatesConnector` / `FP8Transfer`): half the disk of bf16 for the
same draft.

    hidden_states         float8_e4m3fn [seq_len, n_layers, hidden]
    hidden_states_scales  float32       [seq_len, 1, 1]   one scale per token
    token_ids             int64         [seq_len]

Quantize: scale = amax over the token's layers and features / FP8_MAX,
fp8 = (x / scale) in e4m3. Dequantize: fp8 * scale. The arithmetic is
hs_connectors.fp8_utils' own (tests check it bit for bit against theirs), so
a file written here and one written by speculators' connector load the same
through speculators' FP8Transfer; it lives here because vLLM's processes,
where our connector writes, do not have hs_connectors installed.
"""

from __future__ import annotations

SCALES_KEY = "hidden_states_scales"   # hs_connectors.fp8_utils.SCALES_KEY
SAFETENSORS_DTYPE = "F8_E4M3"
BYTES = 1


def available() -> str | None:
    """Why this torch cannot write FP8 hidden states, or None."""
    import torch
    if getattr(torch, "float8_e4m3fn", None) is None:
        return (f"torch {torch.__version__} has no float8_e4m3fn (FP8 hidden states need "
                "torch >= 2.1)")
    return None


def quantize(tensor):
    """(fp8 tensor, per-token float32 scales shaped [seq, 1, ...])."""
    import torch
    fp8 = torch.float8_e4m3fn
    fp32 = tensor.float()
    amax = fp32.abs().amax(dim=tuple(range(1, fp32.dim())), keepdim=True)
    scale = (amax / torch.finfo(fp8).max).clamp(min=1e-12)
    return (fp32 / scale).to(fp8), scale


def dequantize(fp8_tensor, scale, dtype):
    return fp8_tensor.to(dtype) * scale.to(dtype)


def bytes_per_token(n_layers: int, hidden: int) -> int:
    """One token on disk: its FP8 states, its scale and its id."""
    return n_layers * hidden * BYTES + 4 + 8
