"""Hidden-state capture inside vLLM's workers (the vllm-engine extract backend,
vLLM 0.11-0.16).

vLLM loads this itself: the stage sets ParallelConfig.worker_extension_cls
to `pipeline.extract.vllm_capture.HiddenStateCapture`, which vLLM adds to its Worker
class's bases, so the `eagle_*` methods run in every worker process and the
stage calls them through `executor.collective_rpc`. Nothing here imports vLLM.

Hooks rather than a replacement forward (what older speculators did, and
what broke with each model-class change): forward hooks on the decoder
layers — id k is the output of layer k-1, and vLLM's layers return
(hidden_states, residual), whose sum is the residual stream — and on
embed_tokens (id 0, and its input is the flat token ids, kept to check the
layout). Positions come from a pre-hook on the first layer. The base model
itself is not hooked: vLLM's compile decorator calls its forward() directly,
bypassing module hooks. The stage turns torch.compile off, so every hook runs.

One step's flat batch (gpu_model_runner._prepare_inputs, 0.11-0.16): the
requests in `input_batch.req_ids` order, each with its scheduled token count,
at positions num_computed .. num_computed+n-1. The stage sends the counts and
first positions before each step; positions and token ids seen here are
checked against them and the prepared sample, so a layout that ever differs
fails the stage instead of writing shuffled rows. A request's file is written
once its last prompt position has been seen. Only rank 0 captures: with tensor parallelism every
rank holds the same all-reduced activations.
"""

from __future__ import annotations

import inspect
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

CLASS_PATH = "pipeline.extract.vllm_capture.HiddenStateCapture"


class CaptureError(Exception):
    pass


def find_base_model(model):
    """The decoder stack (embed_tokens + layers) of a vLLM model, through
    multimodal wrappers (get_language_model(), language_model)."""
    for get in (lambda m: m.get_language_model().model, lambda m: m.language_model.model,
                lambda m: m.model):
        try:
            base = get(model)
        except AttributeError:
            continue
        if hasattr(base, "layers") and hasattr(base, "embed_tokens"):
            return base
    raise CaptureError(f"cannot find the decoder layers and embed_tokens of "
                       f"{type(model).__name__} (looked at .model, .language_model.model, "
                       "get_language_model().model)")


@dataclass
class Job:
    index: int
    ids: list[int]
    buf: object = None
    scheduled: int = 0       # the prompt positions handed to the copy thread end here
    filled: int = 0          # prompt positions 0..filled-1 are captured
    suspect: bool = False    # a non-finite value was seen in one of its steps


@dataclass
class Step:
    """One engine step on its way to the copy thread: device tensors only."""
    entries: list            # (request id, tokens, first position, Job or None), batch order
    stacked: object          # [tokens, layers, hidden]
    finite: object           # 0-d bool, on the device
    positions: object
    input_ids: object
    ready: object            # CUDA event recorded after the step's kernels, or None


