"""Stage 2, extract: the target's hidden states for every prepared sample.

    extract/out/hidden_states/hs_{i}.safetensors   (pipeline.model.hsfile)
    extract/out/meta.json   layer ids, hidden size, dtype (written last)

The stage decides what is left (on resume every existing file is validated:
shape, dtype, finite, token ids; only missing or bad ones are redone), the
layers, the dtype and the disk budget, and hands one `ExtractJob` to the
configured backend (pipeline.extract.job):

    hf            transformers forward with hooks (extract_hf)
    vllm-server   vLLM serving the target, our connector writing the files
                  (pipeline.extract.vllm_server)
    vllm-engine   vLLM 0.11-0.16's engine driven in-process (pipeline.extract.vllm_engine)
"""

from __future__ import annotations

import shutil
import time

from pipeline.extract.backends import backend_runner
from pipeline.extract.job import GB, DiskGuard, ExtractJob, RowIds
from pipeline.model.hsfile import Counters, hs_path, remove_leftovers, validate_file
from pipeline.run.diskspace import fmt_bytes
from pipeline.run.events import EventType
from pipeline.stages.common import StageContext, StageError, main_for, torch_dtype
from pipeline.vllm import compat
from pipeline.vllm.environment import choose_backend, probe
from pipeline.vllm.kv import combine_usage


def resolve_backend(ctx: StageContext, devices: list[int]):
    """(backend, VllmEnv or None): "auto" becomes vllm-server where vLLM can
    run here, else hf with a warning saying why; a vLLM backend that cannot
    run is an error naming what and the fix."""
    sec = ctx.section
    if sec.backend == "hf":
        ctx.events.emit(EventType.BACKEND, backend="hf", why="[stages.extract] backend = \"hf\"")
        return "hf", None
    env = probe(ctx.cfg.vllm_python())
    backend, why = choose_backend(sec.backend, env, devices)
    if sec.backend == "auto" and backend == "hf":
        ctx.events.warning(why, hint="scripts/install.sh installs vLLM's CPU build; on a GPU "
                                     "server set [runtime] vllm_python")
        ctx.events.emit(EventType.BACKEND, backend="hf", why=why)
        return "hf", None
    problem = env.unusable(devices)
    if problem:
        raise StageError(f"[stages.extract] backend = {sec.backend!r}: {problem}",
                         hint='or set backend = "hf" (or "auto")')
    if backend == "vllm-engine" and env.python != ctx.cfg.python():
        raise StageError("the vllm-engine backend runs vLLM inside the stage process, but vLLM "
                         f"is in {env.python}, not the stages' {ctx.cfg.python()}",
                         hint=f"set [runtime] python = {env.python!r}, or use backend = "
                              '"vllm-server"')
    print(f"extract: backend {backend}: {why}", flush=True)
    ctx.events.emit(EventType.BACKEND, backend=backend, why=why)
    return backend, env


def run_backend(ctx: StageContext, job: ExtractJob, backend: str) -> Counters:
    """On this node, or across the nodes of the Slurm allocation the stage
    runs in (`[cluster] nodes` > 1; pipeline.extract.nodes)."""
    cluster = ctx.cfg.cluster
    if cluster.nodes > 1:
        from pipeline.cluster.slurm import allocation_tasks
        from pipeline.extract.nodes import run_across_nodes
        tasks = allocation_tasks()
        if tasks > 1:
            return run_across_nodes(job, backend, ctx.run.stage_dir("extract") / "queue", tasks,
                                    cluster.lost_after_s, ctx.events.warning)
        ctx.events.warning(f"[cluster] nodes = {cluster.nodes}, but this process is not in a "
                           "Slurm allocation of several tasks: extracting on this node only",
                           hint='the stage spreads over nodes when run as a Slurm job '
                                '([cluster] scheduler = "slurm")')
    return backend_runner(backend)(job)


