"""What a target model's folder says about it, read from config.json and the
safetensors index (no code run, no weights loaded), and the per-token sizes
that follow: its KV cache and its extracted hidden states. Standard library
only: doctor and the stages share it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ModelInfo:
    architecture: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    dtype: str
    wrapped: bool            # decoder settings under text_config (multimodal wrapper)
    needs_remote_code: bool  # auto_map in config or tokenizer config
    weights_bytes: int | None
    max_position: int | None = None   # max_position_embeddings

    @property
    def mla(self) -> bool:
        return bool(self.kv_lora_rank)


def read_model(folder: Path) -> ModelInfo:
    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config") or raw
    heads = int(text.get("num_attention_heads") or 1)
    hidden = int(text["hidden_size"])
    tok_cfg = folder / "tokenizer_config.json"
    tok_auto = tok_cfg.exists() and "auto_map" in json.loads(tok_cfg.read_text() or "{}")
    weights = None
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weights = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    if weights is None:
        files = list(folder.glob("*.safetensors"))
        weights = sum(f.stat().st_size for f in files) if files else None
    return ModelInfo(
        architecture=(raw.get("architectures") or ["?"])[0],
        model_type=str(text.get("model_type") or raw.get("model_type") or "?"),
        layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        kv_lora_rank=text.get("kv_lora_rank"), qk_rope_head_dim=text.get("qk_rope_head_dim"),
        dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                  or "bfloat16"),
        wrapped="text_config" in raw, needs_remote_code="auto_map" in raw or tok_auto,
        weights_bytes=int(weights) if weights else None,
        max_position=text.get("max_position_embeddings"))


def kv_bytes_per_token(m: ModelInfo, tp: int = 1, elem: int = 2) -> int:
    """KV-cache bytes one token takes on one GPU of a tensor-parallel group.
    MLA (DeepSeek-V3, Kimi-K2): the compressed latent plus the rope key,
    kv_lora_rank + qk_rope_head_dim per layer, replicated on every rank.
    GQA/MHA: K and V of the KV heads, split over the ranks (at least one head each)."""
    if m.mla:
        return m.layers * (int(m.kv_lora_rank) + int(m.qk_rope_head_dim or 0)) * elem
    return 2 * m.layers * max(1, m.kv_heads // tp) * m.head_dim * elem


def hs_bytes_per_token(m: ModelInfo, n_layers: int, elem: int) -> int:
    """One token of extracted hidden states: n_layers x hidden, plus its int64 id."""
    return n_layers * m.hidden * elem + 8
