"""One queue of samples for workers on several nodes, kept in files on the
filesystem every node sees (the run directory): data-parallel extraction
across a Slurm allocation.

Design note. There is no server to lose: every worker is a peer, and the
queue is a folder.

    plan.json         the chunks: a partition of the rows still to do
    claims/K.G        chunk K taken by a worker (the file holds its id);
                      created with O_EXCL, so exactly one claimant wins a
                      name. G is the generation: a chunk taken over from a
                      lost worker is claimed again as K.(G+1).
    done/K            every file of chunk K is written (set by its owner,
                      only once the files exist)
    alive/W           worker W's heartbeat: a counter it rewrites every
                      `lost_after_s / 5` seconds
    status/W.json     what worker W reports upward (progress, KV, errors)
    STOP              the coordinator asks every worker to stop

A worker is lost when its heartbeat counter has not moved for
`lost_after_s` seconds *as seen by the observer's own monotonic clock*:
no clock on two nodes is compared, and nothing depends on mtimes (NFS
servers set those). A lost worker's claimed chunks that are not done are
claimed again by the next worker that runs out of work; the rows of a
chunk whose files already exist (written before the loss; every file is
written atomically) are not redone. A worker that comes back after its
chunk was taken over loses it: it takes no new rows from it.

Why chunks and not single rows: a claim is a file create on a shared
filesystem (a round trip to the NFS server); a chunk amortizes it, and a
lost node redoes at most the chunks it held.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from pipeline.model.hsfile import hs_path
from pipeline.run.diskspace import DiskFull
from pipeline.run.rundir import atomic_write_bytes, atomic_write_json

POLL_S = 0.5


def plan_chunks(rows: list[int], lengths: list[int], workers: int,
                chunk_samples: int = 0) -> list[list[int]]:
    """Split `rows` into chunks, longest rows first (the long ones do not
    all land at the end). Without a size, ~8 chunks per worker, 1..64 rows
    each: small enough to balance, large enough to keep claims rare."""
    order = sorted(rows, key=lambda i: -lengths[i])
    size = chunk_samples or max(1, min(64, len(order) // max(1, workers * 8) or 1))
    return [order[k:k + size] for k in range(0, len(order), size)]


def worker_id(rank: str | int | None = None) -> str:
    """host-PROCID, and the local process's rank for data parallel within a node."""
    base = f"{socket.gethostname().split('.')[0]}-{os.environ.get('SLURM_PROCID', os.getpid())}"
    return base if rank is None else f"{base}.{rank}"


