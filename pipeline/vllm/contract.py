"""eagle-panel's contract with vLLM: every vLLM module, symbol, signature
and field the engine route calls and doctor reads, declared once.

The same table drives the call and the check, so a use without a check
cannot exist: `compat.load_engine_api` imports the engine route's names from
the modules declared here (each symbol from the first module that has it:
vLLM moves them one at a time, 0.33 split the KV-cache planning functions
over two modules), and `check(src, route)` compares each declaration with a
release's source (`VllmSource`: the installed vLLM for doctor, the source
releases for the tests). tests/unit/test_vllm_contract.py walks the project's code
and fails on a vLLM import, an `api.X` of the engine route or a vLLM module
path that this table lacks. The strings (`vllm serve` flags, HTTP routes,
metric names, log lines) are declared the same way in contract_strings.py.

A declaration says what eagle-panel passes; the check compares it with the
release's parameters: a required parameter that is not passed, a passed one
that is gone, a positional order that changed, a symbol in none of the
declared modules. `adapted` names the parameters an adaptation passes only
where the release has them (compat.py): a change they cover is an adaptation
that fires, one they do not is a mismatch that blocks the routes using it.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_MODULES = ("v1.core.kv_cache_planning", "v1.core.kv_cache_utils")   # 0.33 split, newest first
EXEC, MP = "v1.executor.abstract", "v1.executor.multiproc_executor"
SCHED = "v1.core.sched.scheduler"


@dataclass(frozen=True)
class Use:
    """One vLLM symbol eagle-panel relies on."""
    name: str                        # "get_kv_cache_configs", "Scheduler.__init__", "ModelConfig"
    modules: tuple[str, ...]         # where it is looked for, under vllm., newest first
    routes: tuple[str, ...]          # "engine", "server", "swap", "doctor"
    passes: tuple[str, ...] | None = None   # parameters (or fields) always passed; None: presence
    adapted: tuple[tuple[str, str], ...] = ()   # (parameter, adaptation key): passed where present
    positional: bool = False         # passed by position: `passes` must stay the first, in order
    fields: bool = False             # `passes` are dataclass fields set by keyword
    needed_by: str = ""              # needed only where this adaptation fires
    why: str = ""

    @property
    def export(self) -> str | None:
        """The name the engine route's `api` namespace gives it (importable
        top-level symbols only)."""
        return self.name if "." not in self.name and not self.fields else None


def _cfg(name: str, module: str, fields: tuple[str, ...]) -> Use:
    return Use(name, (module, "config"), ("engine",), fields, fields=True,
               why=f"the engine route builds {name}(...) with these fields")


ENGINE_CONFIG_FIELDS = {
    "ModelConfig": ("config.model", ("model", "tokenizer", "trust_remote_code", "dtype",
                                     "max_model_len", "enforce_eager", "seed")),
    "CacheConfig": ("config.cache", ("block_size", "gpu_memory_utilization",
                                     "enable_prefix_caching", "num_gpu_blocks")),
    "ParallelConfig": ("config.parallel", ("tensor_parallel_size", "worker_extension_cls",
                                           "distributed_executor_backend")),
    "SchedulerConfig": ("config.scheduler", ("max_num_seqs", "max_num_batched_tokens",
                                             "enable_chunked_prefill", "async_scheduling")),
    "VllmConfig": ("config.vllm", ("model_config", "cache_config", "parallel_config",
                                   "scheduler_config", "device_config", "load_config",
                                   "compilation_config")),
}

USES: tuple[Use, ...] = (
    # -- imported by compat.load_engine_api (the engine route) ------------------
    *(Use(n, ("config",), ("engine",)) for n in (
        "CacheConfig", "CompilationConfig", "DeviceConfig", "LoadConfig", "ModelConfig",
        "ParallelConfig", "SchedulerConfig", "VllmConfig")),
    Use("SamplingParams", ("sampling_params",), ("engine",)),
    Use("Scheduler", (SCHED,), ("engine",)),
    Use("MultiprocExecutor", (MP,), ("engine",)),
    Use("Request", ("v1.request",), ("engine",)),
    Use("StructuredOutputManager", ("v1.structured_output",), ("engine",)),
    Use("get_kv_cache_configs", KV_MODULES, ("engine",),
        ("vllm_config", "kv_cache_specs", "available_memory"), positional=True,
        adapted=(("global_kv_cache_groups", "kv_config_global_groups"),),
        why="sizes the KV cache per worker, as vLLM's EngineCore does"),
    Use("get_global_kv_cache_groups", KV_MODULES, ("engine",),
        ("vllm_config", "kv_cache_specs"), positional=True, needed_by="kv_config_global_groups",
        why="0.33's EngineCore builds get_kv_cache_configs' global_kv_cache_groups with it"),
    Use("generate_scheduler_kv_cache_config", ("v1.core.kv_cache_utils", "v1.core.kv_cache_planning"),
        ("engine",), ("kv_cache_configs",), positional=True),
    Use("resolve_kv_cache_layout", ("v1.attention.backends.utils",), ("engine",),
        ("vllm_config", "supported_layouts", "kv_cache_specs"), positional=True,
        needed_by="kv_cache_layout",
        why="EngineCore resolves the KV layout before sizing; workers refuse an unresolved one"),
    # -- called on what was imported --------------------------------------------
    *(_cfg(n, m, f) for n, (m, f) in ENGINE_CONFIG_FIELDS.items()),
    Use("Scheduler.__init__", (SCHED,), ("engine",),
        ("vllm_config", "kv_cache_config", "structured_output_manager", "log_stats"),
        adapted=(("block_size", "scheduler_block_size"),)),
    Use("Scheduler.schedule", (SCHED,), ("engine",), ()),
    Use("Scheduler.add_request", (SCHED,), ("engine",), ("request",), positional=True),
    Use("Scheduler.update_from_output", (SCHED,), ("engine",),
        ("scheduler_output", "model_runner_output"), positional=True),
    Use("Scheduler.get_grammar_bitmask", (SCHED,), ("engine",), ("scheduler_output",),
        positional=True, needed_by="sample_tokens"),
    Use("Request.__init__", ("v1.request",), ("engine",),
        ("request_id", "prompt_token_ids", "sampling_params", "pooling_params", "arrival_time"),
        adapted=(("eos_token_id", "request_no_eos"),)),
    Use("SamplingParams", ("sampling_params",), ("engine",), ("max_tokens", "temperature"),
        fields=True),
    Use("MultiprocExecutor.collective_rpc", (MP,), ("engine",),
        ("method", "args", "unique_reply_rank")),
    Use("MultiprocExecutor.execute_model", (MP,), ("engine",), ("scheduler_output",),
        positional=True),
    Use("MultiprocExecutor.sample_tokens", (MP,), ("engine",), ("grammar_output",),
        positional=True, needed_by="sample_tokens"),
    Use("MultiprocExecutor.shutdown", (MP,), ("engine",), ()),
    Use("Executor.get_kv_cache_specs", (EXEC,), ("engine",), ()),
    Use("Executor.determine_available_memory", (EXEC,), ("engine",), ()),
    Use("Executor.initialize_from_config", (EXEC,), ("engine",), ("kv_cache_configs",),
        positional=True),
    Use("Executor.get_supported_kv_cache_layouts", (EXEC,), ("engine",), (),
        needed_by="kv_cache_layout"),
    Use("Executor.set_kv_cache_layout", (EXEC,), ("engine",), ("layout_name",),
        positional=True, needed_by="kv_cache_layout",
        adapted=(("cp_kv_cache_interleave_size", "kv_cache_layout_interleave"),)),
    # -- read inside the workers (pipeline/extract/vllm_capture.py) -------------
    Use("GPUModelRunner", ("v1.worker.gpu_model_runner",), ("engine",),
        why="the V1 model runner: the capture reads its input_batch.req_ids"),
    Use("InputBatch.req_ids", ("v1.worker.gpu_input_batch",), ("engine",), ()),
    # -- the server route (extract's vllm-server backend, online train) ---------
    Use("main", ("entrypoints.cli.main",), ("server",),
        why="pipeline.vllm.launch runs `vllm serve` through it"),
    Use("ExampleHiddenStatesConnector",
        ("distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",),
        ("server",), why="pipeline.vllm.connector extends it (0.29+; else the stock one is used)"),
    # -- vLLM's own validation (pipeline/vllm/validate.py, doctor) ----------------
    Use("EngineArgs.create_engine_config", ("engine.arg_utils",), ("validate",), (),
        why="`vllm serve` builds and checks its engine config here; the validation "
            "stops the server once it returns"),
    Use("set_current_vllm_config", ("config.vllm", "config"), ("validate",), ("vllm_config",),
        positional=True, why="the config the model's layers read while they are built"),
    Use("init_distributed_environment", ("distributed.parallel_state",), ("validate",),
        ("world_size", "rank", "distributed_init_method", "local_rank", "backend"),
        why="one process's groups (gloo), as a worker makes them, for the model's layers"),
    Use("initialize_model_parallel", ("distributed.parallel_state",), ("validate",),
        ("tensor_model_parallel_size", "pipeline_model_parallel_size")),
    Use("initialize_model", ("model_executor.model_loader.utils",), ("validate",),
        ("vllm_config",), why="vLLM's loader builds the model class: each layer picks its "
                              "kernels (the quantized MoE's backend) as it is made"),
    Use("set_default_torch_dtype", ("utils.torch_utils", "model_executor.model_loader.utils"),
        ("validate",), ("dtype",), positional=True, why="the model's dtype, as the loader sets it"),
    # -- evaluate's draft swap (pipeline/vllm/swap_worker.py, inside the workers) -
    Use("reload_weights", ("model_executor.model_loader.reload.inplace",), ("swap",),
        ("vllm_config", "model", "weights_iterator", "weights_path", "is_checkpoint_format"),
        why="vLLM's in-place reload, on the drafter: layouts restored, layers reprocessed"),
    Use("GPUModelRunner.get_draft_model", ("v1.worker.gpu_model_runner",), ("swap",), (),
        why="the drafter model under Model Runner V1 (the CPU build's runner extends it)"),
    Use("GPUModelRunner.get_draft_model", ("v1.worker.gpu.model_runner",), ("swap",), (),
        why="the drafter model under Model Runner V2 (the GPU builds' default from 0.32)"),
    Use("GPUModelRunner.get_model", ("v1.worker.gpu_model_runner",), ("swap",), (),
        why="the target: its tensors the drafter shares are left alone"),
    # -- read by doctor from the source ------------------------------------------
    Use("SupportsEagle3", ("model_executor.models.interfaces",), ("doctor",)),
    Use("register_speculator", ("transformers_utils.configs.speculators.algos",), ("doctor",),
        why="the speculators config types vLLM reads a draft's config.json by "
            "(compat.speculators_types: 0.34 registers peagle only to raise)"),
    Use("VllmConfig._get_v1_model_runner_unsupported_features", ("config.vllm",), ("doctor",),
        why="the speculative methods Model Runner V1 refuses (DSpark, 0.29+)"),
    Use("VllmConfig._get_v2_model_runner_unsupported_features", ("config.vllm",), ("doctor",),
        why="the speculative methods Model Runner V2 refuses"),
    Use("VllmConfig._is_dflash_candidate_draft", ("config.vllm",), ("doctor",),
        why="the draft architectures Model Runner V1 refuses under method dflash (DFlash2's "
            "candidate heads, 0.32+)"),
    Use("VllmConfig._validate_v2_model_runner", ("config.vllm",), ("doctor",),
        why="whether V2 requires Triton (HAS_TRITON: 0.32)"),
    Use("VllmConfig.use_v2_model_runner", ("config.vllm",), ("doctor",),
        why="whether vLLM's own choice of runner falls back to V1 without Triton"),
)

# Modules doctor and the tests read as text (no symbol of theirs is called).
READ_MODULES = ("model_executor.models.registry", "engine.arg_utils", "envs", "config.speculative",
                "v1.kv_cache_interface", "config.compilation", "compilation.decorators",
                "v1.worker.worker_base", "v1.core.kv_cache_manager", "v1.core.sched.output",
                "v1.worker.gpu_worker", "v1.attention.backends.mla.cpu_mla",
                "v1.attention.backends.cpu_attn",
                "model_executor.layers.mamba.ops.cpu.gdn_attention",   # the CPU build's GDN path
                "model_executor.layers.rotary_embedding.base")   # the rope custom op's name
# The name vLLM's runner choice reads for Triton (vllm.triton_utils), looked for
# in VllmConfig's runner functions above (compat.reads_has_triton).
HAS_TRITON = "HAS_TRITON"

# vLLM's environment variables eagle-panel sets or reads.
ENV_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"      # the engine route: 0 (compat.force_v1_runner)
ENV_TARGET_DEVICE = "VLLM_TARGET_DEVICE"        # the CPU build's platform
ENV_CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"     # the CPU build's KV cache (GiB)
ENV_API_KEY = "VLLM_API_KEY"                    # each server's key (server.py)
ENV_MLA_DISABLE = "VLLM_MLA_DISABLE"            # doctor: MLA run as plain attention
ENV_SERVER_DEV_MODE = "VLLM_SERVER_DEV_MODE"    # config.py: owned by the server stages
ENV_RPC_BASE_PATH = "VLLM_RPC_BASE_PATH"        # where its IPC sockets go (scratch.py)
ENV_VARS = (ENV_V2_RUNNER, ENV_TARGET_DEVICE, ENV_CPU_KV_SPACE, ENV_API_KEY, ENV_MLA_DISABLE,
            ENV_SERVER_DEV_MODE, ENV_RPC_BASE_PATH)
# `vllm serve` flags, HTTP routes, metric names and log lines: one table per
# kind in contract_strings.py.


@dataclass
class Mismatch:
    """A declared use the release's source does not match."""
    use: Use
    where: str        # the module it was found in ("" if none)
    what: str         # what changed
    covered: str = ""   # the adaptation key that covers it, else ""

    def line(self, version: str) -> str:
        route = "/".join(f"vllm-{r}" if r in ("engine", "server") else r for r in self.use.routes)
        moved = (f" (moved from vllm.{self.use.modules[-1]})"
                 if self.where and self.where != self.use.modules[-1] else "")
        at = f"vllm.{self.where}{moved}" if self.where else "nowhere eagle-panel looks"
        cover = f"adapted ({self.covered})" if self.covered else "no adaptation covers it"
        return (f"{self.use.name} in vLLM {version}: {self.what}; it is in {at}; {cover}: "
                f"the {route} route cannot run")


