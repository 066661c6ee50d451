"""The compatibility layer's run-time adapters against the test doubles of
each vLLM generation (tests/vllm_doubles.py), and the log / metrics parsers
against lines in vLLM's formats."""

import pytest

from pipeline.vllm import compat as c
from pipeline.vllm import kv
from pipeline.vllm.kv import KvLogReader, parse_metrics
from tests.fakes import vllm_doubles as d


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(c, "_fired", {})


def test_kv_config_style_follows_the_signature():
    assert c.kv_config_style(["vllm_config", "kv_cache_groups", "kv_cache_specs",
                              "available_memory"]) == "specs"
    assert c.kv_config_style(["vllm_config", "kv_cache_groups", "available_memory"]) == "memory"
    with pytest.raises(c.CompatError, match="neither kv_cache_specs nor available_memory"):
        c.kv_config_style(["vllm_config", "kv_cache_groups", "num_blocks"])


def test_compilation_off_and_the_two_step_execute():
    assert c.compilation_off(d.CompilationConfig_0_11).__dict__ == {"level": 0}
    assert "compilation_mode" not in c.fired_so_far()
    assert c.compilation_off(d.CompilationConfig_0_12).mode == 0
    assert "compilation_mode" in c.fired_so_far()

    class Sched:
        def get_grammar_bitmask(self, so):
            return ("grammar", so)

        def update_from_output(self, so, out):
            return (so, out)

    class Exec011:
        def execute_model(self, so):
            return "sampled"

    class Exec012:
        def execute_model(self, so):
            return None

        def sample_tokens(self, grammar):
            return ("sampled after", grammar)
    assert c.run_step(Exec011(), Sched(), "so") == ("so", "sampled")
    assert "sample_tokens" not in c.fired_so_far()
    assert c.run_step(Exec012(), Sched(), "so") == ("so", ("sampled after", ("grammar", "so")))
    assert "sample_tokens" in c.fired_so_far()


def test_scheduler_config_initvars_only_where_required():
    old = c.make_scheduler_config(d.SchedulerConfig_0_11, 4096, False, max_num_seqs=8)
    assert old.max_model_len == 4096 and old.max_num_seqs == 8
    assert "scheduler_initvars" not in c.fired_so_far()
    new = c.make_scheduler_config(d.SchedulerConfig_0_12, 4096, False, max_num_seqs=8)
    assert new.seen == {"max_model_len": 4096, "is_encoder_decoder": False}
    assert "is_encoder_decoder" in c.fired_so_far()["scheduler_initvars"]


def test_scheduler_block_size_and_request_eos():
    kw = dict(vllm_config=None, kv_cache_config=None, structured_output_manager=None)
    assert c.make_scheduler(d.Scheduler_0_11, 16, **kw).block_size is None
    assert c.make_scheduler(d.Scheduler_0_12, 16, **kw).block_size == 16
    rq = dict(request_id="r", prompt_token_ids=[1, 2], sampling_params=None, pooling_params=None)
    assert c.make_request(d.Request_0_12, 7, **rq).eos_token_id == 7
    assert "request_no_eos" not in c.fired_so_far()
    r = c.make_request(d.Request_0_17, 7, **rq)
    assert r.prompt_token_ids == [1, 2] and not hasattr(r, "eos_token_id")
    assert "request_no_eos" in c.fired_so_far()


def test_each_adaptation_is_logged_once(capsys):
    for _ in range(3):
        c.make_request(d.Request_0_17, 7, request_id="r", prompt_token_ids=[1],
                       sampling_params=None, pooling_params=None)
    assert capsys.readouterr().out.count("vllm-compat:") == 1