class WorkQueue:
    def __init__(self, folder: Path, worker: str, lost_after_s: float = 120.0):
        self.folder = Path(folder)
        self.worker = worker
        self.lost_after_s = lost_after_s
        self._chunks: list[list[int]] | None = None
        self._mine: set[int] = set()          # chunks this worker claimed, not yet done
        self._seen: dict[str, tuple[str, float]] = {}   # worker -> (beat, first seen at)
        self._claims: dict[str, str] = {}     # claim file -> its worker (files never change)
        self._beat: threading.Thread | None = None
        self._stopped_beating = threading.Event()
        self._files: Path | None = None       # where the rows' files go (the hs folder)
        self._idle_at = -POLL_S               # when a look without waiting last found nothing

    # ---- the coordinator's side -------------------------------------------------
    @classmethod
    def create(cls, folder: Path, chunks: list[list[int]]) -> None:
        """A fresh queue (a previous attempt's is removed: its claims are void)."""
        folder = Path(folder)
        shutil.rmtree(folder, ignore_errors=True)
        for sub in ("claims", "done", "alive", "status"):
            (folder / sub).mkdir(parents=True)
        atomic_write_json(folder / "plan.json", {"chunks": chunks})

    def request_stop(self) -> None:
        (self.folder / "STOP").touch()

    def stop_requested(self) -> bool:
        return (self.folder / "STOP").exists()

    # ---- what everyone reads ----------------------------------------------------
    def __getstate__(self):     # to a spawned process: a new worker with the same folder
        return {"folder": self.folder, "worker": self.worker, "lost_after_s": self.lost_after_s}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["worker"], state["lost_after_s"])

    def for_rank(self, rank: int) -> WorkQueue:
        """The same queue for local process `rank` (its own heartbeat)."""
        return WorkQueue(self.folder, f"{self.worker}.{rank}", self.lost_after_s)

    @property
    def chunks(self) -> list[list[int]]:
        if self._chunks is None:
            self._chunks = json.loads((self.folder / "plan.json").read_text())["chunks"]
        return self._chunks

    def done(self) -> set[int]:
        return {int(n) for n in os.listdir(self.folder / "done")}

    def owners(self) -> dict[int, tuple[int, str]]:
        """chunk -> (generation, worker) of its newest claim. A claim file
        never changes once written, so each is read once (thousands of
        chunks, polled every POLL_S, on a network filesystem); one still
        empty (created, not yet written) is left for the next look."""
        out: dict[int, tuple[int, str]] = {}
        for name in os.listdir(self.folder / "claims"):
            k, _, g = name.partition(".")
            if not g.isdigit():
                continue
            k, g = int(k), int(g)
            if k in out and out[k][0] >= g:
                continue
            worker = self._claims.get(name)
            if worker is None:
                try:
                    worker = (self.folder / "claims" / name).read_text()
                except OSError:
                    continue
                if not worker:
                    continue
                self._claims[name] = worker
            out[k] = (g, worker)
        return out

    def lost(self, workers) -> set[str]:
        """Of `workers`, those whose heartbeat has not moved for lost_after_s
        (a worker that never beat counts from when it was first looked for),
        and those that exited: a chunk they hold and did not finish is open."""
        now, out = time.monotonic(), set()
        for w in set(workers):
            try:
                beat = (self.folder / "alive" / w).read_text()
            except OSError:
                beat = ""
            old = self._seen.get(w)
            if beat == "exited":
                out.add(w)
            elif old is None or old[0] != beat:
                self._seen[w] = (beat, now)
            elif now - old[1] >= self.lost_after_s:
                out.add(w)
        return out

    def exited(self, worker: str) -> bool:
        try:
            return (self.folder / "alive" / worker).read_text() == "exited"
        except OSError:
            return False

    def remaining_rows(self) -> int:
        done = self.done()
        return sum(len(c) for k, c in enumerate(self.chunks) if k not in done)

    def statuses(self) -> dict[str, dict]:
        out = {}
        for p in (self.folder / "status").glob("*.json"):
            try:
                out[p.stem] = json.loads(p.read_text())
            except (OSError, ValueError):
                continue   # being replaced: read next time
        return out

    # ---- a worker's side --------------------------------------------------------
    def report(self, status: dict) -> None:
        atomic_write_json(self.folder / "status" / f"{self.worker}.json",
                          {**status, "worker": self.worker, "t": time.time()})

    def next_rows(self, files: Path, should_stop: Callable[[], bool] = lambda: False,
                  wait: bool = True) -> list[int]:
        """Rows of the next chunk this worker now owns, without those whose
        file exists; [] once every chunk is done (or on a stop). Waits
        while the only chunks left are held by live workers: one of them
        may yet be lost, and its chunk handed here. With wait=False, []
        also when nothing can be claimed right now (a caller with rows in
        flight must not wait on its own chunk)."""
        self._files = Path(files)
        self.start_beating()
        if not wait and time.monotonic() - self._idle_at < POLL_S:
            return []   # asked again at once (an engine's step loop): no new look yet
        while True:
            if should_stop() or self.stop_requested():
                return []
            self._settle_mine()
            owners, done = self.owners(), self.done()
            open_ = [k for k in range(len(self.chunks)) if k not in done]
            if not open_:
                return []
            lost = self.lost(w for g, w in owners.values() if w != self.worker)
            for k in open_:
                held = owners.get(k)
                if held is None:
                    gen = 0
                elif held[1] in lost:
                    gen = held[0] + 1
                else:
                    continue
                if self._claim(k, gen):
                    rows = [i for i in self.chunks[k] if not hs_path(self._files, i).exists()]
                    if held is not None:
                        print(f"extract: {self.worker} took over chunk {k} from {held[1]}, which "
                              f"stopped ({len(rows)} of {len(self.chunks[k])} rows left)",
                              flush=True)
                    self._mine.add(k)
                    if rows:
                        return rows
                    self._settle_mine()
            if not wait:
                self._idle_at = time.monotonic()
                return []
            time.sleep(POLL_S)

    def _claim(self, k: int, gen: int) -> bool:
        path = self.folder / "claims" / f"{k}.{gen}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
        except FileExistsError:
            return False
        except PermissionError:
            # sshfs says a lost O_EXCL race this way (SFTP v3 has no "exists" status)
            if path.exists():
                return False
            raise
        with os.fdopen(fd, "w") as f:
            f.write(self.worker)
        return True

    def _settle_mine(self) -> None:
        """Mark done my chunks whose files all exist; forget those another
        worker took over (I was thought lost)."""
        if not self._mine:
            return
        owners = self.owners()
        for k in sorted(self._mine):
            if owners.get(k, (0, self.worker))[1] != self.worker:
                self._mine.discard(k)
            elif all(hs_path(self._files, i).exists() for i in self.chunks[k]):
                (self.folder / "done" / str(k)).touch()
                self._mine.discard(k)

    def finish(self) -> None:
        """The worker ends: settle what it holds, stop beating, and say so:
        a chunk it leaves unfinished is taken over at once, without waiting
        out lost_after_s."""
        if self._files is not None:
            self._settle_mine()
        self._stopped_beating.set()
        if self._beat is not None:
            self._beat.join()
        try:
            atomic_write_bytes(self.folder / "alive" / self.worker, b"exited")
        except (OSError, DiskFull):
            pass

    def start_beating(self) -> None:
        """Beat from now on (a claim starts it; a node worker whose processes
        claim under ids of their own starts it itself, or it would look lost)."""
        if self._beat is not None:
            return

        def beat():
            n = 0
            while True:
                n += 1
                try:
                    atomic_write_bytes(self.folder / "alive" / self.worker, str(n).encode())
                except (OSError, DiskFull):
                    pass   # a full or flaky disk: peers see silence, and take over
                if self._stopped_beating.wait(max(0.2, self.lost_after_s / 5)):
                    return

        self._beat = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._beat.start()

