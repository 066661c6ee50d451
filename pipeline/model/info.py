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
    vocab_size: int | None = None

    @property
    def mla(self) -> bool:
        return bool(self.kv_lora_rank)


def read_model(folder: Path) -> ModelInfo:
    raw = json.loads((folder / "config.json").read_text())
    tok_cfg = folder / "tokenizer_config.json"
    tok_auto = tok_cfg.exists() and "auto_map" in json.loads(tok_cfg.read_text() or "{}")
    weights = None
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weights = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    if weights is None:
        files = list(folder.glob("*.safetensors"))
        weights = sum(f.stat().st_size for f in files) if files else None
    return model_info(raw, tokenizer_remote_code=tok_auto, weights_bytes=weights)


def weight_names(folder: Path) -> list[str]:
    """The tensor names of a model folder's safetensors, from its index or
    each file's JSON header (no tensor is read)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    try:
        if index.exists():
            return list(json.loads(index.read_text()).get("weight_map", {}))
        names = []
        for f in sorted(folder.glob("*.safetensors")):
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                names += [k for k in json.loads(fh.read(size)) if k != "__metadata__"]
        return names
    except (OSError, ValueError):
        return []


def model_info(raw: dict, tokenizer_remote_code: bool = False,
               weights_bytes: int | None = None) -> ModelInfo:
    """What a config.json (as a dict) says about the model."""
    text = raw.get("text_config") or raw
    heads = int(text.get("num_attention_heads") or 1)
    hidden = int(text["hidden_size"])
    return ModelInfo(
        architecture=(raw.get("architectures") or ["?"])[0],
        model_type=str(text.get("model_type") or raw.get("model_type") or "?"),
        layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        kv_lora_rank=text.get("kv_lora_rank"), qk_rope_head_dim=text.get("qk_rope_head_dim"),
        dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                  or "bfloat16"),
        wrapped="text_config" in raw,
        needs_remote_code="auto_map" in raw or tokenizer_remote_code,
        weights_bytes=int(weights_bytes) if weights_bytes else None,
        max_position=text.get("max_position_embeddings"),
        vocab_size=text.get("vocab_size") or raw.get("vocab_size"))


def validate_layer_ids(aux: list[int], num_layers: int) -> list[int]:
    """The aux layer ids as given, plus the last layer (vLLM's convention: id k
    is the residual stream after k layers). Every problem is said at once:
    ids out of range, the last layer (always captured), repeats, and an
    order other than increasing (vLLM hands the draft the aux states in the
    order given, and the draft's first projection is trained on that order)."""
    if not aux:
        if num_layers < 6:
            raise ValueError(
                f"the target has {num_layers} layers, too few for the default aux layers "
                f"[2, n/2, n-3]; set [stages.extract] layer_ids (0..{num_layers - 1})")
        aux = [2, num_layers // 2, num_layers - 3]
    problems = []
    for k in aux:
        if k == num_layers:
            problems.append(f"layer id {k} is the last layer, which is always captured")
        elif not 0 <= k < num_layers:
            problems.append(f"layer id {k} is out of range for a target with {num_layers} "
                            "layers")
    twice = sorted({k for k in aux if aux.count(k) > 1})
    if twice:
        problems.append(f"{aux} lists layer {', '.join(map(str, twice))} twice")
    elif aux != sorted(aux):
        problems.append(f"{aux} is not in increasing order")
    if problems:
        good = sorted({k for k in aux if 0 <= k < num_layers})
        raise ValueError("; ".join(problems) + f". Aux layer ids are distinct, increasing, in "
                         f"0..{num_layers - 1}" + (f", e.g. {good}" if good else ""))
    return list(aux) + [num_layers]


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
