"""The one interface between the extract stage and its backends (`hf`,
`vllm-server`, `vllm-engine`): an `ExtractJob` in, `Counters` out.

The stage decides what is left to do (resume), the layers, dtype and disk
budget; a backend only turns `job.todo` into hs_{i}.safetensors files
(pipeline.model.hsfile) and reports progress and KV-cache events through the
job's callbacks. The rules every backend shares live here once: the disk
guard and the grouping of GPUs into tensor-parallel groups.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pipeline.model.hsfile import Counters
from pipeline.run.diskspace import DiskFull, fmt_bytes

GB = 1 << 30


def gpu_groups(devices: list[int], tensor_parallel: int) -> list[list[int]]:
    """One group of `tensor_parallel` GPUs per vLLM server / engine
    (tensor_parallel divides len(devices): checked with the config); on the
    CPU one group with no GPUs."""
    tp = max(1, tensor_parallel)
    return [devices[i:i + tp] for i in range(0, len(devices), tp)] or [[]]


class DiskGuard:
    """Stop before the disk fills: a unit of work may start only while the
    free space minus what is in flight minus the unit stays above min_free."""

    def __init__(self, folder: Path, min_free: float):
        self.folder, self.min_free = Path(folder), min_free
        self.in_flight = 0
        self.stopped_at: int | None = None   # free bytes seen when it said no
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            free = shutil.disk_usage(self.folder).free
            if free - self.in_flight - nbytes < self.min_free:
                self.stopped_at = free
                return False
            self.in_flight += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.in_flight -= nbytes

    def error(self) -> DiskFull:
        free = self.stopped_at if self.stopped_at is not None else \
            shutil.disk_usage(self.folder).free
        return DiskFull(self.folder, message=(
            f"stopped before the disk fills: {fmt_bytes(free)} free at {self.folder}, "
            f"below min_free_gb ({fmt_bytes(self.min_free)}) plus the samples in flight "
            f"({fmt_bytes(self.in_flight)}) and the next one"))

    def __getstate__(self):   # sent to data-parallel processes: no lock
        return {"folder": self.folder, "min_free": self.min_free}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["min_free"])


class RowIds:
    """Token ids of the prepared rows, read on demand: a real dataset's ids
    do not fit in memory as Python lists."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self._ds = None
        self._lock = threading.Lock()

    def _rows(self):
        if self._ds is None:
            # Opened once, by one thread: the server backend's clients all
            # ask at once in a fresh process, and datasets' loader is not
            # safe to run twice concurrently (tqdm: "no attribute '_lock'").
            with self._lock:
                if self._ds is None:
                    from datasets import load_from_disk
                    self._ds = load_from_disk(str(self.data_dir)).with_format(None)
        return self._ds

    def __getitem__(self, i: int) -> list[int]:
        return self._rows()[int(i)]["input_ids"]

    def __len__(self) -> int:
        return len(self._rows())

    def lengths(self) -> list[int]:
        return list(self._rows()["seq_len"])

    def __getstate__(self):   # a data-parallel process opens the dataset itself
        return {"data_dir": self.data_dir}

    def __setstate__(self, state):
        self.__init__(state["data_dir"])


def _no_stop() -> bool:
    return False


def _ignore(*_args) -> None:
    return None


@dataclass
class ExtractJob:
    """What to extract and where; the same for every backend."""
    target: Path                 # the target model's folder
    layer_ids: list[int]         # aux layer ids + the last layer (vLLM convention)
    dtype: Any                   # torch dtype the target computes in
    hidden: int
    trust_remote_code: bool
    rows: RowIds
    lengths: list[int]           # tokens per prepared row
    todo: list[int]              # rows still to extract
    folder: Path                 # extract/out/hidden_states
    bytes_per_token: int
    disk: DiskGuard
    section: Any                 # [stages.extract]
    devices: list[int]           # GPUs given to the stage ([] = CPU)
    log_dir: Path                # where server logs go (extract/)
    vllm: Any = None             # pipeline.vllm.environment.VllmEnv for the vLLM backends
    term_grace_s: float = 10.0
    should_stop: Callable[[], bool] = _no_stop
    on_progress: Callable[[Counters], None] = _ignore
    on_event: Callable[[str, dict], None] = _ignore   # ("kv_cache" | "kv_usage", fields)
    # Across nodes (pipeline.cluster.workqueue): more rows come from the shared queue
    # once `todo` is used up; None on one node.
    feed: Any = None
    node: str = ""               # this node's worker id across nodes ("" on one node)
    fp8: bool = False            # files in FP8 with per-token scales (pipeline.model.fp8)

    def more(self, wait: bool = True) -> list[int]:
        """Rows beyond `todo`: the next chunk of the queue shared with other
        nodes ([] without one, or when every chunk is done). A backend calls
        it whenever its own rows run out, and ends when it returns []; one
        with rows still in flight asks with wait=False (see WorkQueue)."""
        return self.feed.next_rows(self.folder, self.should_stop, wait) if self.feed else []

    def finish(self) -> None:
        if self.feed is not None:
            self.feed.finish()

    def max_len(self) -> int:
        """The longest row this job may see (all rows when a queue feeds it)."""
        return max((self.lengths[i] for i in (self.todo if self.feed is None else
                                               range(len(self.lengths)))), default=1)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def stored_dtype(self):
        """The files' hidden-state dtype: the target's, or FP8."""
        if self.fp8:
            import torch
            return torch.float8_e4m3fn
        return self.dtype

    def groups(self) -> list[list[int]]:
        return gpu_groups(self.devices, self.section.tensor_parallel)

    def shard(self, todo: list[int], rank: int = 0) -> "ExtractJob":
        """The same job for a data-parallel process: its own rows, no
        callbacks (they stay in the stage process), its own place in the
        shared queue."""
        return dataclasses.replace(self, todo=todo, should_stop=_no_stop,
                                   on_progress=_ignore, on_event=_ignore,
                                   feed=self.feed.for_rank(rank) if self.feed else None)
