"""STAND-IN for the vLLM 0.11-0.16 v1-engine pieces that the vllm-engine
extract backend drives (vLLM cannot run on these machines) — used only by
the tests.

What is real: the capture extension (pipeline/extract/vllm_capture.py) is mixed into
the stand-in worker the way vLLM does it (appended to the Worker's bases,
methods called by name through collective_rpc); the hidden states come from
a real forward of the tiny target (the hf backend's math, in fp32, cast to the
configured dtype); the compat layer's adapters meet the parameter lists of
each generation (tests/fakes/vllm_doubles.py, compared with the source releases).

What the stand-in reproduces of vLLM (read from 0.11/0.12/0.16's source):
- the scheduler: chunked prefill under a token budget and max_num_seqs, KV
  blocks taken per block_size tokens and released when a request finishes,
  preemption when a running request needs blocks that are gone (the newest
  running request is recomputed from position 0), num_computed_tokens
  advanced in schedule(), a request finishing once its prompt is done
  (max_tokens 1);
- the model runner: a flat batch in `input_batch.req_ids` order (here new
  requests go to the FRONT, unlike the scheduler's order, as vLLM's
  attention backends reorder), positions num_computed + 0..n-1, profiling
  and warm-up forwards with no request;
- the decoder: embed_tokens -> layers called (positions, hidden_states,
  residual) returning (hidden_states, residual) whose sum is the stream; the
  first layer writes into its input tensor, as vLLM's fused residual add does;
- execute_model returning the output (0.11) or None + sample_tokens (0.12+).
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

from pipeline.vllm import contract
from tests.fakes import vllm_doubles as d

# Config fields the backend passes: the contract's (pipeline/vllm/contract.py,
# checked against every release test_vllm_sources reads).
_F = contract.ENGINE_CONFIG_FIELDS
MODEL_CONFIG_FIELDS = _F["ModelConfig"][1]
CACHE_CONFIG_FIELDS = _F["CacheConfig"][1]
PARALLEL_CONFIG_FIELDS = _F["ParallelConfig"][1]
VLLM_CONFIG_FIELDS = _F["VllmConfig"][1]
SCHEDULER_CONFIG_FIELDS = _F["SchedulerConfig"][1]


def _config(name, fields):
    def init(self, **kw):
        unknown = set(kw) - set(fields)
        if unknown:
            raise TypeError(f"{name} got unknown fields {sorted(unknown)}")
        self.__dict__.update(dict.fromkeys(fields), **kw)
    return type(name, (), {"__init__": init})


ModelConfig = _config("ModelConfig", MODEL_CONFIG_FIELDS)
CacheConfig = _config("CacheConfig", CACHE_CONFIG_FIELDS)
ParallelConfig = _config("ParallelConfig", PARALLEL_CONFIG_FIELDS)
VllmConfig = _config("VllmConfig", VLLM_CONFIG_FIELDS)


class SamplingParams:
    def __init__(self, max_tokens=16, temperature=1.0):
        self.max_tokens, self.temperature = max_tokens, temperature


# -- scheduler ------------------------------------------------------------------

class _Scheduling:
    # Tokens per request per step, like vLLM's long_prefill_token_threshold
    # (off by default there too): several partial prefills at once, which is
    # what makes running requests compete for KV blocks.
    chunk_cap = None
    finish_early = False   # fault: a request ends one prompt token short

    def _setup(self, vllm_config, kv_cache_config):
        self.cfg = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.requests: dict = {}
        self.waiting: list = []
        self.running: list = []
        self.held: dict[str, int] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.preemptions = 0
        self.kv_cache_manager = SimpleNamespace(usage=0.0)

    def add_request(self, r):
        assert r.sampling_params.max_tokens == 1
        self.requests[r.request_id] = r
        self.waiting.append(r)
        r.num_computed_tokens = 0

    def _preempt(self, victim):
        """As vLLM's: free its blocks, back to the front of the queue, its
        prompt recomputed from position 0."""
        self.running.remove(victim)
        self.held.pop(victim.request_id, None)
        victim.num_computed_tokens = 0
        self.waiting.insert(0, victim)
        self.preempted.add(victim.request_id)
        self.preemptions += 1

    def schedule(self):
        sc = self.cfg.scheduler_config
        budget, counts, starts, new = sc.max_num_batched_tokens, {}, {}, {}
        for r in list(self.running) + list(self.waiting):
            rid = r.request_id
            if budget <= 0 or len(counts) >= sc.max_num_seqs or (
                    r not in self.running and r not in self.waiting):
                continue
            n = min(len(r.prompt_token_ids) - self.finish_early - r.num_computed_tokens, budget,
                    self.chunk_cap or budget)
            need = math.ceil((r.num_computed_tokens + n) / self.block_size) - self.held.get(rid, 0)
            while r in self.running and need > self._free() and self.running[-1] is not r \
                    and self.running[-1].request_id not in counts:
                self._preempt(self.running[-1])   # the newest running request gives way
            if need > self._free():
                if r in self.running:
                    continue
                break   # no KV blocks left: it waits, as vLLM's does
            self.held[rid] = self.held.get(rid, 0) + need
            counts[rid], starts[rid] = n, r.num_computed_tokens
            budget -= n
            if r in self.waiting:
                self.waiting.remove(r)
                self.running.append(r)
                new[rid] = list(r.prompt_token_ids)
        out = SimpleNamespace(num_scheduled_tokens=counts,
                              total_num_scheduled_tokens=sum(counts.values()),
                              new_prompts=new, starts=starts,
                              finished_req_ids=set(self.finished),
                              preempted_req_ids=set(self.preempted) - set(counts))
        self.finished.clear()
        self.preempted.clear()
        for rid, n in counts.items():   # vLLM advances num_computed_tokens in schedule()
            self.requests[rid].num_computed_tokens += n
        return out

    def _free(self):
        return self.num_blocks - sum(self.held.values())

    def update_from_output(self, scheduler_output, model_runner_output):
        assert model_runner_output.req_ids == list(scheduler_output.num_scheduled_tokens)
        for rid in scheduler_output.num_scheduled_tokens:
            r = self.requests[rid]
            if r.num_computed_tokens >= len(r.prompt_token_ids) - self.finish_early:
                self.running.remove(r)
                del self.requests[rid]
                self.held.pop(rid)
                self.finished.add(rid)
        self.kv_cache_manager.usage = sum(self.held.values()) / self.num_blocks
        return {}


class Scheduler_0_11(_Scheduling):
    """vLLM 0.11.0's parameters (compared with the source in test_vllm_sources)."""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager,
                 mm_registry=None, include_finished_set=False, log_stats=False):
        self._setup(vllm_config, kv_cache_config)


