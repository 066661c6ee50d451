"""TEST DOUBLES of the vLLM APIs the compatibility layer adapts to, one per
generation, with the exact parameter lists of the named source release
(tests/unit/test_vllm_sources.py compares each against that release's source).
They record how they were called instead of doing vLLM's work."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field


# -- get_kv_cache_config_from_groups --------------------------------------------
# vLLM 0.11.0 vllm/v1/core/kv_cache_utils.py
def kv_config_0_11(vllm_config, kv_cache_groups, kv_cache_specs, available_memory):
    return ("0.11", kv_cache_specs, available_memory)


# vLLM 0.12.0 .. 0.32 vllm/v1/core/kv_cache_utils.py; 0.33.0 vllm/v1/core/kv_cache_planning.py
def kv_config_0_12(vllm_config, kv_cache_groups, available_memory):
    return ("0.12", None, available_memory)


# -- SchedulerConfig -----------------------------------------------------------------
# vLLM 0.11.0 vllm/config/scheduler.py: max_model_len an optional field, no is_encoder_decoder
@dataclass
class SchedulerConfig_0_11:
    runner_type: str = "generate"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None
    async_scheduling: bool = False


# vLLM 0.12.0+ vllm/config/scheduler.py: both required InitVars
@dataclass
class SchedulerConfig_0_12:
    max_model_len: InitVar[int]
    is_encoder_decoder: InitVar[bool]
    runner_type: str = "generate"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None    # 0.16's default (0.12: False)
    seen: dict = field(default_factory=dict)

    def __post_init__(self, max_model_len, is_encoder_decoder):
        self.seen = {"max_model_len": max_model_len, "is_encoder_decoder": is_encoder_decoder}
        self.max_model_len = max_model_len


# -- CompilationConfig ---------------------------------------------------------------
# vLLM 0.11.0 vllm/config/compilation.py
@dataclass
class CompilationConfig_0_11:
    level: int | None = None


# vLLM 0.12.0+ vllm/config/compilation.py: `mode` (level kept, deprecated)
@dataclass
class CompilationConfig_0_12:
    level: int | None = None
    mode: int | None = None


# -- Scheduler -------------------------------------------------------------------------
_MM = object()


class Scheduler_0_11:
    """vLLM 0.11.0 vllm/v1/core/sched/scheduler.py"""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager,
                 mm_registry=_MM, include_finished_set: bool = False, log_stats: bool = False):
        self.block_size = None


class Scheduler_0_12:
    """vLLM 0.12.0 .. 0.17.0 vllm/v1/core/sched/scheduler.py"""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size: int,
                 mm_registry=_MM, include_finished_set: bool = False, log_stats: bool = False):
        self.block_size = block_size


# -- Request ---------------------------------------------------------------------------
class Request_0_12:
    """vLLM 0.12.0 vllm/v1/request.py (0.11 has the same parameters plus
    structured_output_request)"""

    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params,
                 eos_token_id, client_index=0, arrival_time=None, prompt_embeds=None,
                 mm_features=None, lora_request=None, cache_salt=None, priority=0,
                 trace_headers=None, block_hasher=None):
        self.eos_token_id = eos_token_id
        self.request_id, self.sampling_params = request_id, sampling_params
        self.prompt_token_ids = prompt_token_ids


class Request_0_17:
    """vLLM 0.17.0 vllm/v1/request.py: eos_token_id gone"""

    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params,
                 client_index=0, arrival_time=None, prompt_embeds=None, mm_features=None,
                 lora_request=None, cache_salt=None, priority=0, trace_headers=None,
                 block_hasher=None, resumable=False, reasoning_ended=None):
        self.prompt_token_ids = prompt_token_ids


# -- KV cache config objects -----------------------------------------------------------
@dataclass
class KVCacheTensor_0_24:
    """vLLM 0.11 .. 0.24 vllm/v1/kv_cache_interface.py"""
    size: int
    shared_by: list[str]


@dataclass
class KVCacheTensor_0_29:
    """vLLM 0.29 vllm/v1/kv_cache_interface.py: size = the shared backing allocation"""
    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass
class FullAttentionSpec:
    block_size: int
    page_size_bytes: int


@dataclass
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: object


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list
    kv_cache_groups: list


# -- 0.32 / 0.33: the KV layout and the planning split --------------------------------
CALLS: list = []   # what the 0.33 doubles were called with, in order


def get_kv_cache_configs_0_16(vllm_config, kv_cache_specs, available_memory):
    """vLLM 0.11 .. 0.32 vllm/v1/core/kv_cache_utils.py"""
    CALLS.append(("get_kv_cache_configs", 3))
    return ["config"]


def get_kv_cache_configs_0_33(vllm_config, kv_cache_specs, available_memory,
                              global_kv_cache_groups):
    """vLLM 0.33 vllm/v1/core/kv_cache_planning.py: a new required argument"""
    CALLS.append(("get_kv_cache_configs", global_kv_cache_groups))
    return ["config"]


def get_global_kv_cache_groups_0_33(vllm_config, kv_cache_specs):
    """vLLM 0.33 vllm/v1/core/kv_cache_planning.py"""
    CALLS.append(("get_global_kv_cache_groups",))
    return ["groups"]


def resolve_kv_cache_layout_0_32(vllm_config, supported_layouts, kv_cache_specs=None):
    """vLLM 0.32 / 0.33 vllm/v1/attention/backends/utils.py"""
    CALLS.append(("resolve_kv_cache_layout", supported_layouts))
    return type("KVCacheLayout", (), {"name": "NHD"})()


class Executor_0_33:
    """What EngineCore calls on vLLM 0.33's executor before sizing the KV cache."""

    def get_kv_cache_specs(self):
        return [{"layer.0": "spec"}]

    def get_supported_kv_cache_layouts(self):
        return [["NHD", "HND"]]

    def set_kv_cache_layout(self, layout_name, cp_kv_cache_interleave_size):
        CALLS.append(("set_kv_cache_layout", layout_name, cp_kv_cache_interleave_size))

    def determine_available_memory(self):
        CALLS.append(("determine_available_memory",))
        return [1 << 30]


class Executor_0_32(Executor_0_33):
    def set_kv_cache_layout(self, layout_name):   # vLLM 0.32: no CP interleave size
        CALLS.append(("set_kv_cache_layout", layout_name))
