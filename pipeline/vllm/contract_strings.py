"""eagle-panel's contract with vLLM, the strings: every `vllm serve` flag it
passes or reads, every HTTP route it calls, every Prometheus metric it
reads and every log line it parses, declared once, each with why
(pipeline/vllm/contract.py declares the Python side: modules, symbols,
signatures, fields, environment variables).

The code takes each string from a constant here; the tables (FLAGS,
ENDPOINTS, METRICS, LOG_PATTERNS) are what tests/unit/test_vllm_contract.py walks
the code against: a vLLM flag, route or metric name spelled out anywhere
else fails there, and so does one no table has. The tables are also
compared with each read release's source where the test cache keeps the
module that declares the string (`missing`): the engine's argument parser
(engine.arg_utils) for flags, v1.metrics.loggers and v1.spec_decode.metrics
for metrics. The API server's routes and its frontend flags (--host,
--port, ...) live in entrypoints/openai, which the cache does not keep:
declared, not checked. The KV-cache log lines are checked against each
release's format strings by tests/unit/test_vllm_sources.py.

Standard library only, no import of the project: pipeline.config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

ARGS = "engine.arg_utils"                  # vLLM's engine argument parser
LOGGERS = "v1.metrics.loggers"             # vLLM's Prometheus metrics
SPEC_METRICS = "v1.spec_decode.metrics"    # its speculative-decoding counters


@dataclass(frozen=True)
class Declared:
    """One string eagle-panel and vLLM share."""
    value: str                     # the string itself, as the code uses it
    why: str                       # what eagle-panel does with it, where
    since: str = ""                # the first read release that has it ("": all, 0.11+)
    until: str = ""                # the last read release that has it ("": still there)
    declared_in: tuple[str, ...] = ()   # vLLM modules whose source holds it; (): unchecked
    spelled: str = ""              # how that source spells it, where not as `value`

    @property
    def needle(self) -> str:
        """What the release's source holds: the string, quoted."""
        return f'"{self.spelled or self.value}"'


FLAGS: dict[str, Declared] = {}
ENDPOINTS: dict[str, Declared] = {}
METRICS: dict[str, Declared] = {}
LOG_PATTERNS: dict[str, Declared] = {}


def _declare(table: dict, value: str, why: str, **more) -> str:
    table[value] = Declared(value, why, **more)
    return value


def _flag(value: str, why: str, **more) -> str:
    return _declare(FLAGS, value, why, **{"declared_in": (ARGS,), **more})


# -- `vllm serve` flags (server.serve_argv, target_flags, the stages) ----------
FLAG_HOST = _flag("--host", "serve_argv: 127.0.0.1 only; server_args may not set it (config)",
                  declared_in=())
FLAG_PORT = _flag("--port", "serve_argv: a free port; server_args may not set it (config)",
                  declared_in=())
FLAG_API_KEY = _flag("--api-key", "never passed (VLLM_API_KEY instead: `ps` shows a command "
                     "line); server_args may not set it (config)", declared_in=())
FLAG_UDS = _flag("--uds", "a Unix socket instead of our port: server_args may not set it "
                 "(config)", declared_in=())
FLAG_TENSOR_PARALLEL = _flag("--tensor-parallel-size", "serve_argv: over the server's GPUs")
FLAG_DTYPE = _flag("--dtype", "serve_argv: the stage's dtype (float32 on the CPU build)")
FLAG_MAX_MODEL_LEN = _flag("--max-model-len", "serve_argv: what the stage's requests need")
FLAG_TRUST_REMOTE_CODE = _flag("--trust-remote-code", "serve_argv: [model] trust_remote_code")
FLAG_ENFORCE_EAGER = _flag("--enforce-eager", "serve_argv: the CPU build, unless server_args "
                           "set a compilation of their own")
FLAG_COMPILATION_CONFIG = _flag("--compilation-config", "serve_argv: a user's compilation in "
                                "server_args keeps --enforce-eager out; target_flags: the "
                                "rotary custom op off for an MLA target on the CPU build")
FLAG_OPT_LEVEL = _flag("-O", "serve_argv: -O<level> in server_args, the same; from 0.12 the "
                       "parser outside engine.arg_utils handles it", declared_in=())
FLAG_SERVED_MODEL_NAME = _flag("--served-model-name", "served_model_name: the name requests "
                               "send, when server_args rename the model")
FLAG_REVISION = _flag("--revision", "export: the model card's command names a hub target "
                      "at the commit the run measured")