class Capture:
    """The capture state of one worker: which layers, which requests, and the
    current step's flat tensors. Independent of vLLM (tests drive it with a
    stand-in model in vLLM's layer convention).

    Inside the step (it delays the next forward) only device work is queued:
    stack the layers, one finiteness reduction, copies of the positions and
    ids (vLLM reuses those buffers). A copy thread then moves the step to the
    host through a pinned buffer on its own CUDA stream, checks positions and
    ids, assembles each request and hands finished ones to the writer threads.
    Measured on an H200 (bench/bench_capture.py, 8192-token steps, 4 x 7168
    bf16): 126 ms per step when all of it ran inside the step. At most one
    step waits for the thread, so device memory stays bounded."""

    def __init__(self, layer_ids: list[int], writer, pin_host: bool = True):
        self.layer_ids = list(layer_ids)
        self.writer = writer
        self.pin_host = pin_host
        self.jobs: dict[str, Job] = {}     # not yet fully scheduled
        self.counts: dict | None = None    # the step's {request: tokens}, set by the stage
        self.starts: dict = {}             # {request: first position} (vLLM's num_computed)
        self.flat: dict = {}
        self.input_ids = self.positions = None
        self.error: str | None = None
        self.reported = 0                  # writer.written entries already handed out
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._pinned = self._stream = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="eagle-capture")
        self._thread.start()

    def expect(self, jobs: dict[str, tuple[int, list[int]]]) -> None:
        for rid, (i, ids) in jobs.items():
            self.jobs[rid] = Job(i, list(ids))

    def on_embed(self, input_ids, out) -> None:
        if self.counts is None:
            return  # vLLM's profiling and warm-up forwards
        self.input_ids = input_ids
        if 0 in self.layer_ids:
            # The first layer's fused residual add writes into this tensor.
            self.flat[0] = out.clone()

    def on_positions(self, positions) -> None:
        if self.counts is not None:
            self.positions = positions

    def on_layer(self, k: int, output) -> None:
        if self.counts is None:
            return
        if isinstance(output, tuple):
            h, r = output[0], output[1] if len(output) > 1 else None
            self.flat[k] = h if r is None else h + r
        else:
            self.flat[k] = output

    def end_step(self, req_order: list[str]) -> None:
        """Queue the step's flat batch for the copy thread (the last hooked
        layer calls this)."""
        counts, self.counts = self.counts, None
        starts, self.starts = self.starts, {}
        flat, self.flat = self.flat, {}
        ids, pos = self.input_ids, self.positions
        self.input_ids = self.positions = None
        if counts is None or self.error:
            return
        try:
            step = self._step(counts, starts, flat, req_order, ids, pos)
        except CaptureError as e:
            self.error = str(e)
            return
        self._queue.put(step)

    def _step(self, counts, starts, flat, req_order, ids, pos) -> Step:
        import torch
        order = [r for r in req_order if r in counts]
        if len(order) != len(counts):
            raise CaptureError(f"requests {sorted(set(counts) - set(order))} were scheduled but "
                               "are not in the worker's input batch")
        missing = [k for k in self.layer_ids if k not in flat]
        if missing or ids is None or pos is None:
            raise CaptureError(f"the step ran without reaching the hooks for layer ids "
                               f"{missing or self.layer_ids} (positions seen: {pos is not None}, "
                               f"token ids seen: {ids is not None})")
        total = sum(counts[r] for r in order)
        stacked = torch.stack([flat[k][:total] for k in self.layer_ids], dim=1)
        # One reduction on the device per step; a per-sample look only when it trips.
        finite = torch.isfinite(stacked.sum(dtype=torch.float32))
        if pos.dim() == 2:  # M-RoPE: [3, T], the text rows are equal
            pos = pos[0]
        entries = []
        for rid in order:
            job, p0 = self.jobs.get(rid), starts[rid]
            if job is not None:
                # From the scheduler's count, not a running sum: a request
                # vLLM preempts starts again at position 0.
                job.scheduled = p0 + counts[rid]
                if job.scheduled >= len(job.ids):
                    del self.jobs[rid]   # no longer open: the thread finishes it
            entries.append((rid, counts[rid], p0, job))
        ready = None
        if stacked.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return Step(entries, stacked, finite, pos[:total].clone(), ids[:total].clone(), ready)

    # -- the copy thread ---------------------------------------------------------
    def _run(self) -> None:
        while True:
            step = self._queue.get()
            try:
                if step is not None and not self.error:
                    self._finish(step)
            except CaptureError as e:
                self.error = str(e)
            except Exception as e:  # noqa: BLE001 - reported to the stage
                self.error = f"{type(e).__name__}: {e}"
            finally:
                self._queue.task_done()
            if step is None:
                return

    def _to_host(self, step: Step):
        import torch
        t = step.stacked
        if t.device.type != "cuda":
            return t, step.positions, step.input_ids, bool(step.finite)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=t.device)
        with torch.cuda.stream(self._stream):
            # Wait for the step's kernels only, on a stream of our own: the
            # next forward is not queued behind this copy.
            self._stream.wait_event(step.ready)
            if self.pin_host:
                if self._pinned is None or self._pinned.numel() < t.numel():
                    self._pinned = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
                host = self._pinned[:t.numel()].view(t.shape)
                host.copy_(t, non_blocking=True)
            else:
                host = t.to("cpu")
            pos, ids, finite = step.positions.to("cpu"), step.input_ids.to("cpu"), \
                step.finite.to("cpu")
            self._stream.synchronize()
        return host, pos, ids, bool(finite)

    def _finish(self, step: Step) -> None:
        import torch
        host, pos, ids, finite = self._to_host(step)
        off = 0
        for rid, n, p0, job in step.entries:
            if job is None:
                off += n
                continue
            want = torch.arange(p0, p0 + n, dtype=pos.dtype)
            if not torch.equal(pos[off:off + n], want):
                raise CaptureError(f"request {rid}: positions {pos[off:off + n].tolist()[:8]}... "
                                   f"are not {p0}, {p0 + 1}, ...: the flat batch is not laid "
                                   "out the way eagle-panel reads it (vLLM changed _prepare_inputs)")
            if p0 > job.filled:
                raise CaptureError(f"request {rid}: positions {job.filled}..{p0 - 1} were never "
                                   "captured")
            keep = max(0, min(n, len(job.ids) - p0))  # the prompt part (never a decode here)
            if not torch.equal(ids[off:off + keep].long(),
                               torch.as_tensor(job.ids[p0:p0 + keep], dtype=torch.long)):
                raise CaptureError(f"request {rid} (sample {job.index}): vLLM ran token ids that "
                                   f"differ from the prepared sample at positions {p0}..{p0 + keep - 1}")
            if job.buf is None:
                job.buf = torch.empty((len(job.ids), *host.shape[1:]), dtype=host.dtype)
            job.buf[p0:p0 + keep] = host[off:off + keep]
            job.suspect |= not finite
            job.filled = max(job.filled, p0 + keep)
            off += n
            if job.filled >= len(job.ids):
                self.writer.submit(job.buf[None], torch.tensor(not job.suspect), None,
                                   [(job.index, job.ids)], job.buf.numel() * job.buf.element_size())
                job.buf = None

    def drain(self) -> None:
        """Wait until every queued step is on the host and with the writer."""
        self._queue.join()

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._thread.join()
        self.writer.close()


