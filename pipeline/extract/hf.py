"""The `hf` extract backend: a transformers forward that captures the
residual stream at the requested layers.

Layer ids follow vLLM: id k is the residual stream after k decoder layers
(0 = the embeddings, num_layers = the last layer's output *before* the final
norm), so files from this backend and from vLLM are interchangeable. HF's
`output_hidden_states` puts the final norm on its last entry, so the layers
are captured with hooks instead, which also keeps only the layers asked for.

`run(job)` is the backend: batches of similar length through the model on
the CPU or one GPU, or one spawned process per GPU (data parallel). A
writer saves batch n while the model runs batch n+1 (on CUDA through pinned
memory and async copies).
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.extract.job import ExtractJob
from pipeline.extract.parallel import reporting, run_parallel
from pipeline.model.hsfile import Counters, Writer


def text_config(config):
    """Multimodal wrappers (Kimi-K2.5, Qwen-VL) keep the decoder in text_config."""
    return getattr(config, "text_config", None) or config


def load_model(model_path: Path, dtype, trust_remote_code: bool = False):
    """The target with transformers: a causal LM, or a multimodal wrapper
    (Kimi-K2.5's Kimi_K25ForConditionalGeneration) that AutoModelForCausalLM
    does not take; the forward then runs its text decoder only."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    auto = AutoModelForCausalLM
    if getattr(config, "text_config", None) is not None and \
            type(config) not in AutoModelForCausalLM._model_mapping:
        auto = AutoModelForImageTextToText
    return auto.from_pretrained(str(model_path), config=config, dtype=dtype,
                                trust_remote_code=trust_remote_code,
                                **dequantizing(config))


def dequantizing(config) -> dict:
    """A compressed-tensors target loaded dequantized, through transformers'
    own option: left compressed, a dense pack-quantized Linear has no
    `.weight` and its forward fails on the CPU ("'Linear' object has no
    attribute 'weight'", transformers 5.19 with compressed-tensors 0.17: a
    dense INT4 Llama); dequantized, its weights equal compressed-tensors'
    own dequantization (tests/vllm/test_int4_target.py). `dequantize=True` is
    the option's name from transformers 5 (`run_compressed=False` before)."""
    import inspect
    q = getattr(text_config(config), "quantization_config", None) or \
        getattr(config, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    if str(getattr(method, "value", method)) != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig
    params = inspect.signature(CompressedTensorsConfig.__init__).parameters
    off = {"dequantize": True} if "dequantize" in params else {"run_compressed": False}
    return {"quantization_config": CompressedTensorsConfig(**off)}


def decoder_layers(model, num_layers: int):
    """The ModuleList of decoder layers, wherever the architecture keeps it."""
    import torch.nn as nn
    for name in ("model.layers", "model.language_model.layers", "language_model.model.layers",
                 "transformer.h", "model.decoder.layers"):
        obj = model
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) == num_layers:
            return obj
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


class HFBackend:
    """Forward batches of token ids; returns [batch, seq, n_layers, hidden]."""

    def __init__(self, model, layer_ids: list[int]):
        import torch
        self.torch = torch
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        cfg = text_config(model.config)
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.layer_ids = layer_ids
        self._layers = decoder_layers(model, self.num_layers)
        self._captured: dict[int, object] = {}
        self._hooks = []
        for k in layer_ids:
            if k == 0:
                self._hooks.append(self._layers[0].register_forward_pre_hook(self._pre_hook))
            else:
                self._hooks.append(self._layers[k - 1].register_forward_hook(self._hook(k)))
        # Run the decoder only: the LM head's logits are not needed.
        self._body = getattr(model, "model", None) or model

    @classmethod
    def load(cls, model_path: Path, layer_ids: list[int], device: str, dtype,
             trust_remote_code: bool = False) -> "HFBackend":
        return cls(load_model(model_path, dtype, trust_remote_code).to(device), layer_ids)

    def _pre_hook(self, _module, args, kwargs=None):
        self._captured[0] = args[0] if args else kwargs["hidden_states"]

    def _hook(self, k):
        def hook(_module, _args, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output
        return hook

    def forward(self, batch: list[list[int]]):
        """Right-padded batch -> hidden states [B, T, L, H] on the device."""
        torch = self.torch
        longest = max(len(r) for r in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        self._captured.clear()
        with torch.inference_mode():
            self._body(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                       use_cache=False)
            return torch.stack([self._captured[k] for k in self.layer_ids], dim=2)

    def close(self):
        for h in self._hooks:
            h.remove()


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


def _batches(job: ExtractJob, todo: list[int]):
    """Batches of `todo`, then of each chunk the shared queue hands over
    (across nodes); the writer keeps writing while a chunk is claimed."""
    while todo:
        yield from length_batches(todo, job.lengths, job.section.batch_tokens)
        todo = [] if job.should_stop() else job.more()


def extract_shard(backend: HFBackend, job: ExtractJob, writer_threads: int | None = None) -> Counters:
    """Run `job.todo` through the model and write the files."""
    import torch
    if writer_threads is None:
        writer_threads = 2 if backend.device.type == "cuda" else 0
    writer = Writer(job.folder, threads=writer_threads, release=job.disk.release, fp8=job.fp8)
    disk_full = False
    job.on_progress(writer.done)   # loaded: extraction starts now
    todo = job.todo or job.more()
    try:
        for batch in _batches(job, todo):
            if job.should_stop():
                break
            ids = [job.rows[i] for i in batch]
            nbytes = job.bytes_per_token * sum(len(r) for r in ids)
            if not job.disk.reserve(nbytes):
                disk_full = True
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
            writer.submit(host, finite_host, ready, list(zip(batch, ids, strict=True)), nbytes)
            job.on_progress(writer.done)
    finally:
        writer.close()
    job.on_progress(writer.done)
    if disk_full:
        raise job.disk.error()
    return writer.done


def _worker(rank: int, job: ExtractJob, q, stop, devices: list[str], torch_threads: int) -> None:
    """One data-parallel extractor process (spawned; one per GPU)."""
    import torch
    device = devices[rank]
    if torch_threads:
        torch.set_num_threads(torch_threads)
    with reporting(q, rank, job):
        job.should_stop = stop.is_set
        job.on_progress = lambda c: q.put(("progress", rank, c.as_tuple()))
        backend = HFBackend.load(job.target, job.layer_ids, device, job.dtype,
                                 job.trust_remote_code)
        extract_shard(backend, job)


def run(job: ExtractJob) -> Counters:
    """The hf backend: in this process on the CPU or one GPU; one process
    per GPU (or per `workers` on the CPU) otherwise."""
    devices = [f"cuda:{i}" for i in range(len(job.devices))] or ["cpu"]
    world = len(devices) if job.devices else max(1, job.section.workers)
    if world == 1:
        backend = HFBackend.load(job.target, job.layer_ids, devices[0], job.dtype,
                                 job.trust_remote_code)
        return extract_shard(backend, job)
    order = sorted(job.todo)
    shards = [order[r::world] for r in range(world)]
    threads = max(1, (os.cpu_count() or 1) // world)
    per_rank = devices if job.devices else ["cpu"] * world
    return run_parallel(job, shards, _worker, lambda r: f"extract worker {r}",
                        (per_rank, 0 if job.devices else threads))
