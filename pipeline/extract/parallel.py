"""Data-parallel extraction: one spawned process per GPU (hf) or per
tensor-parallel group (vllm-engine), each given a shard of the rows.

A process reports over one queue: (kind, rank, payload) with kind
progress / event / done / error. The stage process sums the progress,
forwards events, stops every process at the first error (or a stop
request) and raises that error.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from contextlib import contextmanager

from pipeline.extract.job import ExtractJob
from pipeline.model.hsfile import Counters
from pipeline.run.diskspace import DiskFull
from pipeline.stage_error import StageError


@contextmanager
def reporting(q, rank: int, job: ExtractJob | None = None):
    """The body of a data-parallel process: its end, or its error, goes to
    `monitor` in the stage process (and its place in a shared queue ends)."""
    try:
        try:
            yield
        finally:
            if job is not None:
                job.finish()
        q.put(("done", rank, None))
    except StageError as e:
        q.put(("error", rank, (str(e), e.hint, False)))
    except DiskFull as e:
        q.put(("error", rank, (str(e), e.hint, True)))
    except BaseException as e:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        q.put(("error", rank, (f"{type(e).__name__}: {e}", None, False)))


def run_parallel(job: ExtractJob, shards: list[list[int]], worker, name, extra=()) -> Counters:
    """Start `worker(rank, shard_job, q, stop, *extra)` for each shard
    (spawned: CUDA and vLLM need fresh processes) and follow them."""
    spawn = mp.get_context("spawn")
    q, stop = spawn.Queue(), spawn.Event()
    procs = []
    for rank, rows in enumerate(shards):
        p = spawn.Process(target=worker, args=(rank, job.shard(rows, rank), q, stop, *extra))
        p.start()
        procs.append(p)
    return monitor(job, procs, q, stop, name)


def monitor(job: ExtractJob, procs, q, stop, name) -> Counters:
    per = {r: Counters() for r in range(len(procs))}
    finished, errors = set(), []
    while len(finished) < len(procs):
        if job.should_stop():
            stop.set()
        try:
            kind, r, payload = q.get(timeout=0.5)
        except queue.Empty:
            for r, p in enumerate(procs):
                if not p.is_alive() and r not in finished:
                    finished.add(r)
                    errors.append((f"{name(r)} died (exit code {p.exitcode})", None))
                    stop.set()
            continue
        if kind == "progress":
            per[r] = Counters(*payload)
            total = Counters()
            for c in per.values():
                total.add(c)
            job.on_progress(total)
        elif kind == "event":
            job.on_event(payload[0], {"server": r, **payload[1]})
        elif kind == "done":
            finished.add(r)
        elif kind == "error":
            finished.add(r)
            errors.append(payload)
            stop.set()
    for p in procs:
        p.join()
    if errors:
        message, hint, disk_full = errors[0]
        if disk_full:
            raise DiskFull(job.folder, message=message)
        raise StageError(message, hint=hint)
    total = Counters()
    for c in per.values():
        total.add(c)
    return total
