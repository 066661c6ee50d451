"""The extract stage's hf loop (pipeline.extract.hf.extract_shard) called
directly on a benchmark's own model and rows, shared by the benchmarks that
set it against a bare forward (bench_stages.py, bench_gpu.py). A helper
module, not a script."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import ExtractSection
from pipeline.extract.hf import HFBackend, extract_shard
from pipeline.extract.job import DiskGuard, ExtractJob
from pipeline.model.hsfile import Counters


def bytes_per_token(backend: HFBackend) -> int:
    """What one token costs on disk: every captured layer, plus its id."""
    elem = backend.torch.empty((), dtype=backend.dtype).element_size()
    return len(backend.layer_ids) * backend.hidden_size * elem + 8


def job(backend: HFBackend, rows, lengths: list[int], todo: list[int], folder: Path,
        batch_tokens: int) -> ExtractJob:
    """The job the stage would hand the hf backend for these rows: the same
    length batches, no disk floor, no callbacks (progress is not timed)."""
    return ExtractJob(
        target=Path("."), layer_ids=backend.layer_ids, dtype=backend.dtype,
        hidden=backend.hidden_size, trust_remote_code=False, rows=rows, lengths=lengths,
        todo=list(todo), folder=Path(folder), bytes_per_token=bytes_per_token(backend),
        disk=DiskGuard(Path(folder), 0.0), section=ExtractSection(batch_tokens=batch_tokens),
        devices=[], log_dir=Path(folder))


def stage_loop(backend: HFBackend, rows, lengths: list[int], todo: list[int], folder: Path,
               batch_tokens: int, writer_threads: int | None = None) -> Counters:
    """The stage's loop (forward, finiteness check, async copy on CUDA,
    atomic writes) over `todo` into `folder`; what it wrote."""
    return extract_shard(backend, job(backend, rows, lengths, todo, folder, batch_tokens),
                         writer_threads=writer_threads)
