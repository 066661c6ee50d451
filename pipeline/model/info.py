"""What a target model's folder says about it, read from config.json and the
safetensors index (no code run, no weights loaded), and the per-token sizes
that follow: its KV cache and its extracted hidden states. Standard library
only: doctor and the stages share it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from pipeline.model import quant as quant_rules
from pipeline.model.quant import Quantization
from pipeline.model.quant import read as read_quantization


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
    # Per decoder layer, what its attention keeps (layer_kinds): "mla", "attn"
    # (GQA/MHA), "dsa" (MLA + a sparse-attention indexer's keys), "linear"
    # (KDA / gated delta net: a fixed state per sequence, no KV per token),
    # "c<r>" (DeepSeek-V4: KV compressed r:1; c0 = a sliding window only).
    kinds: tuple[str, ...] = ()
    linear: dict | None = None        # the linear-attention state's shape (linear_state)
    index_head_dim: int | None = None  # DSA's indexer keys
    sliding_window: int | None = None
    quant: Quantization | None = None  # quantization_config, read (pipeline.model.quant)
    # read_model's folder: a quantized target's weight headers are read from it when
    # doctor asks (the properties below), not at every stage start
    folder: Path | None = field(default=None, compare=False, repr=False)

    @cached_property
    def _weight_specs(self) -> dict:
        if self.quant is None or self.folder is None:
            return {}
        try:
            return tensor_specs(self.folder)
        except (OSError, ValueError):
            return {}   # unreadable weights: the stage that loads them says so

    @cached_property
    def partial_blocks(self) -> tuple[str, ...]:
        """FP8 weights in a partial last block (quant.partial_blocks)."""
        fp8 = self.quant is not None and self.quant.method == "fp8"
        return quant_rules.partial_blocks(self._weight_specs) if fp8 else ()

    @cached_property
    def quantized_heads(self) -> tuple[str, ...]:
        """The embedding or output head held quantized (quant.quantized_heads)."""
        return quant_rules.quantized_heads(self._weight_specs)

    @cached_property
    def packed_linears(self) -> tuple[str, ...]:
        """INT4 Linear layers outside the experts (quant.packed_linears)."""
        return quant_rules.packed_linears(self._weight_specs)

    @property
    def mla(self) -> bool:
        return bool(self.kv_lora_rank)

    @property
    def hybrid(self) -> bool:
        return len(set(self.kinds)) > 1 or "linear" in self.kinds

    def kind_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.kinds:
            out[k] = out.get(k, 0) + 1
        return out


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
    info = model_info(raw, tokenizer_remote_code=tok_auto, weights_bytes=weights)
    info.folder = Path(folder)
    return info


def weight_names(folder: Path) -> list[str]:
    """The tensor names of a model folder's safetensors, from its index or
    each file's JSON header (no tensor is read)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    try:
        if index.exists():
            return list(json.loads(index.read_text()).get("weight_map", {}))
        return list(tensor_specs(folder))
    except (OSError, ValueError):
        return []


def tensor_specs(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a folder's *.safetensors,
    from the files' JSON headers (no tensor is read)."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()
                    if k != "__metadata__"})
    return out


def model_info(raw: dict, tokenizer_remote_code: bool = False,
               weights_bytes: int | None = None) -> ModelInfo:
    """What a config.json (as a dict) says about the model."""
    text = raw.get("text_config") or raw
    heads = int(text.get("num_attention_heads") or 1)
    hidden = int(text["hidden_size"])
    m = ModelInfo(
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
        vocab_size=text.get("vocab_size") or raw.get("vocab_size"),
        linear=linear_state(text), index_head_dim=text.get("index_head_dim"),
        sliding_window=text.get("sliding_window"), quant=read_quantization(raw))
    m.kinds = layer_kinds(text, m.layers)
    return m


def layer_kinds(text: dict, n: int) -> tuple[str, ...]:
    """What each decoder layer's attention keeps, from the config's own
    layout keys: Kimi-Linear/K3's linear_attn_config.kda_layers (1-based, as
    vLLM's KimiLinearConfig.is_kda_layer reads it), Qwen3-Next's layer_types
    or full_attention_interval, DeepSeek-V4's compress_ratios (or
    compress_rates by layer_types), DeepSeek-V3.2 / GLM-MoE-DSA's indexer
    (index_topk)."""
    full = "mla" if text.get("kv_lora_rank") else "attn"
    kda = (text.get("linear_attn_config") or {}).get("kda_layers")
    if kda is not None:
        return tuple("linear" if i + 1 in kda else full for i in range(n))
    types = text.get("layer_types")
    ratios = text.get("compress_ratios")
    if ratios is None and text.get("compress_rates") and types:
        ratios = [text["compress_rates"].get(t, 0) for t in types]
    if ratios:
        return tuple(f"c{int(r)}" for r in ratios[:n])
    if types and any("linear" in t for t in types):
        return tuple("linear" if "linear" in t else full for t in types[:n])
    every = text.get("full_attention_interval")
    if every and text.get("linear_num_value_heads"):
        return tuple(full if (i + 1) % int(every) == 0 else "linear" for i in range(n))
    if text.get("index_topk") and full == "mla":
        return ("dsa",) * n
    return (full,) * n


