"""Stage 2, extract: the target's hidden states for every prepared sample.

    extract/out/hidden_states/hs_{i}.safetensors
        hidden_states [seq_len, n_aux + 1, hidden]  (model dtype)
        token_ids     [seq_len]                     (int64)
    extract/out/meta.json   layer ids, hidden size, dtype (written last)

i is the row of prepare/out/data. Each file is written to a temp name and
renamed, so a file that exists is whole; on resume every existing file is
validated (shape, dtype, finite, token ids) and only the rest is computed.
Forward passes and file writes overlap: a writer thread saves batch n while
the model runs batch n+1 (on CUDA the device-to-host copy is async into
pinned memory).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.stages.common import StageContext, StageError, main_for, torch_dtype

GB = 1 << 30


def hs_path(folder: Path, i: int) -> Path:
    return folder / f"hs_{i}.safetensors"


def validate_file(path: Path, token_ids, n_layers: int, hidden: int, dtype) -> str | None:
    """None if the file is a complete, correct sample; else what is wrong."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return f"unreadable ({e})"
    hs, ids = data.get("hidden_states"), data.get("token_ids")
    if hs is None or ids is None:
        return "missing hidden_states or token_ids"
    want = (len(token_ids), n_layers, hidden)
    if tuple(hs.shape) != want:
        return f"shape {tuple(hs.shape)} != {want}"
    if hs.dtype != dtype:
        return f"dtype {hs.dtype} != {dtype}"
    if not torch.equal(ids, torch.as_tensor(token_ids, dtype=ids.dtype)):
        return "token ids differ from the prepared data"
    if not bool(torch.isfinite(hs).all()):
        return "non-finite values"
    return None


