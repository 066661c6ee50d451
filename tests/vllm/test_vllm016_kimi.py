"""The vllm-engine backend on a real vLLM 0.16 (its CPU build, .venv-vllm016:
`scripts/install.sh --vllm016`; skipped without it) with the built-in Kimi
target's text decoder: DeepSeek-V3 with MLA (kv_lora_rank 512 + rope 64,
q LoRA) and a MoE (8 routed + 1 shared, noaux_tc sigmoid routing after a
dense first layer).

What it pins (measured 2026-12-01 on 2 shared cores: prepare ~6 s, each
extract ~20-25 s):
- builtin:tiny-kimi itself cannot run there: the stage's own
  AutoConfig (transformers 4.57) has no `kimi_k25` model type, and its
  tokenizer subclasses TokenizersBackend (transformers 5 only). Its text
  decoder is made a model folder here (`make_decoder`) that transformers
  4.57 and 5.19 both load with the same logits as the wrapper's.
- vLLM 0.16's CPU platform has no MLA backend: CpuPlatform.get_attn_backend_cls
  (vllm/platforms/cpu.py) raises NotImplementedError("MLA is not supported
  on CPU.") when the worker builds the first MLAAttention; the stage then
  reports only vLLM's generic "WorkerProc initialization failed", the
  cause is in its log. VLLM_MLA_DISABLE=1 (ModelConfig.use_mla False) runs
  the same weights through DeepseekV2Attention (the latent expanded by
  kv_b_proj, head size nope + rope = 96, v padded to 96) on CPU_ATTN, whose
  head sizes include 96; the MoE runs on vLLM's CPUFusedMOE.
- The adaptations that fire on 0.16: SchedulerConfig's required InitVars,
  async_scheduling, CompilationConfig(mode=), Scheduler(block_size=),
  sample_tokens. Not kv_config_specs (0.16's get_kv_cache_config_from_groups
  takes available_memory; the 0.11 signature is the one with kv_cache_specs),
  no SupportsEagle3 (DeepseekV3 implements it from 0.18; the engine route's
  hooks do not need it), no trust_remote_code (the folder has no remote code).
- The files against the hf backend: within 6e-4 absolute per slot. Nearly
  all of that is one model-definition difference: transformers' DeepSeek-V3
  builds q_a_layernorm and kv_a_layernorm with eps 1e-6 (its default), vLLM
  with config.rms_norm_eps (tiny-kimi: 1e-5). With hf's eps set to vLLM's,
  within 3e-5 (float32 noise: hf float32 vs float64 is 2-4e-5 here).
"""

import json
import os
import shutil
import subprocess
import textwrap

import pytest
import torch

from pipeline.paths import PROJECT_ROOT
from pipeline.run.events import read_events
from tests.configs import render, write
from tests.helpers import ROOT, finished, hs_files, prepared_once

pytestmark = pytest.mark.vllm016
PY = PROJECT_ROOT / ".venv-vllm016" / "bin" / "python"
N = 16
LAYER_IDS = [1, 2, 3, 4]       # aux 1, 2, 3 + the last layer (4 layers)
FIRED_ON_016 = {"scheduler_initvars", "async_scheduling", "compilation_mode",
                "scheduler_block_size", "sample_tokens"}