FLAG_SPECULATIVE_CONFIG = _flag("--speculative-config", "evaluate: the draft (eagle3); "
                                "extract: the hidden-state capture (extract_hidden_states)")
FLAG_KV_TRANSFER_CONFIG = _flag("--kv-transfer-config", "extract's vllm-server backend: the "
                                "hidden-state connector that writes the files")
FLAG_NO_CHUNKED_PREFILL = _flag("--no-enable-chunked-prefill", "extract's vllm-server "
                                "backend: a prompt's states in one prefill (a boolean flag: "
                                "the parser declares --enable-chunked-prefill)",
                                spelled="--enable-chunked-prefill")
FLAG_NO_PREFIX_CACHING = _flag("--no-enable-prefix-caching", "extraction servers of a target "
                               "with linear-attention layers: their prefix caching is mamba "
                               "cache mode 'align', which requires the chunked prefill "
                               "extraction turns off", spelled="--enable-prefix-caching")
FLAG_LANGUAGE_MODEL_ONLY = _flag("--language-model-only", "target_flags: a multimodal wrapper "
                                 "served text-only (where the parser has it)", since="0.17.0")
FLAG_ATTENTION_BACKEND = _flag("--attention-backend", "target_flags: CPU_MLA for an MLA "
                               "target on the CPU build; evaluate reads it from server_args",
                               since="0.13.0")
FLAG_HF_OVERRIDES = _flag("--hf-overrides", "target_flags: a DeepSeek-V3 router config.json "
                          "leaves out")
FLAG_GPU_UTIL = _flag("--gpu-memory-utilization", "doctor reads it from server_args")
FLAG_PER_REQUEST_SPEC_METRICS = _flag("--per-request-spec-decode-metrics", "evaluate: each "
                                      "request's acceptance in its response (where the parser "
                                      "has it, else /metrics around each request)",
                                      since="0.29.0")
FLAG_WORKER_EXTENSION_CLS = _flag("--worker-extension-cls", "evaluate: the draft swap's "
                                  "worker methods (pipeline.vllm.swap_worker.DraftSwap)")
FLAG_MIDDLEWARE = _flag("--middleware", "evaluate: the run's key on the development routes "
                        "(pipeline.vllm.route_guard)", declared_in=())
FLAG_ENABLE_SCALE_OUT = _flag("--enable-scale-out", "bench/vs_speculators: the render "
                              "endpoint speculators' prepare-data needs", declared_in=())

# -- HTTP routes of vLLM's OpenAI-compatible server -----------------------------
API_V1 = _declare(ENDPOINTS, "/v1", "the API's root, for clients that add their own routes: "
                  "online train's --vllm-endpoint, speculators' --endpoint (bench)")
ROUTE_HEALTH = _declare(ENDPOINTS, "/health", "server.healthy: up; online train waits on it "
                        "before each request")
ROUTE_METRICS = _declare(ENDPOINTS, "/metrics", "server.metrics_text: KV use, spec-decode "
                         "counters, online train's throughput")
ROUTE_MODELS = _declare(ENDPOINTS, "/v1/models", "watch: the model a serving vLLM names "
                        "(the target; the draft is named by --run or --draft)")
ROUTE_COMPLETIONS = _declare(ENDPOINTS, "/v1/completions", "token ids in: extract's "
                             "vllm-server backend (one token out), evaluate's text prompts")
ROUTE_CHAT = _declare(ENDPOINTS, "/v1/chat/completions", "regenerate's answers, evaluate's "
                      "conversations")
ROUTE_CHAT_RENDER = _declare(ENDPOINTS, "/v1/chat/completions/render", "chat_mask's "
                             "EndpointRenderer: a chat as the server's template renders it")

ROUTE_COLLECTIVE_RPC = _declare(ENDPOINTS, "/collective_rpc", "draft_swap: a worker method on "
                                "every worker (VLLM_SERVER_DEV_MODE=1; route_guard asks the "
                                "key)")
ROUTE_RESET_PREFIX_CACHE = _declare(ENDPOINTS, "/reset_prefix_cache", "draft_swap: the "
                                    "swapped-out draft's cached KV dropped (development mode)")
# the prefixes vLLM's own key check guards (entrypoints/serve/middleware/authenticate.py);
# route_guard asks the same key of every other route but the read-only two above
KEYED_BY_VLLM = (API_V1, "/v2", "/inference", "/cohere")

