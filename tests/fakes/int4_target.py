"""Tiny targets in Kimi-K2.5's released format (issue 51): the built-in
tiny-kimi (Kimi-K2.5's multimodal wrapper over a DeepSeek-V3 MLA + MoE
decoder) with its routed experts' Linear weights quantized the way Kimi-K2.5
ships them — compressed-tensors `pack-quantized`, int4, group 32,
symmetric; on disk `weight_packed` (int32), `weight_scale` (bf16) and
`weight_shape` — and attention, the shared experts, the dense MLP and
lm_head left as they are; and a dense INT4 Llama (the built-in tiny-llama,
every decoder Linear in the same scheme: its shapes are multiples of 32),
which vLLM's CPU build serves through its INT4 linear kernel.

The quantization is compressed-tensors' own (its qparams, quantize and
pack functions, the library transformers and vLLM load it with), never
our arithmetic. `dequantized(folder)` gives the expert weights the
checkpoint stands for, by the same library, so a test can hold the loaded
model against them and the original weights against both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SCHEME = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
          "group_size": 32, "dynamic": False, "actorder": None, "observer": "minmax"}
# Kimi-K2.5's ignore list (its config.json), the vision tower's included
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
          r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
          "re:.*vision_tower.*", "re:.*mm_projector.*"]


def quantization_config(ignore: list[str] | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                          "weights": dict(SCHEME), "input_activations": None,
                                          "output_activations": None}},
            "ignore": list(IGNORE if ignore is None else ignore), "kv_cache_scheme": None}


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def is_decoder_linear(name: str) -> bool:
    """A dense model's every decoder Linear (attention and MLP), not lm_head."""
    return ".layers." in name and name.endswith("_proj.weight")


# A dense INT4 Llama: every decoder Linear quantized, lm_head (and the embedding) not
DENSE_IGNORE = ["lm_head"]


def _args():
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(**{k: v for k, v in SCHEME.items() if k != "observer"})


def quantize_weight(w):
    """(packed int32, scale bf16, shape int32) of one Linear weight [out, in]."""
    import torch
    from compressed_tensors.compressors import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    args = _args()
    out, inn = w.shape
    groups = w.reshape(out, inn // args.group_size, args.group_size)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scale = scale.to(torch.bfloat16)
    q = quantize(w, scale.to(w.dtype), zero, args, dtype=torch.int8)
    return pack_to_int32(q, 4), scale, torch.tensor([out, inn], dtype=torch.int32)


def make(src: Path, dest: Path, select=is_routed_expert, ignore: list[str] | None = None
         ) -> Path:
    """`src`'s target written to `dest` with the weights `select` names in
    INT4 (default: tiny-kimi's routed experts, Kimi-K2.5's ignore list)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    out = {}
    for name, w in load_file(str(Path(src) / "model.safetensors")).items():
        if select(name):
            base = name[: -len(".weight")]
            (out[f"{base}.weight_packed"], out[f"{base}.weight_scale"],
             out[f"{base}.weight_shape"]) = quantize_weight(w)
        else:
            out[name] = w
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    q = quantization_config(ignore)
    config["quantization_config"] = q
    if "text_config" in config:
        config["text_config"]["quantization_config"] = q
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def dequantized(folder: Path) -> dict:
    """{expert weight name: the weight the checkpoint stands for}, by
    compressed-tensors' own unpack and dequantize."""
    import torch
    from compressed_tensors.compressors import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file
    sd, args, out = load_file(str(Path(folder) / "model.safetensors")), _args(), {}
    for name in [n for n in sd if n.endswith(".weight_packed")]:
        base = name[: -len(".weight_packed")]
        shape = torch.Size(sd[f"{base}.weight_shape"].tolist())
        q = unpack_from_int32(sd[name], 4, shape)
        scale = sd[f"{base}.weight_scale"].to(torch.float32)
        out[f"{base}.weight"] = dequantize(q, scale, torch.zeros_like(scale, dtype=torch.int8),
                                           args)
    return out