def make_decoder(out):
    """tiny-kimi's text model as a DeepseekV3ForCausalLM folder: the text
    config at top level (rope under its legacy names too, which transformers
    4.57 and vLLM 0.16 read), the `language_model.` weights without that
    prefix, the tokenizer as a plain PreTrainedTokenizerFast."""
    from safetensors.torch import load_file, save_file

    from pipeline.builtin import tiny_kimi
    src = tiny_kimi.ensure_built()
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(tiny_kimi.describe()["text_config"])
    rope = cfg["rope_parameters"]
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               topk_method="noaux_tc", scoring_func="sigmoid", rope_theta=rope["rope_theta"],
               rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    prefix = "language_model."
    weights = {k[len(prefix):]: v for k, v in load_file(str(src / "model.safetensors")).items()
               if k.startswith(prefix)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(src / tiny_kimi.TOKENIZER_FILE, out / "tokenizer.json")
    tok = json.loads((src / "tokenizer_config.json").read_text())
    for key in ("auto_map", "backend"):
        tok.pop(key, None)
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    specials = ("bos_token", "eos_token", "unk_token", "pad_token")
    (out / "special_tokens_map.json").write_text(json.dumps({k: tok[k] for k in specials}))
    for name in ("chat_template.jinja", "generation_config.json"):
        shutil.copyfile(src / name, out / name)
    return out


# Run by transformers 4.57 (.venv-vllm016): token ids and logits of three chats.
LOGITS_457 = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    folder, convs, out = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    res = []
    for m in convs:
        ids = tok(tok.apply_chat_template(m, tokenize=False), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            res.append((ids, model(input_ids=torch.tensor([ids])).logits[0]))
    torch.save({"tok": type(tok).__name__, "model": type(model).__name__, "res": res}, out)
    """)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    if not PY.exists():
        pytest.skip("no vLLM 0.16 here: `scripts/install.sh --vllm016` makes .venv-vllm016")
    return make_decoder(tmp_path_factory.mktemp("kimi016") / "decoder")


def config_tables(folder, mla_disable: bool = True) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"} | ({"VLLM_MLA_DISABLE": "1"} if mla_disable else {})
    return {"runtime": {"python": str(PY), "vllm_python": str(PY), "env": env},
            "model": {"target": str(folder)},
            "data": {"max_samples": N},
            "stages": {"extract": {"backend": "vllm-engine", "layer_ids": LAYER_IDS[:-1],
                                   "batch_tokens": 256, "max_num_seqs": 4}}}


def extract(config, run_dir, mla_disable: bool):
    """The extract stage in vLLM 0.16's interpreter, as the driver starts it
    (its [runtime] env, which the stage itself does not read, in the environment)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_MLA_DISABLE", None)
    if mla_disable:
        env["VLLM_MLA_DISABLE"] = "1"
    return subprocess.run([str(PY), "-m", "pipeline.stages.extract", "--run-dir", str(run_dir),
                           "--config", str(config)], env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def prepared(decoder, tmp_path_factory):
    return prepared_once(tmp_path_factory, "kimi016run", render(config_tables(decoder)))


@pytest.fixture(scope="module")
def extracted(prepared):
    tmp, rd = prepared
    return tmp, rd, extract(tmp / "config.toml", rd.path, mla_disable=True)


def test_the_decoder_folder_loads_alike_in_transformers_457_and_519(decoder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.builtin import conversations_path, tiny_kimi
    from pipeline.extract.hf import load_model
    convs = [json.loads(line)["messages"] for line in open(conversations_path())][:3]
    (tmp_path / "convs.json").write_text(json.dumps(convs))
    (tmp_path / "logits.py").write_text(LOGITS_457)
    p = subprocess.run([str(PY), str(tmp_path / "logits.py"), str(decoder),
                        str(tmp_path / "convs.json"), str(tmp_path / "457.pt")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    old = torch.load(tmp_path / "457.pt")
    assert (old["tok"], old["model"]) == ("PreTrainedTokenizerFast", "DeepseekV3ForCausalLM")
    kimi = AutoTokenizer.from_pretrained(str(tiny_kimi.ensure_built()), trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(str(decoder))
    model = AutoModelForCausalLM.from_pretrained(str(decoder), dtype=torch.float32).eval()
    wrapper = load_model(tiny_kimi.ensure_built(), torch.float32, True).eval()
    for m, (ids_457, logits_457) in zip(convs, old["res"], strict=True):
        ids = tok(tok.apply_chat_template(m, tokenize=False), add_special_tokens=False)["input_ids"]
        remote = kimi(kimi.apply_chat_template(m, tokenize=False),
                      add_special_tokens=False)["input_ids"]
        assert ids == ids_457 == remote
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            whole = wrapper(input_ids=torch.tensor([ids])).logits[0]
        assert (logits - logits_457).abs().max() < 1e-5     # measured: 0
        assert (logits - whole).abs().max() < 1e-5          # measured: 0


def test_mla_on_vllm_016_cpu_stops_in_its_platform(prepared, decoder):
    tmp, rd = prepared
    run = tmp / "mla-on"
    shutil.copytree(rd.path, run)
    shutil.rmtree(run / "extract", ignore_errors=True)
    write(tmp / "config-mla.toml", config_tables(decoder, mla_disable=False))
    p = extract(tmp / "config-mla.toml", run, mla_disable=False)
    assert p.returncode != 0
    log = p.stdout + p.stderr
    assert "NotImplementedError: MLA is not supported on CPU." in log, log[-3000:]
    assert "vllm/platforms/cpu.py" in log
    assert not list((run / "extract" / "out" / "hidden_states").glob("hs_*.safetensors"))


def test_engine_route_with_mla_disabled_writes_the_hf_numbers(extracted, decoder):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from pipeline.extract.hf import HFBackend
    tmp, rd, p = extracted
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len(hs_files(rd)) == N
    assert "DeepseekV3ForCausalLM (DeepseekV2Model, 4 layers)" in p.stdout
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    ref = HFBackend.load(decoder, LAYER_IDS, "cpu", torch.float32)

    def worst() -> list[float]:
        out = [0.0] * len(LAYER_IDS)
        for i in range(N):
            got = load_file(str(rd.out_dir("extract") / f"hidden_states/hs_{i}.safetensors"))
            assert got["token_ids"].tolist() == ds[i]["input_ids"]
            want = ref.forward([ds[i]["input_ids"]])[0]
            for s in range(len(LAYER_IDS)):
                out[s] = max(out[s], (got["hidden_states"][:, s] - want[:, s]).abs().max().item())
        return out
    as_is = worst()
    # transformers' q_a/kv_a RMSNorms use eps 1e-6 whatever the config says; vLLM's use
    # rms_norm_eps (1e-5 here): give hf's vLLM's eps and the gap is float32 noise
    eps = json.loads((decoder / "config.json").read_text())["rms_norm_eps"]
    norms = [m for name, m in ref.model.named_modules()
             if name.endswith(("q_a_layernorm", "kv_a_layernorm"))]
    assert len(norms) == 8
    for m in norms:
        m.variance_epsilon = eps
    aligned = worst()
    print("vLLM 0.16 engine route vs hf per slot (ids 1, 2, 3, 4): "
          f"{[f'{x:.1e}' for x in as_is]}; with hf's q_a/kv_a eps = {eps}: "
          f"{[f'{x:.1e}' for x in aligned]}")
    assert max(as_is) < 2e-3       # measured 2.3e-4 .. 5.5e-4
    assert max(aligned) < 1e-4     # measured 1.2e-5 .. 2.3e-5


def test_the_adaptations_that_fire_on_016(extracted, decoder):
    from pipeline.vllm import compat
    from pipeline.vllm.environment import probe
    tmp, rd, p = extracted
    summary = finished(read_events(rd.events_path("extract")))["summary"]
    assert summary["backend"] == "vllm-engine"
    assert set(summary["adaptations"]) == FIRED_ON_016
    src = probe(str(PY)).source()
    plan = {a.key: a.fires for a in compat.plan(src, "DeepseekV3ForCausalLM")}
    # 0.16's get_kv_cache_config_from_groups has no kv_cache_specs (0.11's does)
    assert plan["kv_config_specs"] is False
    # no SupportsEagle3 on DeepseekV3 in 0.16 (from 0.18): the hooks do not need it
    assert plan["eagle3"] is True and "0.18.0" in compat.eagle3_support(
        src, "DeepseekV3ForCausalLM").detail
    # no remote code anywhere in the folder: trust_remote_code stays off (the default)
    assert not any("auto_map" in (decoder / f).read_text()
                   for f in ("config.json", "tokenizer_config.json"))


def test_doctor_predicts_what_fired(extracted):
    from pipeline import config as config_mod
    from pipeline import doctor
    tmp, rd, _ = extracted
    fired = set(finished(read_events(rd.events_path("extract")))["summary"]["adaptations"])
    cfg = config_mod.load(tmp / "config.toml")
    predicted = {f.key for f in doctor.diagnose(cfg, gpus=None) if f.area == "compat" and f.key}
    assert predicted == fired, (predicted, fired)
