"""A tiny target in DeepSeek-V3's and Kimi-K2's released format (issue 51):
a `DeepseekV3ForCausalLM` (transformers' and vLLM's own class: MLA + MoE)
of the built-in tiny-kimi's text shape, with tiny-kimi's tokenizer (remote
code, as Kimi-K2's is), every decoder Linear block-quantized to FP8 the way
those checkpoints ship: `quant_method "fp8"`, e4m3, dynamic activations, `weight_block_size`
[128, 128] (vLLM 0.32's CPU FP8 kernel refuses another K block: "CPU FP8
kernel requires K-dimension block size of 128, got 32"), the tiny shapes'
sides that are not multiples of 128 in a partial last block as the
release's 576-row kv_a_proj_with_mqa is; on disk each weight float8_e4m3fn
beside its `weight_scale_inv` (float32, one per block). The embedding,
lm_head, the norms and the router (`mlp.gate`) stay as they are, as in the
release. The weights are random (of tiny-kimi's text shape, SHAPE laid over
it): the test is of the format and the routes, not of a draft's quality.

The quantization is transformers' own (`Fp8Quantize`, the op its FP8
quantizer writes checkpoints with), never our arithmetic; `dequantized`
gives the weights the checkpoint stands for by its inverse (`Fp8Dequantize`'s
arithmetic: each block times its scale), for a test to hold a load against."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BLOCK = [128, 128]   # the release's: vLLM's CPU FP8 kernel takes no other (above)
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": BLOCK}


def is_quantized(name: str) -> bool:
    """DeepSeek-V3's FP8 weights: every decoder Linear (attention, dense MLP,
    routed and shared experts), not the router, norms, embedding or lm_head."""
    return ".layers." in name and name.endswith("_proj.weight") or \
        name.endswith("_proj_with_mqa.weight")


def _quantizer():
    """transformers' FP8 quantize op, configured with BLOCK."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    return Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(
        weight_block_size=tuple(BLOCK))))


def quantize(quant, name: str, w) -> dict:
    """{name: float8 weight, name_scale_inv: its blocks' scales} by
    transformers' op. A side that is not a multiple of the block (DeepSeek-V3's
    kv_a_proj_with_mqa has 576 rows, 4.5 blocks of 128) gets a partial last
    block, as the release has: the op quantizes the weight padded with zeros,
    which change no block's largest value, and the padding is cut off."""
    import torch
    rows, cols = w.shape
    (bm, bn), pad = BLOCK, lambda n, b: -n % b
    padded = torch.nn.functional.pad(w, (0, pad(cols, bn), 0, pad(rows, bm)))
    got = quant.convert({name: padded})
    scale = name[: -len("weight")] + "weight_scale_inv"
    assert set(got) == {name, scale}, f"transformers left {name} unquantized"
    return {name: got[name][:rows, :cols].contiguous(), scale: got[scale]}


# Sides the release has as whole 128-blocks kept whole here (vLLM's FP8 MoE loader needs
# the experts' intermediate size in whole blocks: 64 fails loading w2's scales)
SHAPE = {"q_lora_rank": 128, "moe_intermediate_size": 128}


def bf16_target(kimi: Path, dest: Path, seed: int = 0, yarn: bool = True) -> Path:
    """A DeepseekV3ForCausalLM of tiny-kimi's text shape (SHAPE laid over it)
    with random weights, in bfloat16 as the release's unquantized tensors are,
    and tiny-kimi's tokenizer: the weights the FP8 folder quantizes. `yarn`:
    tiny-kimi's rope scaling (Kimi's and DeepSeek-V3's); False: none (plain
    rope, as DeepSeek-V2-Lite-style targets have)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    text = json.loads((Path(kimi) / "config.json").read_text())["text_config"]
    if not yarn:
        theta = text["rope_parameters"]["rope_theta"]
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    skip = ("architectures", "model_type", "dtype")
    config = DeepseekV3Config(**{k: v for k, v in {**text, **SHAPE}.items() if k not in skip})
    torch.manual_seed(seed)
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(dest)
    for f in Path(kimi).iterdir():   # the tokenizer's files (remote code, as Kimi-K2's)
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and \
                not (f.suffix == ".py" and not f.name.startswith("tokenization_")):
            shutil.copy2(f, dest / f.name)
    return dest


def make(bf16: Path, dest: Path) -> Path:
    """`bf16` (bf16_target's folder) written to `dest` FP8 block-quantized."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(bf16, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = dict(CONFIG)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    quant, out = _quantizer(), {}
    for name, w in load_file(str(Path(bf16) / "model.safetensors")).items():
        out.update(quantize(quant, name, w) if is_quantized(name) else {name: w})
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def dequantized(folder: Path) -> dict:
    """{weight name: the float32 weight the checkpoint stands for}: each FP8
    block times its `weight_scale_inv`, as transformers' Fp8Dequantize does."""
    import torch
    from safetensors.torch import load_file
    sd, out = load_file(str(Path(folder) / "model.safetensors")), {}
    bm, bn = BLOCK
    for name in [n for n in sd if n.endswith(".weight_scale_inv")]:
        w = sd[name[: -len("_scale_inv")]].to(torch.float32)
        inv = sd[name].to(torch.float32)
        per = inv.repeat_interleave(bm, 0).repeat_interleave(bn, 1)   # (a partial last block)
        out[name[: -len("_scale_inv")]] = w * per[: w.shape[0], : w.shape[1]]
    return out


def dequantized_folder(fp8: Path, bf16: Path, dest: Path) -> Path:
    """`bf16`'s folder with each quantized weight replaced by what the FP8
    checkpoint `fp8` stands for (float32, unquantized): the same weights as
    vLLM's FP8 kernel multiplies by, for any loader."""
    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(bf16, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    sd = {k: v.to(torch.float32) for k, v in load_file(str(bf16 / "model.safetensors")).items()}
    save_file({**sd, **dequantized(fp8)}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    return dest
