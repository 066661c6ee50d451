"""The user's target format end to end (issue 51): tiny-kimi with its
routed experts in Kimi-K2.5's released INT4 (compressed-tensors, group 32;
tests/fakes/int4_target.py, quantized by compressed-tensors itself).

On this machine vLLM's CPU build has no INT4 MoE kernel for DeepSeek-V3
routing; doctor asks vLLM, which says so, and the run goes around it:
extract on hf (transformers dequantizes through compressed-tensors), vocab,
train (an MLA draft), evaluate skipped with vLLM's words; nothing fails.
The hidden states are those of the dequantized weights (the hf backend on
the same folder), and their distance from the unquantized target's is
reported per layer."""

import json

import pytest
import torch

from pipeline.run.rundir import RunDir
from tests.configs import tiny_pipeline, write
from tests.fakes import int4_target
from tests.helpers import cli, slot_errors, stage_summary

WNA16 = "No WNA16 MoE backend supports the deployment configuration"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from pipeline import builtin
    src = builtin.target("builtin:tiny-kimi").ensure_built()
    return src, int4_target.make(src, tmp_path_factory.mktemp("int4") / "kimi-int4")


def test_transformers_loads_what_compressed_tensors_packed(target):
    """The hf backend's load of the INT4 folder holds compressed-tensors' own
    dequantization of each expert (to bf16 rounding: transformers keeps the
    dequantized experts in bf16), which differs from the original weights by
    int4's step; doctor's model line names the scheme."""
    from safetensors.torch import load_file

    from pipeline.extract.hf import HFBackend
    from pipeline.model.info import read_model
    src, folder = target
    want, orig = int4_target.dequantized(folder), load_file(str(src / "model.safetensors"))
    sd = HFBackend.load(folder, [1, 2, 3], "cpu", torch.float32, True).model.state_dict()
    worst = quant = 0.0
    biggest = max(w.abs().max().item() for w in want.values())
    for layer in (1, 2, 3):
        stem = f"language_model.model.layers.{layer}.mlp.experts"
        gate_up = sd[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"].float()
        down = sd[f"model.language_model.layers.{layer}.mlp.experts.down_proj"].float()
        for e in range(gate_up.shape[0]):
            w = {p: want[f"{stem}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")}
            worst = max(worst, (gate_up[e] - torch.cat([w["gate"], w["up"]])).abs().max().item(),
                        (down[e] - w["down"]).abs().max().item())
            quant = max(quant, (w["down"] - orig[f"{stem}.{e}.down_proj.weight"]).abs().max()
                        .item())
    print(f"loaded vs compressed-tensors' dequantization: {worst:.1e}; "
          f"dequantized vs original: {quant:.1e}")
    # bf16's rounding (half a step of 2^-7, relative) against int4's step, far larger
    assert worst <= 2 ** -8 * biggest and quant > 10 * worst
    q = read_model(folder).quant
    assert q is not None and q.text().startswith("compressed-tensors: int4, group 32"), q


def test_the_int4_target_runs_around_what_vllm_cannot(target, tmp_path):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from pipeline.extract.hf import HFBackend
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    if not py.exists() or probe(str(py)).unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    src, folder = target
    write(tmp_path / "config.toml", tiny_pipeline("q", 24, model={
        "target": str(folder), "trust_remote_code": True},
        stages={"train": {"epochs": 1}, "vocab": {"draft_vocab_size": 200}}))
    doc = cli("doctor", cwd=tmp_path, timeout=600)
    assert doc.returncode == 0 and "[ BLOCK ]" not in doc.stdout, doc.stdout + doc.stderr
    assert 'backend = "auto" -> hf' in doc.stdout and WNA16 in doc.stdout, doc.stdout
    assert "evaluate will be skipped" in doc.stdout
    p = cli("run", "--wait", cwd=tmp_path, timeout=1500)
    rd = RunDir(tmp_path / "runs" / "q")
    st = rd.read_state()["stages"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [st[s]["status"] for s in ("prepare", "extract", "vocab", "train", "evaluate")] == \
        ["succeeded"] * 4 + ["skipped"], st
    assert stage_summary(rd, "extract")["backend"] == "hf"
    assert WNA16 in json.dumps(st["evaluate"]) or WNA16 in rd.log_path("evaluate").read_text()
    assert stage_summary(rd, "train")["acceptance_length"] >= 1.0
    # the hidden states: the dequantized weights' (the same folder through the hf backend),
    # and how far the unquantized target's are, per layer slot
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    same = HFBackend.load(folder, [1, 2, 3, 4], "cpu", torch.float32, True)
    full = HFBackend.load(src, [1, 2, 3, 4], "cpu", torch.float32, True)
    noise = 0.0
    for i in range(4):
        got = load_file(rd.out_dir("extract") / "hidden_states" / f"hs_{i}.safetensors")
        hs = got["hidden_states"].float()
        noise = max(noise, (hs - same.forward([ds[i]["input_ids"]])[0]).abs().max().item())
    err = slot_errors(rd, full, 4)
    print(f"INT4 experts vs the unquantized target, relative error per slot (layers 1, 2, 3, "
          f"last): {[f'{e:.2%}' for e in err]}; vs the same weights: {noise:.1e}")
    assert noise < 1e-4 and 0 < err[-1] < 0.5


def test_a_dense_int4_llama_runs_the_whole_pipeline_through_vllm(tmp_path):
    """Where vLLM has the kernel, the quantized target is vLLM's: tiny-llama
    with every decoder Linear in the same INT4 scheme, served by the CPU
    build's INT4 linear kernel — extract through `vllm serve`, and evaluate
    measuring a trained EAGLE-3 draft beside it. Its hidden states per
    layer slot against the hf backend's dequantization of the same folder
    (the kernel) and against tiny-llama's weights before quantization (INT4
    itself)."""
    from pipeline import builtin
    from pipeline.extract.hf import HFBackend
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    if not py.exists() or probe(str(py)).unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    src = builtin.target("builtin:tiny-llama").ensure_built()
    folder = int4_target.make(src, tmp_path / "llama-int4", int4_target.is_decoder_linear,
                              int4_target.DENSE_IGNORE)
    # bfloat16: the CPU build's INT4 GEMM has no float32 kernel ("cpu_gemm_wna16" not
    # implemented for 'Float', at its first call: the meta-device build cannot see it);
    # doctor says so in float32 (the CPU stages' "auto"), from a rule
    def config(dtype):
        write(tmp_path / "config.toml", tiny_pipeline("d", 16, model={
            "target": str(folder), "dtype": dtype}, stages={"train": {"epochs": 1}, "evaluate": {
                "max_prompts": 4, "max_tokens": 24, "baseline": False}}))
    config("auto")
    doc = cli("doctor", cwd=tmp_path, timeout=600)
    assert doc.returncode == 1 and "cpu_gemm_wna16 kernel, which has no float32 kernel" in \
        doc.stdout and '[model] dtype = "bfloat16"' in doc.stdout, doc.stdout
    config("bfloat16")
    doc = cli("doctor", cwd=tmp_path, timeout=600)
    assert doc.returncode == 0 and "[ BLOCK ]" not in doc.stdout, doc.stdout + doc.stderr
    assert '"auto" -> vllm-server' in doc.stdout and "evaluate will be skipped" not in doc.stdout
    p = cli("run", "--wait", cwd=tmp_path, timeout=1500)
    rd = RunDir(tmp_path / "runs" / "d")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert stage_summary(rd, "extract")["backend"] == "vllm-server"
    ev = stage_summary(rd, "evaluate")
    assert ev["acceptance_length"] >= 1.0, ev
    log = (rd.stage_dir("evaluate") / "vllm-0.log").read_text()
    assert "compressed-tensors" in log.lower() or "compressed_tensors" in log.lower(), log[-2000:]
    same = slot_errors(rd, HFBackend.load(folder, [1, 2, 3, 4], "cpu", torch.float32, False), 4)
    before = slot_errors(rd, HFBackend.load(src, [1, 2, 3, 4], "cpu", torch.float32, False), 4)
    print(f"dense INT4 Llama through vLLM's INT4 kernel, relative error per slot (layers 1, 2, "
          f"3, last): vs the hf backend's dequantization of the same folder "
          f"{[f'{e:.2%}' for e in same]}, vs the weights before quantization "
          f"{[f'{e:.2%}' for e in before]}; acceptance {ev['acceptance_length']:.2f}")
    assert max(same) < 0.05 and max(same) < max(before), (same, before)