def linear_state(text: dict) -> dict | None:
    """The shape of one linear-attention layer's state (heads, dims, conv
    kernel), for KDA (Kimi) and the gated delta net (Qwen3-Next)."""
    kda = text.get("linear_attn_config")
    if kda and kda.get("num_heads"):
        h, d = int(kda["num_heads"]), int(kda["head_dim"])
        return {"kind": "KDA", "v_heads": h, "k_heads": h, "v_dim": d, "k_dim": d,
                "conv": int(kda.get("short_conv_kernel_size") or 4)}
    if text.get("linear_num_value_heads"):
        return {"kind": "gated delta net", "v_heads": int(text["linear_num_value_heads"]),
                "k_heads": int(text["linear_num_key_heads"]),
                "v_dim": int(text["linear_value_head_dim"]),
                "k_dim": int(text["linear_key_head_dim"]),
                "conv": int(text.get("linear_conv_kernel_dim") or 4)}
    return None


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


INDEXER_EXTRA = 4   # DSA's indexer keys: FP8 + a float32 scale per token (vLLM's layout)


def kv_bytes_per_token(m: ModelInfo, tp: int = 1, elem: int = 2) -> int:
    """KV-cache bytes one token takes on one GPU of a tensor-parallel group,
    summed over the layers that keep KV per token (layer_kinds).
    MLA (DeepSeek-V3, Kimi-K2): the compressed latent plus the rope key,
    kv_lora_rank + qk_rope_head_dim per layer, replicated on every rank;
    DSA adds the indexer's keys (index_head_dim FP8 + scale). GQA/MHA: K and
    V of the KV heads, split over the ranks (at least one head each).
    Linear-attention layers keep none (their state is per sequence:
    recurrent_bytes_per_seq); DeepSeek-V4's compressed layers keep one
    head_dim latent per r tokens (an estimate: the window is per sequence)."""
    mla = (int(m.kv_lora_rank or 0) + int(m.qk_rope_head_dim or 0)) * elem
    per = {"mla": mla, "attn": 2 * max(1, m.kv_heads // tp) * m.head_dim * elem,
           "dsa": mla + int(m.index_head_dim or 128) + INDEXER_EXTRA, "linear": 0}
    total = 0.0
    for k in m.kinds or (("mla" if m.mla else "attn"),) * m.layers:
        if k.startswith("c"):
            r = int(k[1:])
            total += m.head_dim * elem / r if r else 0
        else:
            total += per[k]
    return int(round(total))


def recurrent_bytes_per_seq(m: ModelInfo, tp: int = 1, elem: int = 2) -> int:
    """State one sequence keeps whatever its length, on one GPU: each
    linear-attention layer's conv window and recurrent state (vLLM's
    MambaStateShapeCalculator: conv (2 k_heads k_dim + v_heads v_dim) / tp x
    (kernel - 1), recurrent v_heads / tp x v_dim x k_dim), and DeepSeek-V4's
    sliding-window layers (window x head_dim)."""
    total = 0
    s = m.linear
    n_linear = m.kinds.count("linear")
    if s and n_linear:
        conv = (2 * s["k_heads"] * s["k_dim"] + s["v_heads"] * s["v_dim"]) // tp * (s["conv"] - 1)
        rec = max(1, s["v_heads"] // tp) * s["v_dim"] * s["k_dim"]
        total += n_linear * (conv + rec) * elem
    windows = m.kinds.count("c0")
    if windows and m.sliding_window:
        total += windows * int(m.sliding_window) * m.head_dim * elem
    return total


def describe_layers(m: ModelInfo) -> str:
    """"12 MLA + 36 KDA of 48 layers" (hybrid / sparse targets)."""
    names = {"mla": "MLA", "attn": "attention", "dsa": "MLA + sparse indexer (DSA)",
             "linear": (m.linear or {}).get("kind", "linear attention")}
    parts = []
    for k, n in m.kind_counts().items():
        label = names.get(k) or (f"compressed {k[1:]}:1" if k != "c0" else "sliding window")
        parts.append(f"{n} {label}")
    return " + ".join(parts) + f" of {m.layers} layers"


def hs_bytes_per_token(m: ModelInfo, n_layers: int, elem: int) -> int:
    """One token of extracted hidden states: n_layers x hidden, plus its int64 id."""
    return n_layers * m.hidden * elem + 8