class Scheduler_0_12(_Scheduling):
    """vLLM 0.12.0-0.16.0's parameters: block_size required."""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size,
                 mm_registry=None, include_finished_set=False, log_stats=False):
        assert block_size == vllm_config.cache_config.block_size
        self._setup(vllm_config, kv_cache_config)

    def get_grammar_bitmask(self, scheduler_output):
        return None


# -- the model, the runner, the worker --------------------------------------------

class _Embed(nn.Module):
    def __init__(self, runner):
        super().__init__()
        self.runner = runner

    def forward(self, input_ids):
        return self.runner.table_for(0, input_ids.shape[0])


class _Layer(nn.Module):
    def __init__(self, runner, k):
        super().__init__()
        self.runner, self.k = runner, k

    def forward(self, positions, hidden_states, residual):
        stream = self.runner.table_for(self.k + 1, hidden_states.shape[0])
        if residual is None:
            hidden_states.add_(1.0)   # vLLM's fused add writes into the embedding output
        r = torch.trunc(stream)       # exact split: (stream - r) + r == stream
        return stream - r, r


class _Base(nn.Module):
    def __init__(self, runner, num_layers):
        super().__init__()
        self.embed_tokens = _Embed(runner)
        self.layers = nn.ModuleList(_Layer(runner, k) for k in range(num_layers))
        self.start_layer, self.end_layer = 0, num_layers

    def forward(self, input_ids, positions):
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers[self.start_layer:self.end_layer]:
            h, residual = layer(positions, h, residual)
        return h + residual


class _Model(nn.Module):
    def __init__(self, runner, num_layers):
        super().__init__()
        self.model = _Base(runner, num_layers)


class Runner:
    """vLLM's GPU model runner, reduced to what the capture depends on."""

    def __init__(self, vllm_config, fault=None):
        from pipeline.extract.hf import HFBackend
        mc = vllm_config.model_config
        self.dtype = getattr(torch, mc.dtype)
        probe = HFBackend.load(Path(mc.model), [1], "cpu", torch.float32)
        n = probe.num_layers
        self.hf = HFBackend(probe.model, list(range(n + 1)))
        probe.close()
        self.model = _Model(self, n)
        self.input_batch = SimpleNamespace(req_ids=[])
        self.prompts: dict[str, list[int]] = {}
        self.full: dict[str, torch.Tensor] = {}
        self.table = None
        self.fault = fault
        self.ids_buf = self.pos_buf = torch.zeros(0, dtype=torch.long)

    def table_for(self, k, t):
        if self.table is None:           # profiling / warm-up: no request behind it
            return torch.zeros((t, self.hf.hidden_size), dtype=self.dtype)
        return self.table[:, k].clone()

    def dummy_run(self, t=64):
        self.table = None
        self.model.model(torch.randint(0, 100, (t,)), torch.arange(t))

    def execute(self, so):
        for rid in so.finished_req_ids | so.preempted_req_ids:
            if rid in self.input_batch.req_ids:
                self.input_batch.req_ids.remove(rid)
        for rid in so.finished_req_ids:
            self.prompts.pop(rid)
            self.full.pop(rid, None)
        for rid, ids in so.new_prompts.items():
            self.prompts[rid] = ids
        for rid in so.num_scheduled_tokens:
            if rid not in self.input_batch.req_ids:
                self.input_batch.req_ids.insert(0, rid)
        ids, pos, rows = [], [], []
        for rid in self.input_batch.req_ids:
            n = so.num_scheduled_tokens.get(rid)
            if not n:
                continue
            prompt = self.prompts[rid]
            p0 = so.starts[rid]
            if rid not in self.full:     # the request's "KV cache": one full forward
                self.full[rid] = self.hf.forward([prompt])[0].to(self.dtype)
            ids += prompt[p0:p0 + n]
            pos += range(p0, p0 + n)
            rows.append(self.full[rid][p0:p0 + n])
        if self.fault == "positions" and len(pos) > 1:
            pos[-1] += 1
        if self.fault == "tokens":
            ids[0] = (ids[0] + 1) % 100
        self.table = torch.cat(rows)
        # vLLM's persistent input buffers: the step gets slices of them, and
        # they are rewritten for the next step as soon as this one returns.
        t = len(ids)
        if self.ids_buf.numel() < t:
            self.ids_buf, self.pos_buf = torch.zeros(t, dtype=torch.long), torch.zeros(
                t, dtype=torch.long)
        self.ids_buf[:t] = torch.tensor(ids)
        self.pos_buf[:t] = torch.tensor(pos)
        self.model.model(self.ids_buf[:t], self.pos_buf[:t])
        self.ids_buf.fill_(-1)
        self.pos_buf.fill_(-1)
        self.table = None
        return SimpleNamespace(req_ids=list(so.num_scheduled_tokens))