# -- Prometheus metrics on /metrics (counters read without their _total: where declared)
_counter = {"declared_in": (SPEC_METRICS,)}
METRIC_SPEC_DRAFTS = _declare(METRICS, "vllm:spec_decode_num_drafts_total", "metrics: "
                              "verify steps, acceptance length's denominator",
                              spelled="vllm:spec_decode_num_drafts", **_counter)
METRIC_SPEC_DRAFT_TOKENS = _declare(METRICS, "vllm:spec_decode_num_draft_tokens_total",
                                    "metrics: tokens proposed (acceptance rate)",
                                    spelled="vllm:spec_decode_num_draft_tokens", **_counter)
METRIC_SPEC_ACCEPTED = _declare(METRICS, "vllm:spec_decode_num_accepted_tokens_total",
                                "metrics: tokens accepted",
                                spelled="vllm:spec_decode_num_accepted_tokens", **_counter)
METRIC_SPEC_PER_POSITION = _declare(METRICS, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                    "metrics: accepted per draft position (label `position`)",
                                    spelled="vllm:spec_decode_num_accepted_tokens_per_pos",
                                    **_counter)
METRIC_GENERATION_TOKENS = _declare(METRICS, "vllm:generation_tokens_total", "metrics: tokens "
                                    "generated", spelled="vllm:generation_tokens",
                                    declared_in=(LOGGERS,))
METRIC_PROMPT_TOKENS = _declare(METRICS, "vllm:prompt_tokens_total", "online train: tokens "
                                "per second its servers prefill", spelled="vllm:prompt_tokens",
                                declared_in=(LOGGERS,))
METRIC_INFERENCE_TIME_SUM = _declare(METRICS, "vllm:request_inference_time_seconds_sum",
                                     "online train: a server's busy share (Little's law)",
                                     spelled="vllm:request_inference_time_seconds",
                                     declared_in=(LOGGERS,))
METRIC_RUNNING = _declare(METRICS, "vllm:num_requests_running", "kv_usage events: requests "
                          "running", declared_in=(LOGGERS,))
METRIC_WAITING = _declare(METRICS, "vllm:num_requests_waiting", "kv_usage events: requests "
                          "waiting", declared_in=(LOGGERS,))
METRIC_KV_USAGE = _declare(METRICS, "vllm:kv_cache_usage_perc", "kv_usage events: KV cache "
                           "in use", declared_in=(LOGGERS,))
METRIC_GPU_CACHE_USAGE = _declare(METRICS, "vllm:gpu_cache_usage_perc", "kv_usage events: "
                                  "the older name of kv_cache_usage_perc", until="0.11.0",
                                  declared_in=(LOGGERS,))
METRIC_CACHE_CONFIG_INFO = _declare(METRICS, "vllm:cache_config_info", "kv_cache events: its "
                                    "labels are the engine's cache config (blocks, bytes, "
                                    "dtype)", declared_in=(LOGGERS,))

# -- log lines a server prints that eagle-panel parses (regular expressions) ----
LOG_KV_SIZE = _declare(LOG_PATTERNS, r"([A-Z]+(?: \+ host)?) KV cache size: ([\d,]+) tokens",
                       "kv: token capacity (v1.core.kv_cache_utils; 0.33: GPU + host)")
LOG_KV_CONCURRENCY = _declare(LOG_PATTERNS,
                              r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x",
                              "kv: max_model_len and concurrency (v1.core.kv_cache_utils)")
LOG_KV_MEMORY = _declare(LOG_PATTERNS, r"Available KV cache memory: ([\d.]+) GiB",
                         "kv: the KV cache's bytes (v1.worker.gpu_worker)")
LOG_PHASE_DRAFT = _declare(LOG_PATTERNS, r"Loading drafter model|Loading draft model",
                           "startup: the draft loads")
LOG_PHASE_LOADING = _declare(LOG_PATTERNS, r"Starting to load model|Loading model weights|"
                             r"Loading safetensors checkpoint shards",
                             "startup: the target's weights load")
LOG_PHASE_PROFILING = _declare(LOG_PATTERNS, r"Memory profiling takes|Available KV cache memory|"
                               r"KV cache size: [\d,]+ tokens|Explicitly set .* for KV cache|"
                               r"determine_available_memory", "startup: profiling, KV sizing")
LOG_PHASE_WARMUP = _declare(LOG_PATTERNS, r"Capturing CUDA graph|Compiling a graph|"
                            r"torch\.compile takes|Graph capturing finished|warming up|"
                            r"Warming up|init engine \(profile, create kv cache, warmup model\) "
                            r"took", "startup: compile, CUDA graphs, warm-up")
