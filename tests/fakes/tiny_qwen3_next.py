"""A tiny Qwen3-Next target (hybrid: gated-delta-net linear attention on
every other layer, full attention on the rest, MoE MLPs) for the real vLLM
of this machine, which ships a CPU gated-delta-net path.

Random weights (seeded): the test compares vLLM's hidden states with
transformers' on the same weights, so nothing needs training. Shapes are
Qwen3-Next's, shrunk, with two constraints vLLM 0.32's CPU build sets:
the linear-attention head dims stay 128 (32 fails with "Unexpected head dim
size"), and the weights are bf16 (its CPU GDN kernel requires BF16). The
tokenizer and chat template are the built-in tiny-llama's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def build(out: Path) -> Path:
    """The model folder at `out` (config.json, bf16 safetensors, tokenizer)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from pipeline.builtin.tiny_model import ensure_built
    llama = ensure_built()
    special = json.loads((llama / "config.json").read_text())
    cfg = Qwen3NextConfig(
        vocab_size=special["vocab_size"], hidden_size=128, intermediate_size=256,
        num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, max_position_embeddings=2048,
        bos_token_id=special.get("bos_token_id"), eos_token_id=special.get("eos_token_id"),
        pad_token_id=special.get("pad_token_id"), tie_word_embeddings=False,
        torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (llama / name).exists():
            shutil.copy(llama / name, out / name)
    return out
