"""The MLA (DeepSeek-style) decoder layer of an EAGLE-3 draft, plugged into
speculators 0.9 from this project (no fork, no site-packages edit).

speculators picks an Eagle3 draft's layer classes by the `model_type` of its
`transformer_layer_config` (`speculators.models.eagle3.core`:
`model_classes[tl_config.model_type]`), a module-level dict: `register()`
adds "deepseek_v3" to it. Every process that builds or loads such a draft
(training, its torchrun ranks, `Eagle3DraftModel.from_pretrained`, resume)
must call `register()` first; pipeline.train.in_process.run_in_process does.

The layers are transformers' `DeepseekV3DecoderLayer` made to match what
vLLM's `Eagle3DeepseekV2ForCausalLM` computes (`deepseek_eagle3.py`):
- layer 0 takes cat([embeds, hidden]) = 2 x hidden wide: only the two MLA
  down projections (`q_a_proj`, `kv_a_proj_with_mqa`) widen, and speculators'
  `Eagle3FirstLayerMixin` does the split, the two norms and the residual;
- the MLP is always dense (vLLM's draft layer never builds a MoE);
- the latent norms (`q_a_layernorm`, `kv_a_layernorm`) use the config's
  rms_norm_eps like vLLM's (transformers builds them with 1e-6).
Train with `rope_interleave = True` (pipeline.train.mla_draft writes it):
that is vLLM's `is_neox_style=False` for DeepSeek.
"""

from __future__ import annotations

import copy

from speculators.models.base_components import ModelComponents
from speculators.models.eagle3 import model_definitions
from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

MODEL_TYPE = "deepseek_v3"


def _dense(config):
    """transformers builds a MoE where layer_idx >= first_k_dense_replace."""
    if (config.first_k_dense_replace or 0) < config.num_hidden_layers:
        config = copy.copy(config)
        config.first_k_dense_replace = config.num_hidden_layers
    return config


def _latent_norms(attn, config) -> None:
    if getattr(attn, "q_a_layernorm", None) is not None:
        attn.q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
    attn.kv_a_layernorm = DeepseekV3RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)


class MLADecoderLayer(DeepseekV3DecoderLayer):
    """Draft layers 1..n-1: hidden_size wide, dense MLP."""

    def __init__(self, config, layer_idx):
        config = _dense(config)
        super().__init__(config, layer_idx)
        _latent_norms(self.self_attn, config)


class MLAEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):
    """Draft layer 0: the MLA down projections read 2 x hidden_size."""

    def __init__(self, config, layer_idx, norm_before_residual=False):
        config = _dense(config)
        super().__init__(config, layer_idx)
        attn, two_h = self.self_attn, 2 * config.hidden_size
        if config.q_lora_rank is None:
            # trains, but vLLM 0.32 cannot load it (pipeline.train.mla_draft refuses it)
            attn.q_proj = nn.Linear(two_h, attn.num_heads * attn.qk_head_dim, bias=False)
        else:
            attn.q_a_proj = nn.Linear(two_h, config.q_lora_rank, bias=False)
        attn.kv_a_proj_with_mqa = nn.Linear(
            two_h, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        _latent_norms(attn, config)
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


COMPONENTS = ModelComponents(MLAEagle3FirstLayer, MLADecoderLayer, DeepseekV3RMSNorm,
                             DeepseekV3RotaryEmbedding)


def register() -> None:
    """Make speculators' Eagle3 draft build (and reload) MLA layers for a
    `transformer_layer_config` of model_type "deepseek_v3". Idempotent.
    (`speculators.models.eagle3.core` imported the same dict object, so
    drafts built after this see the entry.)"""
    model_definitions.model_classes[MODEL_TYPE] = COMPONENTS