def by_name(name: str) -> Use:
    return next(u for u in USES if u.name == name and not u.fields)


def locate(src, use: Use) -> tuple[str, str, str] | None:
    """(module it is found in, module it is defined in, its name there)."""
    head, _, _ = use.name.partition(".")
    for m in use.modules:
        defs = src.definitions(m, head)
        if defs:
            return (m, *defs[0])
    return None


def check_use(src, use: Use, fires: set[str]) -> Mismatch | None:
    """How a release differs from one declaration (None: it matches, or the
    difference is one an adaptation covers)."""
    if use.needed_by and use.needed_by not in fires:
        return None   # not called on this release
    found = locate(src, use)
    if found is None:
        return Mismatch(use, "", "not in vllm." + " nor vllm.".join(use.modules))
    where, defmod, defname = found
    if use.passes is None:
        return None
    rest = use.name.partition(".")[2]
    if use.fields:
        have = src.dataclass_fields(defmod, defname) or {}
        gone = [f for f in use.passes if f not in have]
        return Mismatch(use, where, f"has no field {', '.join(gone)}") if gone else None
    sig = src.signature(defmod, f"{defname}.{rest}" if rest else defname)
    if sig is None:
        return Mismatch(use, where, f"is no longer a function of vllm.{defmod}")
    return _compare(use, where, sig)


