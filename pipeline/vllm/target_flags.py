"""What a target needs from `vllm serve` beyond its path: decided from its
config.json, its weights' names and the installed vLLM's own argument
parser, never from version numbers. Every stage that serves the target
(extract, online train, regenerate, evaluate) gets the same flags, and
doctor reports the same decisions before a launch.

- A multimodal wrapper (Kimi-K2.5: `vision_config` beside `text_config`) is
  served text-only (`--language-model-only`): the pipeline sends token ids
  and chats, never media, and the vision tower's memory and warm-up are
  spared.
- An MLA target on vLLM's CPU build runs on the reference `CPU_MLA` backend:
  on a host with AMX tiles vLLM would pick AMX_MLA, which takes bf16 only,
  and the CPU stages run float32 (docs/FACTS.md). Its rope runs as plain
  torch (`--compilation-config '{"custom_ops": ["-rotary_embedding"]}'`):
  the CPU build's rotary kernel mis-rotates the query MLA hands it (a
  strided [tokens, heads, rope] view of q), so an MLA target without rope
  scaling (whose rope is that op; DeepSeek's yarn has its own, in torch)
  had hidden states ~1% off the hf backend's from position 1 on, up to 25%
  (docs/FACTS.md; tests/vllm/test_fp8_target.py holds it at float32's noise).
- A DeepSeek-V3-style MoE whose checkpoint holds the router's
  `e_score_correction_bias` while its config does not say `topk_method =
  "noaux_tc"` (transformers' DeepseekV3Config writes none): vLLM creates
  the bias only for noaux_tc and fails to load with a KeyError; it is told
  with `--hf-overrides`. transformers routes DeepSeek-V3 with sigmoid scores
  while vLLM's default is softmax: a config without `scoring_func` gets
  "sigmoid" the same way, or vLLM would route differently, silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.model.info import weight_names
from pipeline.vllm.contract_strings import (
    FLAG_ATTENTION_BACKEND,
    FLAG_COMPILATION_CONFIG,
    FLAG_HF_OVERRIDES,
    FLAG_LANGUAGE_MODEL_ONLY,
)

# vLLM's rope custom op (model_executor/layers/rotary_embedding/base.py registers it)
ROTARY_OP = "rotary_embedding"
# DeepSeek-V3's decoder under the names vLLM and transformers give it
DEEPSEEK_V3 = ("deepseek_v3", "kimi_k2")
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"


@dataclass
class TargetFlag:
    key: str
    flags: list[str]
    detail: str


def parser_has(vllm_source, flag: str) -> bool:
    """Whether the installed vLLM's argument parser declares `flag` (True
    when its source cannot be read: then vLLM itself will say)."""
    if vllm_source is None:
        return True
    text = vllm_source.text("engine.arg_utils")
    return text is None or f'"{flag}"' in text


def has_cpu_mla(vllm_source) -> bool:
    """Whether the CPU build has an MLA backend at all (0.32 has CPU_MLA;
    0.16 raises "MLA is not supported on CPU"); True when unknown."""
    return vllm_source is None or vllm_source.has_module("v1.attention.backends.mla.cpu_mla")


def has_custom_op(vllm_source, name: str) -> bool:
    """Whether the installed vLLM's rope module registers a custom op of that
    name (what CompilationConfig.custom_ops switches by name); True when
    unknown."""
    if vllm_source is None:
        return True
    text = vllm_source.text("model_executor.layers.rotary_embedding.base")
    return text is None or f'CustomOp.register("{name}")' in text


def target_flags(target: Path, cpu_build: bool, vllm_source=None) -> list[TargetFlag]:
    """The flags `vllm serve` needs for this target, each with why."""
    try:
        raw = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return []   # vLLM says what is wrong with the folder itself
    text = raw.get("text_config") or raw
    out = []
    if "vision_config" in raw and "text_config" in raw and \
            parser_has(vllm_source, FLAG_LANGUAGE_MODEL_ONLY):
        out.append(TargetFlag("language_model_only", [FLAG_LANGUAGE_MODEL_ONLY],
                              f"{(raw.get('architectures') or ['the target'])[0]} is a "
                              "multimodal wrapper: served text-only (--language-model-only)"))
    if cpu_build and text.get("kv_lora_rank") and parser_has(vllm_source, FLAG_ATTENTION_BACKEND) \
            and has_cpu_mla(vllm_source):
        out.append(TargetFlag("cpu_mla_backend", [FLAG_ATTENTION_BACKEND, "CPU_MLA"],
                              "MLA target on vLLM's CPU build: the reference CPU_MLA backend "
                              "(AMX_MLA, vLLM's pick on AMX hosts, takes bf16 only)"))
    if cpu_build and text.get("kv_lora_rank") and has_custom_op(vllm_source, ROTARY_OP):
        out.append(TargetFlag("cpu_rope_native", [FLAG_COMPILATION_CONFIG, json.dumps(
            {"custom_ops": [f"-{ROTARY_OP}"]})], "MLA target on vLLM's CPU build: its rope in "
            "torch (the CPU rotary kernel mis-rotates MLA's strided query; "
            "--compilation-config custom_ops -rotary_embedding)"))
    routing = routing_overrides(Path(target), text)
    if routing:
        body = {"text_config": routing} if "text_config" in raw else routing
        out.append(TargetFlag("moe_routing", [FLAG_HF_OVERRIDES, json.dumps(body)],
                              "the target's MoE router as its weights and transformers have "
                              f"it: {', '.join(f'{k} = {v!r}' for k, v in routing.items())} "
                              "(--hf-overrides; config.json leaves it out)"))
    return out


def routing_overrides(target: Path, text: dict) -> dict:
    """What vLLM must be told about a DeepSeek-V3 MoE router that its
    config.json leaves out (see the module's note)."""
    if str(text.get("model_type")) not in DEEPSEEK_V3 or not text.get("n_routed_experts"):
        return {}
    over = {}
    if text.get("topk_method") != "noaux_tc" and \
            any(n.endswith(ROUTER_BIAS) for n in weight_names(target)):
        over["topk_method"] = "noaux_tc"
    if "scoring_func" not in text:
        over["scoring_func"] = "sigmoid"
    return over


def flags_for(target: Path, cpu_build: bool, vllm_source=None) -> list[str]:
    return [f for t in target_flags(target, cpu_build, vllm_source) for f in t.flags]
