"""The hidden-state file format, shared by every extract backend, the vLLM
connector and the train stage's checks:

    hs_{i}.safetensors
        hidden_states [seq_len, n_aux + 1, hidden]   (the target's dtype, or FP8)
        token_ids     [seq_len]                      (int64)
        hidden_states_scales [seq_len, 1, 1]         (float32; FP8 files only:
                                                      speculators' layout, pipeline.model.fp8)

i is the row of prepare/out/data. A file is written to a temp name in the
same folder and then given its final name only if that name is free
(`publish`), so a file that exists under its final name is whole and was
written once: on a cluster, a node cut off mid-write whose writes go through
when its link comes back must not replace the file another node wrote in its
place. `validate_file` says whether a file is also the right one (shape,
dtype, token ids, finite values). torch and safetensors are imported on use: the
module is loaded by stages and by vLLM's workers, never by the panel.
"""

from __future__ import annotations

import errno
import os
import queue
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from pipeline.model.fp8 import SAFETENSORS_DTYPE as SAFETENSORS_FP8
from pipeline.model.fp8 import SCALES_KEY, dequantize, quantize
from pipeline.stage_error import StageError


def hs_path(folder: Path, i: int) -> Path:
    return Path(folder) / f"hs_{i}.safetensors"


def temp_path(final: Path) -> Path:
    """A temp name beside `final`, unique per writer: random, because a pid and a
    thread id are unique on one node only (two nodes' writers can have both the
    same); a leftover (a kill mid-write) matches `.*.tmp` and never looks finished."""
    return final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def publish(tmp: Path, final: Path) -> bool:
    """Give `tmp` the name `final` unless a file has it already (then `tmp` is
    dropped); True if this writer's file is the one there now. A hard link is
    the no-replace rename that NFS, Lustre, GPFS and sshfs all do atomically; a
    filesystem without hard links gets the plain rename (and loses the guard)."""
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if final.exists():
            return False   # taken, said as another error (sshfs: EPERM; SFTP v3 has no "exists")
        if e.errno not in NO_HARD_LINKS:
            raise
        os.replace(tmp, final)
        return True
    finally:
        tmp.unlink(missing_ok=True)


NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK,
                 errno.ENOSYS}


# safetensors' writer (Rust) writes through a temp file of its own beside the
# target, `.tmp` + 6 characters (the tempfile crate's name), before it becomes
# our `.*.tmp`: a kill at that moment leaves one (seen after a SIGKILLed extract).
SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def remove_leftovers(folder: Path) -> int:
    """Delete temp files a kill left behind (ours and safetensors' own);
    returns how many."""
    n = 0
    for stale in Path(folder).glob(".*tmp*"):
        if stale.name.endswith(".tmp") or SAFETENSORS_TEMP.fullmatch(stale.name):
            stale.unlink(missing_ok=True)
            n += 1
    return n