def length_batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group samples of similar length so that padding stays small:
    longest first, each batch at most batch_tokens padded tokens."""
    order = sorted(indices, key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and lengths[cur[0]] * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class RowIds:
    """Token ids of the prepared rows, read on demand: a real dataset's ids
    do not fit in memory as Python lists."""

    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, i: int) -> list[int]:
        return self.ds[int(i)]["input_ids"]


@dataclass
class Counters:
    samples: int = 0
    tokens: int = 0
    bytes: int = 0


class Writer:
    """Background threads that save finished batches while the next forward runs."""

    def __init__(self, folder: Path, threads: int = 2, depth: int = 3):
        # threads=0 writes inline: on a CPU-only run the forward already uses
        # every core, and writer threads only contend with it (measured: 0.82x
        # of a bare forward inline vs 0.75x with two threads on 2 cores).
        self.folder = folder
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.done = Counters()
        self.written: list[int] = []   # sample indices, in the order their files landed
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.pending_bytes = 0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, hs_host, finite, ready, items, nbytes: int) -> None:
        if self.error:
            raise self.error
        with self._lock:
            self.pending_bytes += nbytes
        if self._threads:
            self.q.put((hs_host, finite, ready, items, nbytes))
        else:
            self._write(hs_host, finite, ready, items, nbytes)
            if self.error:
                raise self.error

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            self._write(*job)

    def _write(self, hs_host, finite, ready, items, nbytes) -> None:
        import torch
        from safetensors.torch import save_file
        try:
            if ready is not None:
                ready.synchronize()
            all_finite = bool(finite)
            for b, (i, ids) in enumerate(items):
                t = hs_host[b, :len(ids)].contiguous()
                # The batch-wide check can also trip on padding: look closer.
                if not all_finite and not bool(torch.isfinite(t).all()):
                    raise StageError(f"sample {i}: the target produced non-finite hidden "
                                     "states", hint="check [model] dtype (try bfloat16 or "
                                                    "float32) and the model weights")
                final = hs_path(self.folder, i)
                tmp = final.with_name(f".{final.name}.{threading.get_ident()}.tmp")
                save_file({"hidden_states": t,
                           "token_ids": torch.as_tensor(ids, dtype=torch.long)}, str(tmp))
                os.replace(tmp, final)
                with self._lock:
                    self.done.samples += 1
                    self.done.tokens += len(ids)
                    self.done.bytes += t.numel() * t.element_size() + 8 * len(ids)
                    self.written.append(i)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
        finally:
            with self._lock:
                self.pending_bytes -= nbytes

    def close(self) -> None:
        for _ in self._threads:
            self.q.put(None)
        for t in self._threads:
            t.join()
        if self.error:
            raise self.error


def extract_shard(backend, data_ids, todo: list[int], lengths, folder: Path, batch_tokens: int,
                  bytes_per_token: int, min_free: float, on_batch, should_stop,
                  writer_threads: int | None = None) -> Counters:
    """Run `todo` through the backend and write the files; returns what was written."""
    import torch
    if writer_threads is None:
        writer_threads = 2 if backend.device.type == "cuda" else 0
    writer = Writer(folder, threads=writer_threads)
    stopped_for_disk = None
    try:
        for batch in length_batches(todo, lengths, batch_tokens):
            if should_stop():
                break
            ids = [data_ids[i] for i in batch]
            nbytes = bytes_per_token * sum(len(r) for r in ids)
            free = shutil.disk_usage(folder).free
            if free - writer.pending_bytes - nbytes < min_free:
                stopped_for_disk = free
                break
            hs = backend.forward(ids)
            # One reduction for the whole batch (NaN and inf survive a sum; fp32
            # accumulation cannot overflow on real activations), on the device
            # where the tensor is: measured 4% of the CPU loop as a per-sample
            # isfinite pass, and a full host pass in the writer on CUDA.
            finite = torch.isfinite(hs.sum(dtype=torch.float32))
            if hs.device.type == "cuda":
                host = torch.empty(hs.shape, dtype=hs.dtype, pin_memory=True)
                host.copy_(hs, non_blocking=True)
                finite_host = torch.empty(finite.shape, dtype=finite.dtype, pin_memory=True)
                finite_host.copy_(finite, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                host, finite_host, ready = hs, finite, None
            writer.submit(host, finite_host, ready, list(zip(batch, ids)), nbytes)
            on_batch(writer.done)
    finally:
        writer.close()
    on_batch(writer.done)
    if stopped_for_disk is not None:
        raise StageError(
            f"stopped before the disk fills: {stopped_for_disk / GB:.2f} GiB free at "
            f"{folder}, below min_free_gb plus the next batch",
            hint="free space (or move [run] runs_dir to a bigger disk) and resume; "
                 "finished files are kept")
    return writer.done


def _worker(rank, device, model_path, layer_ids, dtype_name, trust, data_dir, todo, folder,
            batch_tokens, bytes_per_token, min_free, progress_q, stop_event, torch_threads):
    """One data-parallel extractor process (spawned; one per GPU)."""
    import torch
    if torch_threads:
        torch.set_num_threads(torch_threads)
    from datasets import load_from_disk

    from pipeline.stages.extract_hf import HFBackend
    with reporting(progress_q, rank):
        ds = load_from_disk(data_dir).with_format(None)
        data_ids = RowIds(ds)
        lengths = list(ds["seq_len"])
        backend = HFBackend.load(Path(model_path), layer_ids, device, getattr(torch, dtype_name),
                                 trust)
        extract_shard(backend, data_ids, todo, lengths, Path(folder), batch_tokens,
                      bytes_per_token, min_free,
                      lambda c: progress_q.put(("progress", rank, (c.samples, c.tokens, c.bytes))),
                      stop_event.is_set)


def body(ctx: StageContext) -> dict:
    import torch
    from datasets import load_from_disk
    from transformers import AutoConfig

    from pipeline.stages.extract_hf import text_config, validate_layer_ids

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
    devices = ctx.devices
    # vLLM runs the model in bf16 by default whatever the stage's own device.
    dtype = torch_dtype(ctx.cfg, devices[0].startswith("cuda") or sec.backend.startswith("vllm"))
    hidden = mcfg.hidden_size
    elem = torch.empty((), dtype=dtype).element_size()
    bytes_per_token = len(layer_ids) * hidden * elem + 8

    ds = load_from_disk(str(data_dir)).with_format(None)
    data_ids = RowIds(ds)
    lengths = list(ds["seq_len"])
    n = len(ds)
    folder = ctx.out / "hidden_states"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".*.tmp"):
        stale.unlink()  # a write cut short by a kill: never renamed, never valid

    # Resume: keep the files that validate, redo the rest.
    todo, kept, bad = [], 0, 0
    for i in range(n):
        p = hs_path(folder, i)
        if p.exists():
            why = validate_file(p, data_ids[i], len(layer_ids), hidden, dtype)
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
            f"disk forecast: {need / GB:.2f} GiB of hidden states still to write "
            f"({bytes_per_token / 1024:.1f} KiB/token x {tokens_left:,} tokens), but only "
            f"{(free - min_free) / GB:.2f} GiB is free above min_free_gb at {folder}",
            hint="the stage stops cleanly before the disk fills; free space or move "
                 "[run] runs_dir, then resume")

    t0 = time.time()
    todo_set = set(todo)
    base_samples = kept
    base_bytes = sum(hs_path(folder, i).stat().st_size for i in range(n) if i not in todo_set)
    last_emit = [0.0]

    def emit(samples: int, tokens: int, nbytes: int, force: bool = False):
        now = time.time()
        if not force and now - last_emit[0] < 0.5:
            return
        last_emit[0] = now
        dt = max(now - t0, 1e-9)
        left_tokens = tokens_left - tokens
        ctx.progress(base_samples + samples, n, "samples", rate=samples / dt if samples else None,
                     tokens_per_s=tokens / dt, bytes_written=base_bytes + nbytes,
                     bytes_per_token=bytes_per_token, disk_needed_bytes=left_tokens * bytes_per_token,
                     disk_free_bytes=shutil.disk_usage(folder).free)

    world = len(devices) if devices[0] != "cpu" else max(1, sec.workers)
    if not todo:
        totals = (0, 0, 0)
    elif sec.backend == "vllm-server":
        from pipeline.stages.extract_vllm import run_servers
        totals = run_servers(ctx, target, layer_ids, dtype, hidden, data_ids, todo, lengths,
                             folder, bytes_per_token, min_free, emit)
    elif sec.backend == "vllm-engine":
        from pipeline.stages.extract_engine import run_engines
        totals = run_engines(ctx, target, layer_ids, dtype, data_dir, data_ids, todo, lengths,
                             folder, bytes_per_token, min_free, emit)
    elif world == 1:
        from pipeline.stages.extract_hf import HFBackend
        backend = HFBackend.load(target, layer_ids, devices[0], dtype, trust)
        t0 = time.time()  # rates measure extraction, not model loading
        done = extract_shard(
            backend, data_ids, todo, lengths, folder, sec.batch_tokens, bytes_per_token, min_free,
            lambda c: (ctx.check_stop(), emit(c.samples, c.tokens, c.bytes)),
            lambda: ctx.stop_requested)
        totals = (done.samples, done.tokens, done.bytes)
    else:
        totals = _run_parallel(ctx, world, devices, target, layer_ids, dtype, trust, data_dir,
                               todo, folder, bytes_per_token, min_free, emit)
    emit(*totals, force=True)
    ctx.check_stop()
    elapsed = max(time.time() - t0, 1e-9)
    meta = {"layer_ids": layer_ids, "aux_layer_ids": layer_ids[:-1], "num_layers": mcfg.num_hidden_layers,
            "hidden_size": hidden, "dtype": str(dtype).replace("torch.", ""), "samples": n,
            "bytes_per_token": bytes_per_token, "backend": sec.backend}
    ctx.write_json(ctx.out / "meta.json", meta)
    return {"samples": n, "computed": totals[0], "reused": kept, "tokens": totals[1],
            "bytes_written": totals[2], "tokens_per_s": round(totals[1] / elapsed, 1),
            "gb_per_s": round(totals[2] / elapsed / 1e9, 4), "layer_ids": layer_ids,
            "hidden_states": str(folder)}


@contextmanager
def reporting(q, rank: int):
    """The body of a data-parallel extract process: its end, or its error,
    goes to `monitor` in the stage process."""
    try:
        yield
        q.put(("done", rank, None))
    except StageError as e:
        q.put(("error", rank, (str(e), e.hint)))
    except BaseException as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        q.put(("error", rank, (f"{type(e).__name__}: {e}", None)))


def _run_parallel(ctx, world, devices, target, layer_ids, dtype, trust, data_dir, todo, folder,
                  bytes_per_token, min_free, emit):
    """One process per device, samples dealt round-robin by length."""
    import multiprocessing as mp
    spawn = mp.get_context("spawn")
    q, stop = spawn.Queue(), spawn.Event()
    order = sorted(todo)
    shards = [order[r::world] for r in range(world)]
    threads = max(1, (os.cpu_count() or 1) // world)
    dtype_name = str(dtype).replace("torch.", "")
    procs = []
    for r in range(world):
        dev = devices[r] if devices[0] != "cpu" else "cpu"
        p = spawn.Process(target=_worker, args=(
            r, dev, str(target), layer_ids, dtype_name, trust, str(data_dir), shards[r], str(folder),
            ctx.section.batch_tokens, bytes_per_token, min_free, q, stop,
            threads if dev == "cpu" else 0))
        p.start()
        procs.append(p)
    return monitor(ctx, procs, q, stop, emit, lambda r: f"extract worker {r}")


def monitor(ctx, procs, q, stop, emit, name, on_event=None) -> tuple[int, int, int]:
    """Follow data-parallel extract processes: their messages are
    (kind, rank, payload) with kind progress / event / done / error. Totals
    summed; the first error stops the others and is raised."""
    per = {r: (0, 0, 0) for r in range(len(procs))}
    finished, errors = set(), []
    while len(finished) < len(procs):
        if ctx.stop_requested:
            stop.set()
        try:
            kind, r, payload = q.get(timeout=0.5)
        except Exception:  # noqa: BLE001 - queue.Empty
            for r, p in enumerate(procs):
                if not p.is_alive() and r not in finished:
                    finished.add(r)
                    errors.append((f"{name(r)} died (exit code {p.exitcode})", None))
                    stop.set()
            continue
        if kind == "progress":
            per[r] = payload
            emit(*[sum(v[k] for v in per.values()) for k in range(3)])
        elif kind == "event" and on_event:
            on_event(r, *payload)
        elif kind == "done":
            finished.add(r)
        elif kind == "error":
            finished.add(r)
            errors.append(payload)
            stop.set()
    for p in procs:
        p.join()
    if errors:
        raise StageError(errors[0][0], hint=errors[0][1])
    return tuple(sum(v[k] for v in per.values()) for k in range(3))


def main() -> None:
    main_for("extract", body)


if __name__ == "__main__":
    main()