def _compare(use: Use, where: str, sig: dict) -> Mismatch | None:
    names = [n for n, _ in sig["params"]]
    adapted = dict(use.adapted)
    gone = [p for p in use.passes if p not in names and not sig["var_kw"]]
    if gone:
        return Mismatch(use, where, f"no longer takes {', '.join(gone)} (takes "
                                    f"{', '.join(names) or 'nothing'})")
    if use.positional and names[:len(use.passes)] != list(use.passes):
        return Mismatch(use, where, f"takes ({', '.join(names)}) where eagle-panel passes "
                                    f"({', '.join(use.passes)}) by position")
    new = [n for n, req in sig["params"] if req and n not in use.passes and n not in adapted]
    if new:
        return Mismatch(use, where, f"now requires {', '.join(new)} ({len(names)} parameters: "
                                    f"{', '.join(names)}), which eagle-panel does not pass")
    return None


def adapted_here(src, use: Use) -> list[tuple[str, str]]:
    """(parameter, adaptation key) of `use.adapted` this release has."""
    found = locate(src, use)
    if found is None or not use.adapted:
        return []
    _, defmod, defname = found
    rest = use.name.partition(".")[2]
    sig = src.signature(defmod, f"{defname}.{rest}" if rest else defname) or {"params": []}
    names = [n for n, _ in sig["params"]]
    return [(p, k) for p, k in use.adapted if p in names]


def check(src, route: str | None = None, fires: set[str] | None = None) -> list[Mismatch]:
    """Every declared use of `route` (all routes: None) this release breaks."""
    fires = fires or set()
    out = []
    for use in USES:
        if route is None or route in use.routes:
            m = check_use(src, use, fires)
            if m is not None:
                out.append(m)
    return out