def test_kv_cache_event_from_both_tensor_layouts():
    """Llama-3.1-8B-like: 32 layers, 8 KV heads x 128 dims, bf16, block 16:
    page = 2 (K,V) x 16 x 8 x 128 x 2 B = 65,536 B per layer per block."""
    page, layers, blocks = 65_536, 32, 10_000
    groups = [d.KVCacheGroupSpec([f"l{i}" for i in range(layers)], d.FullAttentionSpec(16, page))]
    old = d.KVCacheConfig(blocks, [d.KVCacheTensor_0_24(page * blocks, [f"l{i}"])
                                   for i in range(layers)], groups)
    new = d.KVCacheConfig(blocks, [d.KVCacheTensor_0_29(page * layers * blocks,
                                                        [f"l{i}" for i in range(layers)],
                                                        page * blocks, page)], groups)
    for cfg in (old, new):
        ev = kv.kv_cache_event(cfg, 16, 8192)
        assert ev["total_bytes"] == page * layers * blocks == 20_971_520_000
        assert ev["bytes_per_block"] == page * layers
        assert ev["tokens_capacity"] == 160_000
        assert ev["max_concurrency"] == round(160_000 / 8192, 2)
        assert ev["groups"] == [{"spec": "FullAttentionSpec", "num_layers": 32,
                                 "page_size_bytes": page, "block_size": 16}]
    # 0.29: two groups overlaying one allocation must not count it twice.
    two = d.KVCacheConfig(blocks, [d.KVCacheTensor_0_29(page * 16 * blocks, [f"l{i}" for i in
                                                                             range(16)], page, 0),
                                   d.KVCacheTensor_0_29(page * 16 * blocks, [f"m{i}" for i in
                                                                             range(16)], page, 0)],
                          groups * 2)
    assert kv.kv_cache_event(two, 16, 8192)["total_bytes"] == page * 16 * blocks


# Lines as vLLM prints them (format strings of the named versions).
LINES = {
    "0.11": ["INFO 11-29 10:00:00 [gpu_worker.py:298] Available KV cache memory: 110.47 GiB",
             "INFO 11-29 10:00:01 [kv_cache_utils.py:1087] GPU KV cache size: 1,234,560 tokens",
             "INFO 11-29 10:00:01 [kv_cache_utils.py:1091] Maximum concurrency for 8,192 tokens "
             "per request: 150.70x"],
    "0.29": ["(EngineCore_DP0 pid=7) INFO 11-29 10:00:00 [gpu_worker.py:626] Available KV cache "
             "memory: 110.47 GiB",
             "(EngineCore_DP0 pid=7) INFO 11-29 10:00:01 [kv_cache_utils.py:2033] GPU KV cache "
             "size: 1,234,560 tokens, Maximum concurrency for 8,192 tokens per request: 150.70x"],
    "0.33": ["(Worker_TP0 pid=9) INFO 11-29 10:00:00 [gpu_worker.py:773] Available KV cache "
             "memory: 110.47 GiB",
             "(EngineCore pid=7) INFO 11-29 10:00:01 [kv_cache_utils.py:1148] GPU + host KV "
             "cache size: 1,234,560 tokens, Maximum concurrency for 8,192 tokens per request: "
             "150.70x"],
}


@pytest.mark.parametrize("version", sorted(LINES))
def test_kv_log_lines(version):
    r = KvLogReader()
    assert r.event() is None
    assert not r.feed("INFO 11-29 10:00:00 [core.py:1] Started engine")
    for line in LINES[version]:
        assert r.feed(line)
    ev = r.event()
    assert ev["tokens_capacity"] == 1_234_560 and ev["max_concurrency"] == 150.7
    assert ev["max_model_len"] == 8192 and ev["total_bytes"] == int(110.47 * (1 << 30))
    assert ev["source"] == "log" and ev["pool"] in ("GPU", "GPU + host")


def test_metrics_page():
    text = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="kimi"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="kimi"} 0.35
vllm:num_requests_running{engine="0",model_name="kimi"} 12.0
vllm:num_requests_running{engine="1",model_name="kimi"} 4.0
vllm:num_requests_waiting{engine="0",model_name="kimi"} 3.0
"""
    m = parse_metrics(text)
    assert m == {"usage_perc": pytest.approx(0.3), "running": 16, "waiting": 3}
    assert parse_metrics("# nothing here\n") is None


def test_cpu_flags_are_read_as_linux_spells_them(tmp_path):
    """The flags vLLM's CPU kernels choose by, from /proc/cpuinfo's own spelling
    (AVX-512 BF16 is `avx512_bf16` there): a Sapphire Rapids line gives all five."""
    from pipeline.envprobe import cpu_flags
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 "
                    "amx_bf16 amx_tile avx512_vnni\nbugs\t\t: spectre_v1\n")
    assert cpu_flags(str(info)) == ["amx_bf16", "avx2", "avx512_bf16", "avx512f", "fma"]
    info.write_text("flags\t\t: fpu sse2 avx2\n")
    assert cpu_flags(str(info)) == ["avx2"]
    assert cpu_flags(str(tmp_path / "missing")) == []