def body(ctx: StageContext) -> dict:
    import torch
    from transformers import AutoConfig

    from pipeline.extract.hf import text_config
    from pipeline.model.info import validate_layer_ids

    sec = ctx.section
    data_dir = ctx.out_of("prepare") / "data"
    if not data_dir.exists():
        raise StageError(f"{data_dir} is missing", hint="run the prepare stage first")
    target = ctx.cfg.target_path()
    trust = ctx.cfg.model.trust_remote_code
    mcfg = text_config(AutoConfig.from_pretrained(str(target), trust_remote_code=trust))
    try:
        layer_ids = validate_layer_ids(list(sec.layer_ids), mcfg.num_hidden_layers)
    except ValueError as e:
        raise StageError(f"[stages.extract] layer_ids: {e}",
                         hint="vLLM convention: id k is the residual stream after k layers") from None
    devices = ctx.cfg.stage_devices("extract")
    backend, vllm_env = resolve_backend(ctx, devices)
    dtype = torch_dtype(ctx.cfg, bool(devices))
    hidden = mcfg.hidden_size
    elem = torch.empty((), dtype=dtype).element_size()
    bytes_per_token = len(layer_ids) * hidden * elem + 8

    rows = RowIds(data_dir)
    lengths = rows.lengths()
    n = len(lengths)
    folder = ctx.out / "hidden_states"
    folder.mkdir(parents=True, exist_ok=True)
    remove_leftovers(folder)   # writes cut short by a kill: never renamed, never valid

    # Resume: keep the files that validate, redo the rest.
    todo, kept, bad = [], 0, 0
    for i in range(n):
        p = hs_path(folder, i)
        if p.exists():
            why = validate_file(p, rows[i], len(layer_ids), hidden, dtype)
            if why is None:
                kept += 1
                continue
            bad += 1
            print(f"extract: {p.name} is invalid ({why}); recomputing", flush=True)
            p.unlink()
        todo.append(i)
    if kept:
        print(f"extract: resuming, {kept}/{n} files already valid", flush=True)
    if bad:
        ctx.events.warning(f"{bad} existing hidden-state files were invalid and are recomputed")

    tokens_left = sum(lengths[i] for i in todo)
    need = tokens_left * bytes_per_token
    free = shutil.disk_usage(folder).free
    min_free = sec.min_free_gb * GB
    if need > free - min_free:
        ctx.events.warning(
            f"disk forecast: {fmt_bytes(need)} of hidden states still to write "
            f"({fmt_bytes(bytes_per_token)}/token x {tokens_left:,} tokens), but only "
            f"{fmt_bytes(max(0, free - min_free))} is free above min_free_gb at {folder}",
            hint="the stage stops cleanly before the disk fills; free space or move "
                 "[run] runs_dir, then resume")

    todo_set = set(todo)
    base_bytes = sum(hs_path(folder, i).stat().st_size for i in range(n) if i not in todo_set)
    clock = {"t0": time.time(), "emitted": 0.0, "ready": False}

    def on_progress(c: Counters, force: bool = False) -> None:
        now = time.time()
        if not clock["ready"]:
            # A backend reports zero once its model or server is up: rates
            # measure extraction, not loading.
            clock["ready"] = True
            if not c.samples:
                clock["t0"] = now
        if not force and now - clock["emitted"] < 0.5:
            return
        clock["emitted"] = now
        dt = max(now - clock["t0"], 1e-9)
        ctx.progress(kept + c.samples, n, "samples", rate=c.samples / dt if c.samples else None,
                     tokens_per_s=c.tokens / dt, bytes_written=base_bytes + c.bytes,
                     bytes_per_token=bytes_per_token,
                     disk_needed_bytes=(tokens_left - c.tokens) * bytes_per_token,
                     disk_free_bytes=shutil.disk_usage(folder).free)

    usage: dict[int, dict] = {}

    def on_event(kind: str, fields: dict) -> None:
        """KV-cache events of the vLLM backends; the live use of several
        servers / engines (data parallel) is one combined event."""
        if kind == EventType.KV_USAGE:
            usage[fields.get("server", 0)] = fields
            ctx.events.emit(kind, **combine_usage(list(usage.values())))
        else:
            ctx.events.emit(kind, **fields)

    job = ExtractJob(
        target=target, layer_ids=layer_ids, dtype=dtype, hidden=hidden, trust_remote_code=trust,
        rows=rows, lengths=lengths, todo=todo, folder=folder, bytes_per_token=bytes_per_token,
        disk=DiskGuard(folder, min_free), section=sec, devices=devices,
        vllm=vllm_env, log_dir=ctx.run.stage_dir("extract"),
        term_grace_s=ctx.cfg.runtime.term_grace_s,
        should_stop=lambda: ctx.stop_requested, on_progress=on_progress, on_event=on_event)
    done = Counters()
    if todo:
        clock["t0"] = time.time()
        done = run_backend(ctx, job, backend)
    on_progress(done, force=True)
    ctx.check_stop()
    elapsed = max(time.time() - clock["t0"], 1e-9)
    meta = {"layer_ids": layer_ids, "aux_layer_ids": layer_ids[:-1],
            "num_layers": mcfg.num_hidden_layers, "hidden_size": hidden,
            "dtype": job.dtype_name, "samples": n, "bytes_per_token": bytes_per_token,
            "backend": backend}
    ctx.write_json(ctx.out / "meta.json", meta)
    return {"samples": n, "computed": done.samples, "reused": kept, "tokens": done.tokens,
            "bytes_written": done.bytes, "tokens_per_s": round(done.tokens / elapsed, 1),
            "gb_per_s": round(done.bytes / elapsed / 1e9, 4), "layer_ids": layer_ids,
            "hidden_states": str(folder), "backend": backend,
            "adaptations": sorted(compat.fired_so_far())}


def main() -> None:
    main_for("extract", body)


if __name__ == "__main__":
    main()
