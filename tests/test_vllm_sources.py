"""The compatibility layer's assumptions, checked against vLLM's real source
releases (fetched and cached by tests/vllm_releases.py, read with ast, never
installed): what `vllm_compat.plan` decides for each release, and that the
test doubles have that release's exact parameter lists. Skipped, with the
reason, only when the package index cannot be reached."""

import inspect

import pytest

from pipeline import vllm_compat
from pipeline.vllm_logs import KvLogReader
from tests import vllm_doubles as d
from tests import vllm_releases

FIXED = ["0.11.0", "0.12.0", "0.16.0", "0.17.0", "0.18.0", "0.22.0", "0.29.0"]


@pytest.fixture(scope="module")
def newest() -> str:
    try:
        return vllm_releases.newest()
    except vllm_releases.Unreachable as e:
        pytest.skip(str(e))


def fires(src, arch=None) -> dict[str, bool]:
    return {a.key: a.fires for a in vllm_compat.plan(src, arch)}


def params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


# What fires, per release (FACTS.md's drift table, re-read here).
EXPECTED = {
    "0.11.0": dict(kv_config_specs=True, scheduler_initvars=False, scheduler_block_size=False,
                   request_no_eos=False, kv_tensor_shared_allocation=False, server_route=True),
    "0.12.0": dict(kv_config_specs=False, scheduler_initvars=True, scheduler_block_size=True,
                   request_no_eos=False, kv_tensor_shared_allocation=False, server_route=True),
    "0.16.0": dict(kv_config_specs=False, scheduler_initvars=True, scheduler_block_size=True,
                   request_no_eos=False, kv_tensor_shared_allocation=False, server_route=True),
    "0.17.0": dict(kv_config_specs=False, request_no_eos=True, server_route=False,
                   write_lock=False),
    "0.18.0": dict(request_no_eos=True, server_route=False, write_lock=False),
    "0.22.0": dict(request_no_eos=True, server_route=False, write_lock=True,
                   kv_tensor_shared_allocation=False),
    "0.29.0": dict(kv_tensor_shared_allocation=True, kv_config_module=False, write_lock=True),
}


@pytest.mark.parametrize("version", FIXED)
def test_plan_per_release(version):
    src = vllm_releases.source(version)
    got = fires(src)
    for key, want in EXPECTED[version].items():
        assert got[key] is want, (version, key, got)


def test_newest_release_still_matches_the_layer(newest):
    """The newest release on the index (0.33.0 when written): the layer must
    still find every API it adapts; a failure here is the early warning."""
    src = vllm_releases.source(newest)
    got = fires(src, "DeepseekV3ForCausalLM")
    assert "kv_config_missing" not in got
    assert got["scheduler_initvars"] and got["scheduler_block_size"] and got["request_no_eos"]
    assert got["server_route"] is False and got["write_lock"] is True
    assert got["eagle3"] is False  # implemented: nothing to warn about
    if vllm_compat.version_at_least(newest, "0.33.0"):
        assert got["kv_config_module"] is True  # moved to v1.core.kv_cache_planning


@pytest.mark.parametrize("arch", sorted(vllm_compat.EAGLE3_SINCE))
def test_eagle3_support_begins_where_the_table_says(arch):
    since = vllm_compat.EAGLE3_SINCE[arch]
    before = {"0.18.0": "0.17.0", "0.12.0": "0.11.0"}[since]
    a_before = vllm_compat.eagle3_support(vllm_releases.source(before), arch)
    a_since = vllm_compat.eagle3_support(vllm_releases.source(since), arch)
    assert a_before.fires and a_since.fires is False
    if vllm_compat.version_at_least(before, "0.16.0") or "Kimi" not in arch:
        assert f"vLLM {since} adds it" in a_before.detail


