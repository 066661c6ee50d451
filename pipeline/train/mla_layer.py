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

The attention (`MLAAttention`) is transformers' with two costs removed that are
overhead, not arithmetic (profiled on 2 cores at 1024 tokens a step, 3 TTT steps:
0.88 s a step against the Llama draft's 0.35; docs/FACTS.md):
- transformers caches the compressed latents and up-projects the whole cache
  (`kv_b_proj`) again at every TTT step: 1 + 2 + 3 = 6 sequence lengths of
  up-projection for 3. Here each step up-projects only its own tokens and the
  cache holds the expanded keys and values, as the Llama layer's does;
- torch's fused CPU attention (and flash-attn 2) wants one head size for
  q, k and v; MLA's v (v_head_dim) is narrower than q/k (nope + rope), so SDPA
  fell back to its math path (the full score matrix through bmm). There v is
  padded with zeros to the q/k size and the output sliced back: the same
  numbers, the fused kernel. Not on CUDA, whose SDPA and flex attention take
  the narrower v (`pads_v`).
And one that broke the GPU path: the value, a view of `kv_b_proj`'s output,
changed strides once cached, so under speculators' torch.compile (CUDA) every
TTT step recompiled until dynamo's limit and flex attention ran unfused: out of
memory at Kimi-K2.5's shapes on an H200 (8192 tokens). It is made contiguous.
The parameters, their names and shapes are transformers' own, so checkpoints
and the vLLM export (pipeline.train.mla_draft) are unchanged.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from speculators.models.base_components import ModelComponents
from speculators.models.eagle3 import model_definitions
from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    ALL_ATTENTION_FUNCTIONS,
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
    eager_attention_forward,
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


def pads_v(impl: str, device_type: str) -> bool:
    """Whether v is padded to the q/k head size: where the fused kernel wants
    one head size (torch's flash attention on CPU, flash-attn 2). CUDA's SDPA
    (cuDNN) takes a narrower v, and padding there is waste: 602 ms a step
    against 429 (H200, bf16, Kimi-K2.5's shapes, 8192 tokens; bench/draft_steps.py
    --synthetic kimi-k2.5). Flex attention takes it too."""
    return impl == "flash_attention_2" or (impl == "sdpa" and device_type == "cpu")


class MLAAttention(DeepseekV3Attention):
    """transformers' DeepSeek-V3 attention, caching expanded keys and values
    (each TTT step up-projects only its own tokens) and padding v for the fused
    kernels (see the module docstring). Same parameters, same result."""

    def forward(self, hidden_states, position_embeddings, attention_mask,
                past_key_values=None, **kwargs):
        batch_size, seq_length = hidden_states.shape[:-1]
        query, key, value = self._project(hidden_states, position_embeddings)
        impl = self.config._attn_implementation
        pad = (self.qk_head_dim - self.v_head_dim
               if pads_v(impl, hidden_states.device.type) else 0)
        # contiguous: a view of kv_b_proj's output changes strides once cached
        # (torch.cat), and under torch.compile each TTT step then recompiled
        # until dynamo's limit, leaving flex attention unfused (CUDA OOM)
        value = F.pad(value, [0, pad]) if pad > 0 else value.contiguous()
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **kwargs)
        if pad > 0:
            out = out[..., :self.v_head_dim]
        out = out.reshape(batch_size, seq_length, -1).contiguous()
        return self.o_proj(out), weights

    def _project(self, hidden_states, position_embeddings):
        """This step's query, key and value, [batch, heads, seq, dim] (transformers'
        forward up to its cache update, with the up-projection moved before it)."""
        batch_size, seq_length = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(batch_size, seq_length, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, -1)
        k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
        rotate = (apply_rotary_pos_emb_interleave if self.config.rope_interleave
                  else apply_rotary_pos_emb)
        q_rot, k_rot = rotate(q_rot, k_rot, *position_embeddings)
        key, value = self.expand_kv(kv_nope, k_rot)
        return torch.cat((q_pass, q_rot), dim=-1), key, value


def _fast_attention(layer) -> None:
    """Swap the layer's attention class, not the module: its parameters (and the
    random draws that initialised them) stay exactly transformers' own."""
    layer.self_attn.__class__ = MLAAttention


class MLADecoderLayer(DeepseekV3DecoderLayer):
    """Draft layers 1..n-1: hidden_size wide, dense MLP."""

    def __init__(self, config, layer_idx):
        config = _dense(config)
        super().__init__(config, layer_idx)
        _fast_attention(self)
        _latent_norms(self.self_attn, config)


class MLAEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):
    """Draft layer 0: the MLA down projections read 2 x hidden_size."""

    def __init__(self, config, layer_idx, norm_before_residual=False):
        config = _dense(config)
        super().__init__(config, layer_idx)
        _fast_attention(self)
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
