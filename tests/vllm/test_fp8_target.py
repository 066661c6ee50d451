"""DeepSeek-V3's and Kimi-K2's released format end to end (issue 51): a tiny
DeepseekV3ForCausalLM (MLA + MoE, random weights, tiny-kimi's tokenizer)
block-quantized to FP8 by transformers' own op, 128x128 blocks with a partial
last one where the release has it (tests/fakes/fp8_target.py).

vLLM's CPU build serves it on a host with AMX tiles (Intel Sapphire Rapids or
newer): its W8A16 FP8 block kernel and FP8 MoE take the target, so the whole
pipeline runs through vLLM, evaluate included — a quantized MoE target served
here. Without AMX (an AMD EPYC, 2026-12-08) vLLM refuses to build it ("requires
AMX tile support"), and doctor blocks the run, quoting vLLM. The hf route cannot: transformers
dequantizes FP8 on the CPU only in whole blocks, and DeepSeek-V3's
kv_a_proj_with_mqa is 576 rows; doctor and the launch say so from the
weights' headers, and this file holds that rule against the real
transformers."""

import pytest
import torch

from pipeline.envprobe import cpu_flags
from pipeline.model.info import read_model
from pipeline.run.rundir import RunDir
from tests.configs import tiny_pipeline, write
from tests.fakes import fp8_target
from tests.helpers import cli, slot_errors, stage_summary


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from pipeline import builtin
    tmp = tmp_path_factory.mktemp("fp8")
    kimi = builtin.target("builtin:tiny-kimi").ensure_built()
    bf16 = fp8_target.bf16_target(kimi, tmp / "ds3-bf16")
    return bf16, fp8_target.make(bf16, tmp / "ds3-fp8")


def config(folder, **stages) -> dict:
    return tiny_pipeline("f", 24, model={"target": str(folder), "trust_remote_code": True,
                                         "dtype": "bfloat16"},
                         stages={"train": {"epochs": 1}, "vocab": {"draft_vocab_size": 200},
                                 **stages})


