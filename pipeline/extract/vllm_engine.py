"""The `vllm-engine` extract backend: vLLM's v1 engine driven in-process
(what older speculators did; run on 0.16, its contract read on 0.11-0.33),
through pipeline.vllm.compat.

    executor   MultiprocExecutor: one worker process per GPU of the group
               (tensor parallel), each with pipeline.extract.vllm_capture mixed in
    scheduler  vLLM's own Scheduler, fed a window of prompt-only requests
               (max_tokens 1, prefix caching off, torch.compile off)
    step       schedule -> tell the workers the step's token counts and starts ->
               execute_model (+ sample_tokens from 0.12) -> update_from_output

Rank 0 of the group writes hs_{i}.safetensors itself (tmp + rename, from a
writer thread), so hidden states never travel through vLLM's RPC queue; the
stage polls what was written. Several groups (data parallel) run as one
process each, samples dealt round-robin by length.

KV cache: a `kv_cache` event from the scheduler's KVCacheConfig (source
"engine"), a `kv_usage` event from the KV manager's usage every 2 s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pipeline.extract.job import ExtractJob
from pipeline.extract.parallel import reporting, run_parallel
from pipeline.extract.vllm_capture import CLASS_PATH
from pipeline.model.hsfile import Counters
from pipeline.run.events import tail_lines
from pipeline.run.exit_reasons import quote_error
from pipeline.stage_error import StageError
from pipeline.vllm import compat
from pipeline.vllm.kv import kv_cache_event
from pipeline.vllm.log_shape import VLLM

BLOCK_SIZE = compat.ENGINE_BLOCK_SIZE
# How long a request vLLM has finished may wait for its file before the
# stage calls it lost (the copy thread and writers normally take < 1 s).
STUCK_S = 120.0


def build_engine(api, target: Path, dtype_name: str, tp: int, max_model_len: int, sec,
                 trust: bool):
    """(vllm_config, executor) with the capture extension loaded in the workers."""
    c = compat
    # Model Runner V2 (opt-in in 0.12-0.16, vLLM's default on GPU builds from
    # 0.32) keeps no input_batch to read the layout from: the V1 runner, set
    # before the executor spawns the workers (they inherit the environment).
    src = c.installed_source()
    c.force_v1_runner(os.environ, c.v2_runner_default(src) if src is not None else "opt-in")
    model_config = api.ModelConfig(model=str(target), tokenizer=str(target),
                                   trust_remote_code=trust, dtype=dtype_name,
                                   max_model_len=max_model_len, enforce_eager=True, seed=0)
    vllm_config = api.VllmConfig(
        model_config=model_config,
        cache_config=api.CacheConfig(block_size=BLOCK_SIZE,
                                     gpu_memory_utilization=sec.gpu_memory_utilization,
                                     enable_prefix_caching=False),
        parallel_config=api.ParallelConfig(tensor_parallel_size=tp,
                                           worker_extension_cls=CLASS_PATH,
                                           distributed_executor_backend="mp"),
        scheduler_config=c.make_scheduler_config(
            api.SchedulerConfig, max_model_len, False, max_num_seqs=sec.max_num_seqs,
            max_num_batched_tokens=max(sec.batch_tokens, BLOCK_SIZE),
            enable_chunked_prefill=True, async_scheduling=False),
        device_config=api.DeviceConfig(), load_config=api.LoadConfig(),
        compilation_config=c.compilation_off(api.CompilationConfig))
    return vllm_config, api.MultiprocExecutor(vllm_config)


def worker_failure(job: ExtractJob, e: Exception) -> StageError:
    """vLLM's executor says only "WorkerProc initialization failed"; the
    worker's own exception is in the log its processes share with the stage:
    quote it."""
    lines, _ = tail_lines(Path(job.log_dir) / "stage.log", 300)
    quoted = quote_error([b.decode(errors="replace") for b in lines], shape=VLLM)
    return StageError(f"vLLM's engine did not start ({type(e).__name__}: {e}); from the "
                      f"log:\n{quoted}", hint="fix what the log says (`eagle-panel doctor` "
                                              "checks the vLLM build against the target)")


def start_scheduler(api, vllm_config, executor):
    """Size the KV cache the way EngineCore does (profile, then vLLM's own
    per-worker configs), allocate it, and make the scheduler."""
    configs = compat.size_kv_cache(api, executor, vllm_config)
    kv_config = api.generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = kv_config.num_blocks
    executor.initialize_from_config(configs)
    scheduler = compat.make_scheduler(
        api.Scheduler, BLOCK_SIZE, vllm_config=vllm_config, kv_cache_config=kv_config,
        structured_output_manager=api.StructuredOutputManager(vllm_config), log_stats=False)
    return scheduler, kv_config


def run_group(api, job: ExtractJob, k: int = 0, writer_threads: int = 2) -> Counters:
    """Extract `job.todo` through engine k (one tensor-parallel group of GPUs)."""
    sec = job.section
    tp = sec.tensor_parallel
    max_model_len = job.max_len() + 1   # the prompt + its one sampled token
    try:
        vllm_config, executor = build_engine(api, job.target, job.dtype_name, tp, max_model_len,
                                             sec, job.trust_remote_code)
    except Exception as e:
        raise worker_failure(job, e) from e

    def rpc(method, *args):
        return executor.collective_rpc(method, args=args, unique_reply_rank=0)

    try:
        info = rpc("eagle_setup", list(job.layer_ids), str(job.folder), writer_threads, job.fp8)
        print(f"extract: capturing layers {job.layer_ids} of {info['model']} "
              f"({info['base']}, {info['layers']} layers) with vLLM's engine, TP={tp}", flush=True)
        scheduler, kv_config = start_scheduler(api, vllm_config, executor)
        job.on_event("kv_cache", {**kv_cache_event(kv_config, BLOCK_SIZE, max_model_len),
                                  "server": k, "devices": job.groups()[k]})
        job.on_progress(Counters())   # up: extraction starts now
        return _EngineLoop(api, executor, scheduler, rpc, job, k, sec.max_num_seqs * 2).run()
    finally:
        executor.shutdown()


class _EngineLoop:
    """Engine k's scheduling loop: requests pending, in flight (with their
    disk reservations) and the workers' last poll."""

    def __init__(self, api, executor, scheduler, rpc, job: ExtractJob, k: int, window: int):
        self.api, self.executor, self.scheduler, self.rpc = api, executor, scheduler, rpc
        self.job, self.k, self.window = job, k, window
        self.pending = self.by_length(job.todo or job.more())
        self.active: dict[str, int] = {}      # request id -> bytes reserved on the disk
        self.sampling = api.SamplingParams(max_tokens=1, temperature=0.0)
        self.disk_full = False
        self.usage_at, self.last_usage = 0.0, None
        self.poll = {"samples": 0, "tokens": 0, "bytes": 0}
        self.waiting_since = None   # since when finished requests wait for their files, no progress

    def by_length(self, rows):
        return sorted(rows, key=lambda i: self.job.lengths[i])   # pop() from the end: longest first

    def run(self) -> Counters:
        job, scheduler = self.job, self.scheduler
        while True:
            if job.should_stop():
                break
            self.admit()
            if self.refill():
                continue
            if not self.active:
                break
            scheduled = self.step()
            self.poll = self.rpc("eagle_poll")
            self.check(self.poll)
            self.check_finished()
            if not scheduled and not scheduler.requests:
                time.sleep(0.01)   # only files still being written
            self.report_usage()
        self.check(self.rpc("eagle_poll", True))     # let the writer finish what is complete
        if self.disk_full:
            raise job.disk.error()
        poll = self.poll
        return Counters(poll["samples"], poll["tokens"], poll["bytes"])

    def admit(self) -> None:
        """Add pending requests, longest first, while the window and the disk allow."""
        job, new = self.job, {}
        while self.pending and len(self.active) < self.window and not self.disk_full:
            i = self.pending[-1]
            ids = list(job.rows[i])
            need = job.bytes_per_token * len(ids)
            if not job.disk.reserve(need):
                self.disk_full = True
                break
            self.pending.pop()
            rid = f"hs-{i}"
            self.scheduler.add_request(compat.make_request(
                self.api.Request, None, request_id=rid, prompt_token_ids=ids,
                sampling_params=self.sampling, pooling_params=None, arrival_time=time.time()))
            self.active[rid] = need
            new[rid] = (i, ids)
        if new:
            self.rpc("eagle_expect", new)

    def refill(self) -> bool:
        """Whether more rows came to admit before this step."""
        if not self.pending and not self.disk_full and not self.job.should_stop():
            # Across nodes: the next chunk of the shared queue, waiting for
            # one only with nothing in flight (in flight is our own chunk).
            self.pending = self.by_length(self.job.more(wait=not self.active))
            if self.pending:
                return True
        return False

    def step(self) -> bool:
        """One engine step; whether it scheduled any tokens."""
        scheduler = self.scheduler
        out = scheduler.schedule()
        if out.total_num_scheduled_tokens:
            counts = dict(out.num_scheduled_tokens)
            # schedule() has advanced num_computed_tokens past this step (0.11-0.16)
            starts = {r: scheduler.requests[r].num_computed_tokens - n for r, n in counts.items()}
            self.rpc("eagle_step", counts, starts)
            compat.run_step(self.executor, scheduler, out)
        return bool(out.total_num_scheduled_tokens)

    def check(self, p) -> None:
        if p["error"]:
            raise StageError(f"hidden-state capture in vLLM's worker failed: {p['error']}",
                             hint="finished files are kept; `eagle-panel doctor` shows the "
                                  "vLLM adaptations in use")
        for i in p["written"]:
            self.job.disk.release(self.active.pop(f"hs-{i}", 0))
        self.job.on_progress(Counters(p["samples"], p["tokens"], p["bytes"]))

    def check_finished(self) -> None:
        """Requests vLLM finished must get their files, whole and soon."""
        requests, poll = self.scheduler.requests, self.poll
        gone = [r for r in poll["open"] if r not in requests]
        if gone:
            raise StageError(f"vLLM finished {gone[:3]} before their hidden states were all "
                             "captured", hint="report this with the stage log: the engine "
                                              "skipped prompt positions")
        unwritten = [r for r in self.active if r not in requests]
        if not unwritten or poll["written"]:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = time.monotonic()
        elif time.monotonic() - self.waiting_since > STUCK_S:
            raise StageError(f"vLLM finished {unwritten[:3]} but no file came for them in "
                             f"{STUCK_S:.0f} s", hint="report this with the stage log; "
                                                      "finished files are kept")

    def report_usage(self) -> None:
        """A kv_usage event every 2 s, when it changed."""
        if time.monotonic() - self.usage_at < 2.0:
            return
        self.usage_at = time.monotonic()
        scheduler = self.scheduler
        usage = {"usage_perc": float(scheduler.kv_cache_manager.usage),
                 "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                 "server": self.k}
        if usage != self.last_usage:
            self.last_usage = usage
            self.job.on_event("kv_usage", usage)


def _group_main(k: int, job: ExtractJob, q, stop, groups: list[list[int]], api_factory) -> None:
    """One data-parallel engine (spawned; one per tensor-parallel group)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, groups[k]))
    with reporting(q, k, job):
        job.should_stop = stop.is_set
        job.on_progress = lambda c: q.put(("progress", k, c.as_tuple()))
        job.on_event = lambda kind, ev: q.put(("event", k, (kind, ev)))
        run_group(api_factory(), job, k)


def run(job: ExtractJob, api_factory=None) -> Counters:
    """Extract `job.todo` through one engine per tensor-parallel group of the
    stage's GPUs."""
    api_factory = api_factory or compat.load_engine_api
    groups = job.groups()
    if len(groups) == 1:
        return run_group(api_factory(), job)
    order = sorted(job.todo, key=lambda i: -job.lengths[i])
    shards = [order[k::len(groups)] for k in range(len(groups))]
    total = run_parallel(job, shards, _group_main,
                         lambda k: f"vLLM engine {k} (GPUs {groups[k]})", (groups, api_factory))
    print(f"extract: {total.samples} samples through {len(groups)} vLLM engines", flush=True)
    return total
