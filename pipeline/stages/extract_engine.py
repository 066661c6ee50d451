"""The `vllm-engine` extract backend: vLLM 0.11-0.16's v1 engine driven
in-process (what older speculators did), through pipeline.vllm_compat.

    executor   MultiprocExecutor: one worker process per GPU of the group
               (tensor parallel), each with pipeline.vllm_capture mixed in
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
import shutil
import time
from pathlib import Path

from pipeline import vllm_compat
from pipeline.stages.common import StageError
from pipeline.vllm_capture import CLASS_PATH
from pipeline.vllm_logs import combine_usage

BLOCK_SIZE = 16
GB = 1 << 30
# How long a request vLLM has finished may wait for its file before the
# stage calls it lost (the copy thread and writers normally take < 1 s).
STUCK_S = 120.0


def build_engine(api, target: Path, dtype_name: str, tp: int, max_model_len: int, sec,
                 trust: bool):
    """(vllm_config, executor) with the capture extension loaded in the workers."""
    c = vllm_compat
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") != "0":
        # The opt-in V2 runner (0.12+) keeps no input_batch to read the layout from.
        c.fired("v2_model_runner", "VLLM_USE_V2_MODEL_RUNNER is set: the engine route uses "
                                   "the V1 model runner (set to 0 for its workers)")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
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


def start_scheduler(api, vllm_config, executor):
    """Size the KV cache the way EngineCore does (profile, then vLLM's own
    per-worker configs), allocate it, and make the scheduler."""
    specs = executor.get_kv_cache_specs()
    memory = executor.determine_available_memory()
    configs = api.get_kv_cache_configs(vllm_config, specs, memory)
    kv_config = api.generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = kv_config.num_blocks
    executor.initialize_from_config(configs)
    scheduler = vllm_compat.make_scheduler(
        api.Scheduler, BLOCK_SIZE, vllm_config=vllm_config, kv_cache_config=kv_config,
        structured_output_manager=api.StructuredOutputManager(vllm_config), log_stats=False)
    return scheduler, kv_config


def run_group(api, target: Path, layer_ids: list[int], dtype_name: str, tp: int, sec,
              trust: bool, data_ids, todo: list[int], lengths, folder: Path,
              bytes_per_token: int, min_free: float, should_stop, on_progress, on_event,
              writer_threads: int = 2) -> tuple[int, int, int]:
    """Extract `todo` through one engine (one tensor-parallel group of GPUs);
    returns (samples, tokens, bytes) written."""
    max_model_len = max(lengths[i] for i in todo) + 1   # the prompt + its one sampled token
    vllm_config, executor = build_engine(api, target, dtype_name, tp, max_model_len, sec, trust)

    def rpc(method, *args):
        return executor.collective_rpc(method, args=args, unique_reply_rank=0)

    try:
        info = rpc("eagle_setup", list(layer_ids), str(folder), writer_threads)
        print(f"extract: capturing layers {layer_ids} of {info['model']} "
              f"({info['base']}, {info['layers']} layers) with vLLM's engine, TP={tp}", flush=True)
        scheduler, kv_config = start_scheduler(api, vllm_config, executor)
        on_event("kv_cache", vllm_compat.kv_cache_event(kv_config, BLOCK_SIZE, max_model_len))
        return _loop(api, executor, scheduler, rpc, data_ids, todo, lengths, folder,
                     bytes_per_token, min_free, sec.max_num_seqs * 2, should_stop, on_progress,
                     on_event)
    finally:
        executor.shutdown()


def _loop(api, executor, scheduler, rpc, data_ids, todo, lengths, folder, bytes_per_token,
          min_free, window, should_stop, on_progress, on_event):
    pending = sorted(todo, key=lambda i: lengths[i])   # pop() from the end: longest first
    active: dict[str, int] = {}           # request id -> bytes it will write
    sampling = api.SamplingParams(max_tokens=1, temperature=0.0)
    disk_stop = None
    usage_at, last_usage = 0.0, None
    poll = {"samples": 0, "tokens": 0, "bytes": 0}
    waiting_since = None   # since when finished requests wait for their files, no progress

    def check(p):
        if p["error"]:
            raise StageError(f"hidden-state capture in vLLM's worker failed: {p['error']}",
                             hint="finished files are kept; `eagle-panel doctor` shows the "
                                  "vLLM adaptations in use")
        for i in p["written"]:
            active.pop(f"hs-{i}", None)
        on_progress(p["samples"], p["tokens"], p["bytes"])

    while True:
        if should_stop():
            break
        new = {}
        while pending and len(active) < window and disk_stop is None:
            i = pending[-1]
            ids = list(data_ids[i])
            need = bytes_per_token * len(ids)
            free = shutil.disk_usage(folder).free
            if free - sum(active.values()) - need < min_free:
                disk_stop = free
                break
            pending.pop()
            rid = f"hs-{i}"
            scheduler.add_request(vllm_compat.make_request(
                api.Request, None, request_id=rid, prompt_token_ids=ids,
                sampling_params=sampling, pooling_params=None, arrival_time=time.time()))
            active[rid] = need
            new[rid] = (i, ids)
        if new:
            rpc("eagle_expect", new)
        if not active:
            break
        out = scheduler.schedule()
        if out.total_num_scheduled_tokens:
            counts = dict(out.num_scheduled_tokens)
            # schedule() has advanced num_computed_tokens past this step (0.11-0.16)
            starts = {r: scheduler.requests[r].num_computed_tokens - n for r, n in counts.items()}
            rpc("eagle_step", counts, starts)
            vllm_compat.run_step(executor, scheduler, out)
        poll = rpc("eagle_poll")
        check(poll)
        gone = [r for r in poll["open"] if r not in scheduler.requests]
        if gone:
            raise StageError(f"vLLM finished {gone[:3]} before their hidden states were all "
                             "captured", hint="report this with the stage log: the engine "
                                              "skipped prompt positions")
        unwritten = [r for r in active if r not in scheduler.requests]
        if not unwritten or poll["written"]:
            waiting_since = None
        elif waiting_since is None:
            waiting_since = time.monotonic()
        elif time.monotonic() - waiting_since > STUCK_S:
            raise StageError(f"vLLM finished {unwritten[:3]} but no file came for them in "
                             f"{STUCK_S:.0f} s", hint="report this with the stage log; "
                                                      "finished files are kept")
        if not out.total_num_scheduled_tokens and not scheduler.requests:
            time.sleep(0.01)   # only files still being written
        if time.monotonic() - usage_at >= 2.0:
            usage_at = time.monotonic()
            usage = {"usage_perc": float(scheduler.kv_cache_manager.usage),
                     "running": len(scheduler.running), "waiting": len(scheduler.waiting)}
            if usage != last_usage:
                last_usage = usage
                on_event("kv_usage", usage)
    check(rpc("eagle_poll", True))     # let the writer finish what is complete
    if disk_stop is not None:
        raise StageError(
            f"stopped before the disk fills: {disk_stop / GB:.2f} GiB free at {folder}, below "
            "min_free_gb plus the samples in flight",
            hint="free space (or move [run] runs_dir to a bigger disk) and resume; finished "
                 "files are kept")
    return poll["samples"], poll["tokens"], poll["bytes"]


def _group_main(k, devices, api_factory, args, q, stop_event):
    """One data-parallel engine (spawned; one per tensor-parallel group)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    from datasets import load_from_disk

    from pipeline.stages.extract import RowIds, reporting
    (target, layer_ids, dtype_name, tp, sec, trust, data_dir, todo, folder, bytes_per_token,
     min_free) = args
    with reporting(q, k):
        ds = load_from_disk(data_dir).with_format(None)
        done = run_group(api_factory(), Path(target), layer_ids, dtype_name, tp, sec, trust,
                         RowIds(ds), todo, list(ds["seq_len"]), Path(folder), bytes_per_token,
                         min_free, stop_event.is_set,
                         lambda s, t, b: q.put(("progress", k, (s, t, b))),
                         lambda kind, ev: q.put(("event", k, (kind, ev))))
        q.put(("progress", k, done))