def write_sample(final: Path, hidden_states, token_ids, check_finite: bool = False,
                 fp8: bool = False) -> int:
    """Write one sample atomically; returns the bytes of its tensors.
    check_finite: refuse (ValueError, nothing written) non-finite values,
    for writers whose readers check only the header (the vLLM connector).
    fp8: store the states in FP8 with per-token scales (pipeline.model.fp8)."""
    import torch
    from safetensors.torch import save_file
    final = Path(final)
    tmp = temp_path(final)
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    hs = hidden_states.contiguous()
    if check_finite and not bool(torch.isfinite(hs.sum(dtype=torch.float32))):
        raise ValueError(f"{final.name}: non-finite hidden states, not written")
    tensors = {"hidden_states": hs, "token_ids": ids}
    if fp8:
        q, scales = quantize(hs)
        tensors.update(hidden_states=q, **{SCALES_KEY: scales})
    try:
        save_file(tensors, str(tmp))
        publish(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_header(path: Path, token_ids, n_layers: int, hidden: int, dtype) -> str | None:
    """The cheap check of a file a trusted writer just made (one that
    refuses non-finite values itself): shape and dtype from the header, and
    the token ids; None if right. The hidden states are not read."""
    import torch
    from safetensors import SafetensorError, safe_open
    fp8 = is_fp8(dtype)
    try:
        with safe_open(str(path), framework="pt") as f:
            if set(f.keys()) != expected_keys(fp8):
                return f"tensors {sorted(f.keys())} != {sorted(expected_keys(fp8))}"
            hs = f.get_slice("hidden_states")
            shape, got = tuple(hs.get_shape()), hs.get_dtype()
            scales = tuple(f.get_slice(SCALES_KEY).get_shape()) if fp8 else None
            ids = f.get_tensor("token_ids")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return f"unreadable ({e})"
    want = (len(token_ids), n_layers, hidden)
    if shape != want:
        return f"shape {shape} != {want}"
    if fp8 and scales != (len(token_ids), 1, 1):
        return f"scales shape {scales} != {(len(token_ids), 1, 1)}"
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    if (SAFETENSORS_FP8 if fp8 else names.get(dtype, str(dtype))) != got:
        return f"dtype {got} != {dtype}"
    if not torch.equal(ids, torch.as_tensor(token_ids, dtype=ids.dtype)):
        return "token ids differ from the prepared data"
    return None


def validate_file(path: Path, token_ids, n_layers: int, hidden: int, dtype) -> str | None:
    """None if the file is a complete, correct sample; else what is wrong."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return f"unreadable ({e})"
    fp8 = is_fp8(dtype)
    if set(data) != expected_keys(fp8):
        return f"tensors {sorted(data)} != {sorted(expected_keys(fp8))}"
    hs, ids = data["hidden_states"], data["token_ids"]
    want = (len(token_ids), n_layers, hidden)
    if tuple(hs.shape) != want:
        return f"shape {tuple(hs.shape)} != {want}"
    if hs.dtype != dtype:
        return f"dtype {hs.dtype} != {dtype}"
    if not torch.equal(ids, torch.as_tensor(token_ids, dtype=ids.dtype)):
        return "token ids differ from the prepared data"
    if fp8:
        scales = data[SCALES_KEY]
        if tuple(scales.shape) != (len(token_ids), 1, 1):
            return f"scales shape {tuple(scales.shape)} != {(len(token_ids), 1, 1)}"
        hs = dequantize(hs, scales, torch.float32)
    if not bool(torch.isfinite(hs).all()):
        return "non-finite values"
    return None


def is_fp8(dtype) -> bool:
    return "float8" in str(dtype)


def expected_keys(fp8: bool) -> set[str]:
    return {"hidden_states", "token_ids"} | ({SCALES_KEY} if fp8 else set())


@dataclass
class Counters:
    """What a backend wrote: samples, their tokens, and bytes on disk."""
    samples: int = 0
    tokens: int = 0
    bytes: int = 0

    def add(self, other: "Counters") -> None:
        self.samples += other.samples
        self.tokens += other.tokens
        self.bytes += other.bytes

    def as_tuple(self) -> tuple[int, int, int]:
        return self.samples, self.tokens, self.bytes


class Writer:
    """Background threads that save finished batches while the next forward runs."""

    def __init__(self, folder: Path, threads: int = 2, depth: int = 3, release=None,
                 fp8: bool = False):
        # threads=0 writes inline: on a CPU-only run the forward already uses
        # every core, and writer threads only contend with it (measured: 0.82x
        # of a bare forward inline vs 0.75x with two threads on 2 cores).
        self.folder = Path(folder)
        self.fp8 = fp8
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.done = Counters()
        self.written: list[int] = []   # sample indices, in the order their files landed
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        # Called with a batch's bytes once it is on disk (or failed): the
        # disk guard's reservation ends there.
        self._release = release or (lambda _n: None)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, hs_host, finite, ready, items, nbytes: int) -> None:
        """hs_host [batch, seq, layers, hidden]; finite: the batch-wide check;
        ready: a CUDA event to wait for (async copies) or None; items:
        (sample index, token ids) per batch row."""
        if self.error:
            raise self.error
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
        try:
            if ready is not None:
                ready.synchronize()
            all_finite = bool(finite)
            for b, (i, ids) in enumerate(items):
                t = hs_host[b, :len(ids)]
                # The batch-wide check can also trip on padding: look closer.
                if not all_finite and not bool(torch.isfinite(t).all()):
                    raise StageError(f"sample {i}: the target produced non-finite hidden "
                                     "states", hint="check [model] dtype (try bfloat16 or "
                                                    "float32) and the model weights")
                size = write_sample(hs_path(self.folder, i), t, ids, fp8=self.fp8)
                with self._lock:
                    self.done.samples += 1
                    self.done.tokens += len(ids)
                    self.done.bytes += size
                    self.written.append(i)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
        finally:
            self._release(nbytes)

    def close(self) -> None:
        for _ in self._threads:
            self.q.put(None)
        for t in self._threads:
            t.join()
        if self.error:
            raise self.error