class HiddenStateCapture:
    """vLLM worker extension (mixed into vLLM's Worker: `self.model_runner` is
    the worker's). Attributes are prefixed so they cannot shadow the Worker's."""

    def eagle_setup(self, layer_ids: list[int], folder: str, writer_threads: int = 2,
                    fp8: bool = False) -> dict:
        from pipeline.model.hsfile import Writer
        model = self.model_runner.model
        base = find_base_model(model)
        layers = base.layers
        n = len(layers)
        if max(layer_ids) != n:
            raise CaptureError(f"layer ids {layer_ids} end at {max(layer_ids)} but "
                               f"{type(model).__name__} has {n} decoder layers")
        capture_here = getattr(self, "rank", 0) == 0
        self._eagle = Capture(list(layer_ids), Writer(Path(folder), threads=writer_threads,
                                                      fp8=fp8))
        self._eagle_hooks = []
        if capture_here:
            self._eagle_hooks = install_hooks(self._eagle, base, layers, self._eagle_req_order)
        return {"model": type(model).__name__, "base": type(base).__name__, "layers": n,
                "captures": capture_here}

    def _eagle_req_order(self) -> list[str]:
        return list(self.model_runner.input_batch.req_ids)

    def eagle_expect(self, jobs: dict) -> None:
        if self._eagle_hooks:     # other ranks capture nothing and keep nothing
            self._eagle.expect(jobs)

    def eagle_step(self, counts: dict, starts: dict) -> None:
        if self._eagle_hooks:
            self._eagle.counts, self._eagle.starts = dict(counts), dict(starts)

    def eagle_poll(self, flush: bool = False) -> dict:
        """Files written so far, requests still open, and the first error."""
        cap = self._eagle
        if flush:
            try:
                cap.close()
            except BaseException as e:  # noqa: BLE001 - reported to the stage
                cap.error = cap.error or f"writing a file failed: {type(e).__name__}: {e}"
        elif cap.writer.error and not cap.error:
            cap.error = f"writing a file failed: {cap.writer.error}"
        d = cap.writer.done
        written = cap.writer.written[cap.reported:]
        cap.reported += len(written)
        return {"samples": d.samples, "tokens": d.tokens, "bytes": d.bytes, "written": written,
                "open": list(cap.jobs), "error": cap.error}


def first_argument(sig: inspect.Signature, args, kwargs):
    """The first argument a call passed, by the callee's signature: a named
    parameter, or the first of `*args` — vLLM's CustomOp layers (the
    embedding among them) take `forward(self, *args, **kwargs)`."""
    bound = sig.bind_partial(*args, **kwargs).arguments
    for name, value in bound.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return value[0]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            if value:
                return next(iter(value.values()))
        else:
            return value
    return None


def install_hooks(cap: Capture, base, layers, req_order) -> list:
    """The hooks `cap` needs on a vLLM-style decoder (see the module doc).
    A hook never raises: an exception there would kill vLLM's worker, so it
    is kept for the stage instead."""
    def guarded(fn):
        def hook(*a):
            try:
                fn(*a)
            except Exception as e:  # noqa: BLE001
                cap.error = cap.error or f"capture hook: {type(e).__name__}: {e}"
                cap.counts = None
            return None
        return hook

    first = layers[getattr(base, "start_layer", 0)]
    sig = inspect.signature(first.forward)
    embed_sig = inspect.signature(base.embed_tokens.forward)

    def embed(_m, args, kwargs, out):
        cap.on_embed(first_argument(embed_sig, args, kwargs), out)

    def pre(_m, args, kwargs):
        cap.on_positions(sig.bind_partial(*args, **kwargs).arguments.get("positions"))
    hooks = [base.embed_tokens.register_forward_hook(guarded(embed), with_kwargs=True),
             first.register_forward_pre_hook(guarded(pre), with_kwargs=True)]
    last = len(layers)
    for k in sorted(set(cap.layer_ids) - {0}):
        def post(_m, _args, out, k=k):
            cap.on_layer(k, out)
            if k == last:
                cap.end_step(req_order())
        hooks.append(layers[k - 1].register_forward_hook(guarded(post)))
    return hooks