def run_engines(ctx, target, layer_ids, dtype, data_dir, data_ids, todo, lengths, folder,
                bytes_per_token, min_free, emit, api_factory=None) -> tuple[int, int, int]:
    """Extract `todo` through one engine per tensor-parallel group of the
    stage's GPUs; returns (samples, tokens, bytes)."""
    sec = ctx.section
    api_factory = api_factory or vllm_compat.load_engine_api
    gpus = ctx.cfg.stage_devices("extract")
    tp = sec.tensor_parallel  # divides len(gpus): checked with the config
    groups = [gpus[i:i + tp] for i in range(0, len(gpus), tp)] or [[]]
    dtype_name = str(dtype).replace("torch.", "")
    trust = ctx.cfg.model.trust_remote_code
    usage: dict[int, dict] = {}

    def on_event(k, kind, ev):
        if kind == "kv_cache":
            ctx.events.emit("kv_cache", server=k, devices=groups[k], **ev)
        elif kind == "kv_usage":
            usage[k] = ev
            ctx.events.emit("kv_usage", **combine_usage(list(usage.values())))

    if len(groups) == 1:
        return run_group(api_factory(), target, layer_ids, dtype_name, tp, sec, trust, data_ids,
                         todo, lengths, folder, bytes_per_token, min_free,
                         lambda: ctx.stop_requested,
                         emit,
                         lambda kind, ev: on_event(0, kind, ev))

    import multiprocessing as mp

    from pipeline.stages.extract import monitor
    spawn = mp.get_context("spawn")
    q, stop = spawn.Queue(), spawn.Event()
    order = sorted(todo, key=lambda i: -lengths[i])
    procs = []
    for k, devs in enumerate(groups):
        args = (str(target), layer_ids, dtype_name, tp, sec, trust, str(data_dir),
                order[k::len(groups)], str(folder), bytes_per_token, min_free)
        p = spawn.Process(target=_group_main, args=(k, devs, api_factory, args, q, stop))
        p.start()
        procs.append(p)
    total = monitor(ctx, procs, q, stop, emit,
                    lambda k: f"vLLM engine {k} (GPUs {groups[k]})", on_event)
    print(f"extract: {total[0]} samples through {len(groups)} vLLM engines", flush=True)
    return total