LOG_PHASE_READY = _declare(LOG_PATTERNS, r"Application startup complete",
                           "startup: the API is up (uvicorn's line)")
LOG_SHARDS = _declare(LOG_PATTERNS, r"Loading safetensors checkpoint shards:\s*(\d+)% "
                      r"Completed \|\s*(\d+)/(\d+)", "startup: shards loaded of all (tqdm's bar)")
LOG_TOOK = _declare(LOG_PATTERNS, r"(Loading weights took|Model loading took|init engine "
                    r"\(profile, create kv cache, warmup model\) took)\s+([\d.]+)",
                    "startup: vLLM's own timings, shown with the phases")

# ...and the ones that say why a server died (pipeline/run/exit_reasons.py, which quotes
# any process's errors: these two are vLLM's own shapes)
LOG_LINE_PREFIX = _declare(LOG_PATTERNS, r"^(\([^)]*pid=\d+\)\s*)?((?P<level>DEBUG|INFO|WARNING|"
                           r"ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\]\s?)?",
                           "exit_reasons: a line's process and level prefix, '(EngineCore_DP0 "
                           "pid=12) ERROR 11-29 10:00:00 [core.py:1] ' (vllm.logger), cut "
                           "before the line is judged and quoted")
LOG_ERROR_POINTER = _declare(LOG_PATTERNS, r"Failed core proc|EngineDeadError",
                             "exit_reasons: vLLM's wrapper errors that only point at the "
                             "root cause (v1.engine.core, v1.engine.exceptions): quoted only "
                             "when nothing else explains the death")

# ...and vLLM's usual shutdown (0.32: the engine killed with timeout 0, its output handler's
# EngineDeadError traceback, multiprocessing's leak warnings): hidden in the panel's view
# once the shutdown line has been seen (pipeline/vllm/shutdown_noise.py), kept in the file
LOG_SHUTDOWN_BEGIN = _declare(LOG_PATTERNS, r"\[shutdown\] API server: shutdown triggered|"
                              r"Shutting down FastAPI HTTP server",
                              "panel: the server is stopping (entrypoints launcher, uvicorn)")
LOG_SERVER_ARGS = _declare(LOG_PATTERNS, r"non-default args: ",
                           "panel: a server starting (again, in the same log): entrypoints' "
                           "arguments line")
LOG_SHUTDOWN_NOISE = _declare(LOG_PATTERNS, r"ERROR [\d: -]+\[async_llm\.py:\d+\]|"
                              r"\[shutdown\] .*force killing|resource_tracker: There appear to "
                              r"be|warnings\.warn\('resource_tracker",
                              "panel: what a stopping server always prints (v1.engine.async_llm's "
                              "output handler, the process manager, resource_tracker)")

TABLES = {"flag": FLAGS, "endpoint": ENDPOINTS, "metric": METRICS, "log pattern": LOG_PATTERNS}


def _vt(v: str) -> tuple[int, ...]:
    """(major, minor, patch) from a release or a build's version: each part's
    leading digits ("0.17.1rc2.dev12+g1a2b" is (0, 17, 1)); () when unknown."""
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = part[:len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        out.append(int(digits))
    return tuple(out) if len(out) >= 2 else ()


def expected_in(d: Declared, version: str) -> bool | None:
    """Whether this release should have the string (its since..until); None
    when the version cannot be read and the string has a range."""
    if not (d.since or d.until):
        return True
    if not _vt(version):
        return None
    return (not d.since or _vt(version) >= _vt(d.since)) and \
        (not d.until or _vt(version) <= _vt(d.until))


def missing(src, version: str | None = None) -> list[str]:
    """A line for each checked string this release's source lacks where the
    table says it has it, or has where the table says it is gone."""
    version = version or src.version
    out = []
    for kind, table in TABLES.items():
        for d in table.values():
            texts = [src.text(m) for m in d.declared_in]
            if not texts or None in texts:
                continue   # not declared in a module this source has
            here, want = any(d.needle in t for t in texts), expected_in(d, version)
            if want is not None and here != want:   # (an unreadable version: not judged)
                at = " nor ".join(f"vllm.{m}" for m in d.declared_in)
                out.append(f"{kind} {d.value} in vLLM {version}: "
                           + (f"not in {at}" if want else f"in {at}, which the table "
                              f"does not expect ({d.since or '0.11'}..{d.until or 'now'})")
                           + f" ({d.why})")
    return out
