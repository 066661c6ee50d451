"""What a target's `quantization_config` says, as a typed value: the method,
its schemes (bits, group or block, what they apply to) and what is left
unquantized. Read from config.json only; the checkpoints users train drafts
for are released quantized: Kimi-K2.5 INT4 (compressed-tensors, its routed
experts), DeepSeek-V3 and Kimi-K2 FP8 with 128x128 weight blocks, NVFP4
(modelopt). Whether a stage's vLLM has kernels for it is vLLM's to say
(pipeline/vllm/validate.py builds the model on the meta device); this names
it, so doctor's model line and the export's card can.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    """One group of layers quantized one way."""
    weights: str                 # "int4", "fp8 (e4m3)", "nvfp4"
    activations: str = ""        # "" (weight-only), "fp8 dynamic", ...
    granularity: str = ""        # "group 32", "blocks 128x128", "per channel"
    targets: tuple[str, ...] = ()

    def text(self) -> str:
        acts = f", activations {self.activations}" if self.activations else " (weight-only)"
        where = f" on {', '.join(self.targets)}" if self.targets else ""
        size = f", {self.granularity}" if self.granularity else ""
        return f"{self.weights}{size}{acts}{where}"


@dataclass(frozen=True)
class Quantization:
    method: str
    schemes: tuple[Scheme, ...] = ()
    ignored: tuple[str, ...] = ()     # layers left unquantized, as the config names them
    known: bool = True                # a method this reader knows
    problem: str = ""                 # what could not be read (doctor warns, naming the key)

    def text(self) -> str:
        """E.g. "compressed-tensors: int4, group 32 (weight-only) on Linear; unquantized:
        lm_head, self_attn, shared_experts"."""
        if not self.known:
            return f"{self.method} (a method eagle-panel does not read)"
        body = "; ".join(s.text() for s in self.schemes) or "no scheme named"
        kept = f"; unquantized: {', '.join(self.ignored)}" if self.ignored else ""
        return f"{self.method}: {body}{kept}"


def read(raw: dict) -> Quantization | None:
    """The quantization of a config.json (as a dict; text_config's when the
    decoder is wrapped), or None when it has none."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get(
        "quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        return Quantization("?", known=False, problem="quantization_config is not a table")
    method = str(q.get("quant_method") or "?")
    try:
        reader = READERS.get(method)
        return reader(q) if reader else Quantization(method, known=False)
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        return Quantization(method, problem=f"quantization_config: {type(e).__name__}: {e}")


def _ignored(names) -> tuple[str, ...]:
    """The ignore list, each entry as a person reads it ("re:.*self_attn.*" -> "self_attn")."""
    out = []
    for n in names or ():
        short = str(n).removeprefix("re:").strip(".*").replace(".*", " ").replace("\\.", ".")
        if short and short not in out:
            out.append(short)
    return tuple(out)


def _compressed_tensors(q: dict) -> Quantization:
    schemes = []
    for group in (q.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        kind = "int" if w.get("type") == "int" else str(w.get("type") or "?")
        weights = f"{kind}{w.get('num_bits', '?')}"
        strategy = w.get("strategy") or ""
        size = f"group {w['group_size']}" if strategy == "group" and w.get("group_size") else \
            ("blocks " + "x".join(map(str, w["block_structure"]))
             if strategy == "block" and w.get("block_structure") else strategy)
        how = "dynamic" if a.get("dynamic") else "static"
        acts = f"{a.get('type', '')}{a.get('num_bits', '')} {how}" if a else ""
        schemes.append(Scheme(weights, acts.strip(), size, tuple(group.get("targets") or ())))
    return Quantization("compressed-tensors", tuple(schemes), _ignored(q.get("ignore")))


def _fp8(q: dict) -> Quantization:
    block = q.get("weight_block_size")
    size = "blocks " + "x".join(map(str, block)) if block else "per tensor"
    acts = f"fp8 {q.get('activation_scheme', 'dynamic')}"
    return Quantization("fp8", (Scheme(f"fp8 ({q.get('fmt', 'e4m3')})", acts, size),),
                        _ignored(q.get("ignored_layers") or q.get("modules_to_not_convert")))


def _modelopt(q: dict) -> Quantization:
    algo = str((q.get("quantization") or q).get("quant_algo") or "?")
    group = (q.get("quantization") or q).get("group_size")
    return Quantization(q.get("quant_method", "modelopt"),
                        (Scheme(algo.lower(), granularity=f"group {group}" if group else ""),),
                        _ignored((q.get("quantization") or q).get("exclude_modules")))


def _gptq_awq(q: dict) -> Quantization:
    bits, group = q.get("bits") or q.get("w_bit"), q.get("group_size") or q.get("q_group_size")
    return Quantization(str(q.get("quant_method")), (Scheme(
        f"int{bits}", granularity=f"group {group}" if group and group > 0 else "per channel"),),
        _ignored(q.get("modules_to_not_convert")))


READERS = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "modelopt": _modelopt,
           "modelopt_fp4": _modelopt, "gptq": _gptq_awq, "awq": _gptq_awq}


def partial_blocks(specs: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[str, ...]:
    """The block-quantized weights (each with its `weight_scale_inv`, as FP8
    DeepSeek-V3 and Kimi-K2 ship) whose sides are not whole multiples of
    their scale grid, as "name RxC in SRxSC blocks", from the tensors'
    (dtype, shape) (info.tensor_specs: the safetensors headers). DeepSeek-V3's
    own kv_a_proj_with_mqa is one: 576 rows, 5 blocks of 128."""
    out = []
    for name, (_, grid) in specs.items():
        if not name.endswith(".weight_scale_inv") or len(grid) != 2:
            continue
        shape = specs.get(name[: -len("_scale_inv")], (None, ()))[1]
        if len(shape) == 2 and (shape[0] % grid[0] or shape[1] % grid[1]):
            out.append(f"{name[: -len('_scale_inv')]} {shape[0]}x{shape[1]} in "
                       f"{grid[0]}x{grid[1]} blocks")
    return tuple(out)


# What the draft copies from the target (speculators' load_verifier_weights,
# by name suffix): the embedding and the output head
HEADS = ("embed_tokens", "lm_head")
QUANTIZED_DTYPES = ("F8_", "I8", "U8", "I32", "I4", "U4", "F4")


def quantized_heads(specs: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[str, ...]:
    """The target's embed_tokens and lm_head where its files hold them
    quantized, as "name (how)": a float8/int dtype (an FP8 head is a scale
    away from its values), or only packed parts (`weight_packed`, `weight`
    absent). speculators reads `<head>.weight` and casts it to the draft's
    dtype, and takes the embedding where no `lm_head.weight` is found: either
    way a draft silently gets wrong heads."""
    out = []
    for head in HEADS:
        names = [n for n in specs if f"{head}." in n and
                 (n.endswith(f"{head}.weight") or f"{head}.weight_" in n)]
        plain = [n for n in names if n.endswith(f"{head}.weight")]
        for n in plain:
            if specs[n][0].startswith(QUANTIZED_DTYPES):
                out.append(f"{n} ({specs[n][0]})")
        if not plain and names:
            out.append(f"{sorted(names)[0]} (packed: no {head}.weight)")
    return tuple(out)


def packed_linears(specs: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[str, ...]:
    """The packed-integer weights (compressed-tensors `weight_packed`) outside
    the routed experts: Linear layers vLLM's CPU build runs through its INT4
    GEMM (`cpu_gemm_wna16`), which has no float32 kernel."""
    return tuple(sorted(n for n in specs if n.endswith(".weight_packed")
                        and ".mlp.experts." not in n))
