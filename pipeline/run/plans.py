"""What a run plans before vLLM says: typed values, the numbers only.

- `KvPlan`: a vLLM server's KV cache as planned — on the CPU build the space
  the panel gives it (VLLM_CPU_KVCACHE_SPACE), on GPUs the tokens its
  memory fraction should leave once the weights are loaded;
- `DiskPlan`: the hidden states' size against the free disk;
- `TargetLoads`: how many times the run loads the target into a server.

doctor makes them (pipeline/doctor/plans.py) and says them as sentences;
every vLLM server a stage starts reports its own KvPlan beside what vLLM
allocated (the `kv_cache` event's `planned`), so that the panel's KV tab,
`status --json` and the export's model card read the plan and the outcome
side by side. The sentences are made where they are shown, from the
figures, never stored.

Standard library only, like pipeline/run/events.py and summaries.py: a
reader of a run directory needs nothing else to read one back.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class KvPlan:
    """One server's KV cache as planned. `bytes_per_token` is per GPU at its
    tensor parallel size: the target's K,V, and on a server that captures
    hidden states (extract's, online train's) those too, which vLLM caches
    beside them; a server with a draft adds the draft's layers.
    `bytes_per_seq`, a linear-attention layer's fixed state per sequence."""
    where: str                     # "cpu" | "gpu"
    tp: int
    bytes_per_token: int
    max_len: int                   # the longest request, + 8
    bytes_per_seq: int = 0
    tokens: int | None = None      # what the cache should hold; None: nothing to plan against
    # the CPU build: the space given, for how many requests in flight
    requests: int | None = None
    space_gib: int | None = None
    space_why: str = ""            # "": the panel sized it; else whose it is
    ram_available: int | None = None
    # GPUs: the smallest one's memory, the share the server takes, the weights' share
    gpu_memory: int | None = None
    util: float | None = None
    util_why: str = ""
    weights_per_gpu: int | None = None   # None: the weights' size is unknown

    @property
    def space_bytes(self) -> int | None:
        """The bytes the cache is planned to get."""
        if self.space_gib is not None:
            return self.space_gib * GIB
        if self.gpu_memory is None or self.util is None:
            return None
        return int(self.gpu_memory * self.util - (self.weights_per_gpu or 0))

    @property
    def concurrency(self) -> float | None:
        """Sequences of `max_len` tokens the planned space holds at once."""
        space = self.space_bytes
        if space is None:
            return None
        return max(0.0, space / (self.max_len * self.bytes_per_token + self.bytes_per_seq))

    @property
    def fits(self) -> bool:
        """Whether the plan holds one request of `max_len` tokens (and, on
        the CPU, the space fits in the RAM available when it is known)."""
        if self.where == "cpu":
            return self.ram_available is None or (self.space_bytes or 0) <= self.ram_available
        return self.tokens is None or self.tokens >= self.max_len

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class DiskPlan:
    """The hidden states extract writes, against the disk they go to."""
    mode: str                      # [pipeline] mode: offline keeps them all on disk
    bytes_per_token: int
    stored: str                    # "fp8", "bfloat16", "float32"
    layers: int
    tokens: int | None = None      # None: the data's size is unknown
    exact: bool = False            # tokens counted after prepare, not rows x seq_length
    free_bytes: int | None = None
    at: str = ""                   # where the free space was read
    reserve_bytes: int = 0         # [stages.extract] min_free_gb, kept free
    fp8_bytes: int | None = None   # what FP8 storage would need, where it is an option
    on_disk_files: int | None = None   # hybrid: the files extract left
    on_disk_bytes: int | None = None
    keep_generated_bytes: int = 0  # online/hybrid: what is kept for later epochs

    @property
    def need_bytes(self) -> int | None:
        return None if self.tokens is None else self.tokens * self.bytes_per_token

    @property
    def room_bytes(self) -> int | None:
        return None if self.free_bytes is None else self.free_bytes - self.reserve_bytes

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class TargetLoad:
    """One kind of target load: `count` servers of `tp` GPUs each."""
    what: str                      # "extract", "evaluate (3 checkpoints)", ...
    count: int
    tp: int
    method: str = ""               # the speculative method it serves ("" none)
    last_start_s: float | None = None   # how long the last such start took here


@dataclass(frozen=True)
class TargetLoads:
    loads: tuple[TargetLoad, ...] = ()
    swap_unavailable: str | None = None   # why evaluate cannot swap drafts (None: it can)

    @property
    def total(self) -> int:
        return sum(x.count for x in self.loads)

    @property
    def measured_s(self) -> float:
        """The seconds of loading measured here for the loads that have a figure."""
        return sum(x.count * x.last_start_s for x in self.loads if x.last_start_s)

    def to_json(self) -> dict:
        return {"loads": [_json(x) for x in self.loads], "total": self.total,
                **({"swap_unavailable": self.swap_unavailable} if self.swap_unavailable else {})}


@dataclass(frozen=True)
class Plans:
    """doctor's plans for a config (None: not made, e.g. no vLLM stage)."""
    kv: KvPlan | None = None
    disk: DiskPlan | None = None
    loads: TargetLoads | None = None

    def to_json(self) -> dict:
        return {k: v.to_json() for k in ("kv", "disk", "loads")
                if (v := getattr(self, k)) is not None}


def _json(value) -> dict:
    """The value's fields as JSON, the derived figures beside them (readers
    of the JSON get them without this module); None left out."""
    out = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    for name in ("space_bytes", "concurrency", "fits", "need_bytes", "room_bytes"):
        if hasattr(type(value), name):
            out[name] = getattr(value, name)
    return {k: v for k, v in out.items() if v is not None and v != ""}


def _known(cls, data: Mapping) -> dict[str, Any]:
    """The fields of `cls` in `data` that hold a value of their declared
    type (a damaged or newer file's other keys are left out; a bool is no
    number here, as in events.py)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        v = data.get(f.name)
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        if v is not None and any(_is(v, t) for t in kinds):
            out[f.name] = v
    return out


def _is(value, kind) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))
    return kind in (int, str) and isinstance(value, kind)


def read_kv(data: Mapping | None) -> KvPlan | None:
    """A KvPlan back from its JSON (a `kv_cache` event's `planned`); None
    when absent or missing what every plan has."""
    if not isinstance(data, Mapping):
        return None
    d = _known(KvPlan, data)
    if not {"where", "tp", "bytes_per_token", "max_len"} <= d.keys():
        return None
    return KvPlan(**d)