def test_doubles_have_each_releases_parameters():
    s11, s12, s17 = vllm_releases.source("0.11.0"), vllm_releases.source("0.12.0"), vllm_releases.source("0.17.0")
    kv = "get_kv_cache_config_from_groups"
    assert s11.function_params("v1.core.kv_cache_utils", kv) == params(d.kv_config_0_11)
    assert s12.function_params("v1.core.kv_cache_utils", kv) == params(d.kv_config_0_12)
    s33 = vllm_releases.source("0.29.0")
    assert s33.function_params("v1.core.kv_cache_utils", kv) == params(d.kv_config_0_12)
    assert s11.function_params("v1.core.sched.scheduler", "Scheduler.__init__") == params(
        d.Scheduler_0_11.__init__)
    assert s12.function_params("v1.core.sched.scheduler", "Scheduler.__init__") == params(
        d.Scheduler_0_12.__init__)
    assert s17.function_params("v1.core.sched.scheduler", "Scheduler.__init__") == params(
        d.Scheduler_0_12.__init__)
    assert s12.function_params("v1.request", "Request.__init__") == params(d.Request_0_12.__init__)
    assert s17.function_params("v1.request", "Request.__init__") == params(d.Request_0_17.__init__)
    f11 = s11.dataclass_fields("config.scheduler", "SchedulerConfig")
    f12 = s12.dataclass_fields("config.scheduler", "SchedulerConfig")
    assert f11["max_model_len"] is False and "is_encoder_decoder" not in f11
    assert f12["max_model_len"] is True and f12["is_encoder_decoder"] is True
    assert list(s11.dataclass_fields("v1.kv_cache_interface", "KVCacheTensor")) == list(
        d.KVCacheTensor_0_24.__dataclass_fields__)
    assert list(vllm_releases.source("0.29.0").dataclass_fields("v1.kv_cache_interface", "KVCacheTensor")) == \
        list(d.KVCacheTensor_0_29.__dataclass_fields__)


@pytest.mark.parametrize("version", ["0.11.0", "0.16.0", "0.22.0", "0.29.0", "newest"])
def test_log_parser_reads_each_releases_format_strings(version, request):
    """Fill the KV-cache log format strings found in the release's source
    as its logger would, and parse them back."""
    if version == "newest":
        version = request.getfixturevalue("newest")
    src = vllm_releases.source(version)
    fmts = (src.string_constants("v1.core.kv_cache_utils", "KV cache size")
            + src.string_constants("v1.core.kv_cache_utils", "Maximum concurrency for")
            + src.string_constants("v1.worker.gpu_worker", "Available KV cache memory"))
    fmts = [f for f in dict.fromkeys(fmts) if any(
        k in f for k in ("KV cache size: %", "Maximum concurrency for %", "memory: %"))]
    assert len(fmts) >= 2, (version, fmts)
    reader = KvLogReader()
    for f in fmts:
        line = fill(f)
        assert reader.feed(f"(EngineCore_DP0 pid=7) INFO 11-29 10:00:00 [x.py:1] {line}"), line
    ev = reader.event()
    assert ev["tokens_capacity"] == 1_234_560 and ev["max_concurrency"] == 150.7
    assert ev["max_model_len"] == 8192 and ev["total_bytes"] == int(110.47 * (1 << 30))


def fill(fmt: str) -> str:
    """The values vLLM passes for each conversion, told apart by the text around it."""
    import re
    args = []
    for m in re.finditer(r"%[.\d]*[sdf]", fmt):
        before, after = fmt[:m.start()], fmt[m.end():]
        if after.startswith(" KV cache size"):
            args.append("GPU")
        elif before.endswith("KV cache size: "):
            args.append("1,234,560")
        elif before.endswith("Maximum concurrency for "):
            args.append("8,192")
        elif before.endswith("per request: "):
            args.append(150.7)
        elif before.endswith("memory: "):
            args.append(110.47 if m.group().endswith("f") else "110.47")
        else:
            raise AssertionError(f"unexpected conversion in {fmt!r}")
    return fmt % tuple(args)