class Worker:
    def __init__(self, vllm_config, rank, fault=None):
        self.rank = rank
        self.model_runner = Runner(vllm_config, fault)


def _resolve(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


class Executor_0_11:
    """MultiprocExecutor, in-process: one worker per tensor-parallel rank."""
    fault = None

    def __init__(self, vllm_config):
        pc = vllm_config.parallel_config
        assert pc.distributed_executor_backend == "mp"
        cls = type("Worker", (Worker, _resolve(pc.worker_extension_cls)), {})
        self.workers = [cls(vllm_config, r, self.fault) for r in range(pc.tensor_parallel_size)]
        self.vllm_config = vllm_config
        self.shut_down = False
        self.pending = None
        LAST["executor"] = self

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False,
                       unique_reply_rank=None):
        outs = [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]
        return outs if unique_reply_rank is None else outs[unique_reply_rank]

    def get_kv_cache_specs(self):
        spec = d.FullAttentionSpec(block_size=16, page_size_bytes=4096)
        return [{f"layers.{k}": spec for k in range(4)} for _ in self.workers]

    def determine_available_memory(self):
        for w in self.workers:       # vLLM's profiling forward
            w.model_runner.dummy_run()
        return [BLOCKS * 4 * 4096] * len(self.workers)

    def initialize_from_config(self, kv_cache_configs):
        for w in self.workers:       # warm-up
            w.model_runner.dummy_run(16)

    def execute_model(self, scheduler_output, non_block=False):
        outs = [w.model_runner.execute(scheduler_output) for w in self.workers]
        return outs[0]

    def shutdown(self):
        self.shut_down = True


class Executor_0_12(Executor_0_11):
    def execute_model(self, scheduler_output, non_block=False):
        self.pending = super().execute_model(scheduler_output)
        return None

    def sample_tokens(self, grammar_output, non_block=False):
        out, self.pending = self.pending, None
        return out


BLOCKS = 20          # KV blocks of 16 tokens: fewer than the admitted requests need at once
LAST: dict = {}


def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
    names = list(kv_cache_specs[0])
    spec = kv_cache_specs[0][names[0]]
    n = min(available_memory) // (spec.page_size_bytes * len(names))
    return [d.KVCacheConfig(num_blocks=n,
                            kv_cache_tensors=[d.KVCacheTensor_0_24(n * spec.page_size_bytes, [x])
                                              for x in names],
                            kv_cache_groups=[d.KVCacheGroupSpec(names, spec)])
            for _ in kv_cache_specs]


def generate_scheduler_kv_cache_config(configs):
    return configs[0]


def _api(scheduler_config, compilation_config, scheduler, executor, request=d.Request_0_12):
    return SimpleNamespace(
        ModelConfig=ModelConfig, CacheConfig=CacheConfig, ParallelConfig=ParallelConfig,
        VllmConfig=VllmConfig, DeviceConfig=SimpleNamespace, LoadConfig=SimpleNamespace,
        SchedulerConfig=scheduler_config, CompilationConfig=compilation_config,
        SamplingParams=SamplingParams, Scheduler=scheduler, MultiprocExecutor=executor,
        Request=request, StructuredOutputManager=lambda vllm_config: None,
        get_kv_cache_configs=get_kv_cache_configs,
        generate_scheduler_kv_cache_config=generate_scheduler_kv_cache_config)


def api_0_11():
    return _api(d.SchedulerConfig_0_11, d.CompilationConfig_0_11, Scheduler_0_11, Executor_0_11)


def api_0_16():
    return _api(d.SchedulerConfig_0_12, d.CompilationConfig_0_12, Scheduler_0_12, Executor_0_12)


def api_with_fault(fault):
    class Faulty(Executor_0_12):
        pass
    Faulty.fault = fault
    return _api(d.SchedulerConfig_0_12, d.CompilationConfig_0_12, Scheduler_0_12, Faulty)