def test_the_hf_route_is_refused_before_transformers_refuses_it(target, tmp_path):
    """The partial blocks read from the headers; transformers itself refusing
    to load the folder on the CPU (the rule's ground: when a release of it
    loads the folder, this fails and the rule goes); `run` with backend
    "hf" refused at launch, naming the weight, with nothing created."""
    from transformers import AutoModelForCausalLM
    _, fp8 = target
    m = read_model(fp8)
    assert m.quant.text().startswith("fp8: fp8 (e4m3), blocks 128x128"), m.quant.text()
    assert m.partial_blocks == tuple(
        f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight 576x128 in 5x1 blocks"
        for i in range(4)), m.partial_blocks
    if not torch.cuda.is_available():   # (on a GPU transformers may keep FP8 undequantized)
        with pytest.raises(RuntimeError, match="conversion of the weights"):
            AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.float32)
    write(tmp_path / "config.toml", config(fp8, extract={"backend": "hf"}))
    p = cli("run", cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "kv_a_proj_with_mqa.weight 576x128 in 5x1 blocks (and 3 more)" in p.stderr, p.stderr
    assert 'backend = "vllm-server" (or "auto")' in p.stderr
    assert not (tmp_path / "runs").exists()


def test_auto_with_neither_route_is_refused_at_launch(target, vllm_env, tmp_path):
    """Where doctor found that vLLM cannot build the target here (recorded:
    an FP8 build a CPU lacks the kernels for, stood in by a recorded answer on
    a copy of the folder, since this vLLM builds it), `backend = "auto"`
    would extract on hf, which refuses the partial blocks: the launch, which
    asks no vLLM, reads the record and refuses both routes at once, exit 2,
    nothing created."""
    import json
    import shutil

    from pipeline.vllm import validation
    _, fp8 = target
    copy = shutil.copytree(fp8, tmp_path / "ds3-fp8")
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "_test": str(tmp_path)}))
    validation.record_model(vllm_env.python, copy, "NotImplementedError: (recorded by this test)",
                            vllm_env.vllm_dir)
    write(tmp_path / "config.toml", config(copy, extract={"backend": "auto"}))
    p = cli("run", cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert 'backend = "auto" has no route for this target on this machine' in p.stderr and \
        "kv_a_proj_with_mqa.weight 576x128 in 5x1 blocks" in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists()


def test_an_fp8_deepseek_v3_runs_the_whole_pipeline_through_vllm(target, vllm_env, tmp_path):
    """doctor: auto -> vllm-server, nothing skipped; the run: extract through
    `vllm serve`, the MLA draft trained and measured by vLLM beside the FP8
    target. Its hidden states against the same weights unquantized (hf,
    float32: bf16 arithmetic apart) and against the bf16 weights before
    quantization (FP8's own error, larger), per layer slot."""
    from pipeline.extract.hf import HFBackend
    bf16, fp8 = target
    write(tmp_path / "config.toml", config(fp8, evaluate={
        "max_prompts": 4, "max_tokens": 24, "baseline": False}))
    doc = cli("doctor", cwd=tmp_path, timeout=600)
    if "amx_bf16" not in cpu_flags():
        # vLLM 0.32's CPU FP8 block kernels (W8A16 and W8A8) need AMX tiles: doctor asks
        # vLLM, quotes its refusal, and with hf refusing the partial blocks blocks the run
        assert doc.returncode == 1, doc.stdout + doc.stderr
        assert "requires AMX tile support" in doc.stdout, doc.stdout
        assert '[ BLOCK ] backends    backend = "auto" has no route' in doc.stdout, doc.stdout
        assert "fix: extract on a GPU" in doc.stdout, doc.stdout
        pytest.skip("vLLM 0.32's CPU build has FP8 block kernels on AMX hosts only (Intel "
                    "Sapphire Rapids or newer); this CPU has no AMX: doctor's refusal checked, "
                    "the pipeline not run")
    assert doc.returncode == 0 and "[ BLOCK ]" not in doc.stdout, doc.stdout + doc.stderr
    assert '"auto" -> vllm-server' in doc.stdout and "evaluate will be skipped" not in doc.stdout
    assert "quantized: fp8: fp8 (e4m3), blocks 128x128" in doc.stdout, doc.stdout
    p = cli("run", "--wait", cwd=tmp_path, timeout=1500)
    rd = RunDir(tmp_path / "runs" / "f")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert stage_summary(rd, "extract")["backend"] == "vllm-server"
    ev = stage_summary(rd, "evaluate")
    assert ev["acceptance_length"] >= 1.0, ev
    cli("export", cwd=tmp_path, check=0)   # the card names what the draft was trained beside
    (card,) = (rd.path / "export").glob("*/README.md")
    assert "- the target's quantization: fp8: fp8 (e4m3), blocks 128x128" in card.read_text()
    same = HFBackend.load(fp8_target.dequantized_folder(fp8, bf16, tmp_path / "deq"),
                          [1, 2, 3, 4], "cpu", torch.float32, True)
    before = HFBackend.load(bf16, [1, 2, 3, 4], "cpu", torch.float32, True)
    err = {"same": slot_errors(rd, same, 4), "before": slot_errors(rd, before, 4)}
    print(f"FP8 DeepSeek-V3 through vLLM, relative error per slot (layers 1, 2, 3, last): vs "
          f"the same weights {[f'{e:.2%}' for e in err['same']]}, vs the bf16 weights before "
          f"quantization {[f'{e:.2%}' for e in err['before']]}; acceptance "
          f"{ev['acceptance_length']:.2f}")
    assert max(err["same"]) < 0.05 and max(err["same"]) < max(err["before"]), err


def test_an_mla_target_without_rope_scaling_matches_the_hf_backend(vllm_env, tmp_path):
    """Issue 51's MLA gap, closed: on a DeepSeek-V3 with plain rope (no yarn)
    vLLM's CPU build gave hidden states ~1% off the hf backend's from
    position 1 on (up to 19% on the issue's target, 25% on this one),
    position 0 exact. Its rotary kernel
    mis-rotates the strided query view MLA hands it; target_flags turns that
    custom op off (`--compilation-config`), and every slot at every position
    agrees to float32's noise (tiny-kimi's yarn rope, torch code in vLLM,
    always did: tests/vllm/test_kimi_pipeline.py)."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from pipeline import builtin
    from pipeline.extract.hf import HFBackend
    target = fp8_target.bf16_target(builtin.target("builtin:tiny-kimi").ensure_built(),
                                    tmp_path / "ds3-rope", yarn=False)
    write(tmp_path / "config.toml", tiny_pipeline("r", 8, model={
        "target": str(target), "trust_remote_code": True, "dtype": "float32"},
        stages={"extract": {"backend": "vllm-server"}}))
    for stage in ("prepare", "extract"):
        p = cli("run", "--stage", stage, "--wait", cwd=tmp_path, timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rd = RunDir(tmp_path / "runs" / "r")
    assert '"custom_ops": ["-rotary_embedding"]' in (rd.stage_dir("extract") / "vllm-0.log") \
        .read_text().replace("'", '"'), "the rope flag did not reach the server"
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    ref = HFBackend.load(target, [1, 2, 3, 4], "cpu", torch.float32, True)
    worst = 0.0
    for i in range(8):
        got = load_file(rd.out_dir("extract") / "hidden_states" / f"hs_{i}.safetensors")
        want = ref.forward([ds[i]["input_ids"]])[0]
        rel = (got["hidden_states"] - want).norm(dim=-1) / want.norm(dim=-1)   # [T, slot]
        worst = max(worst, rel.max().item())
    print(f"MLA, plain rope: vLLM vs hf, worst relative error at any position and slot "
          f"{worst:.1e}")
    assert worst < 1e-4
