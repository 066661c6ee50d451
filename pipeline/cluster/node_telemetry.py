"""Every node's GPUs in the one panel: a sampler per node inside each Slurm
job writes that node's telemetry into the run directory; the panel reads
the files (it never reaches the nodes itself).

    RUN/telemetry/<host>.json   {host, seq, t, stage, job, source, banner,
                                 gpus: [GpuSample fields], host_stats: ...}

The sampler (`python -m pipeline.cluster.node_telemetry --run-dir R --stage S`,
started with `srun --overlap`, one task per node, by the batch script of a
GPU stage: pipeline.cluster.slurm) samples with the same sources and rates as the
panel (pipeline.telemetry: NVML, slow fields cached) and rewrites its file
atomically every `--interval` seconds. The job's end ends it (Slurm stops
every step of the job).

A node that stops writing is stale, never dropped: staleness is judged by
the reader's own monotonic clock (the `seq` counter has not moved for
STALE_S), so no clock of two machines is compared. A stale node is lost when
the scheduler says so too (down, not responding: Slurm's word is shown); only
a stale node is asked about, at most every LOST_CHECK_S.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.run.diskspace import DiskFull
from pipeline.run.rundir import atomic_write_json
from pipeline.telemetry import GpuSample, HostSample, Telemetry

STALE_S = 10.0
LOST_CHECK_S = 10.0
SIMULATE_ENV = "EAGLE_PANEL_SIMULATE_GPUS"   # labelled simulated GPUs (demos, tests)


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / "telemetry"


def sample_forever(run_dir: Path, stage: str, interval: float = 1.0,
                   count: int | None = None) -> None:
    out = folder(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    tele = Telemetry(simulate=int(os.environ.get(SIMULATE_ENV) or 0), disk_path=run_dir)
    seq = 0
    try:
        while count is None or seq < count:
            t0 = time.monotonic()
            snap = tele.sample()
            seq += 1
            report = {"host": host, "seq": seq, "t": snap.t, "stage": stage,
                      "job": os.environ.get("SLURM_JOB_ID"), "source": snap.source,
                      "banner": snap.banner, "gpus": [dataclasses.asdict(g) for g in snap.gpus],
                      "host_stats": dataclasses.asdict(snap.host) if snap.host else None}
            try:
                atomic_write_json(out / f"{host}.json", report)
            except (OSError, DiskFull):
                pass   # the panel shows this node as stale: the reason is the disk
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    finally:
        tele.close()


@dataclass
class NodeReport:
    host: str
    stage: str
    source: str
    gpus: list[GpuSample]
    host_stats: HostSample | None
    banner: str | None = None
    stale_s: float = 0.0          # how long its seq has not moved (0: a new sample this look)
    stale: bool = False
    job: str | None = None
    lost: str = ""                # the scheduler's word for a stale node not up ("down*")


@dataclass
class NodeWatch:
    """Reads the nodes' files; remembers when each one's seq last moved.

    A file whose stat (mtime, ctime, size, inode) is what it was at the last
    look is not read again: its report, seq included, is the one parsed then
    (a node that went quiet costs a stat, not a parse)."""
    run_dir: Path
    stale_after_s: float = STALE_S
    _seen: dict[str, tuple[int, float]] = field(default_factory=dict)
    _last: dict[str, NodeReport] = field(default_factory=dict)
    _files: dict[Path, tuple] = field(default_factory=dict)   # path -> its stat at the last parse
    _lost: dict[str, str] = field(default_factory=dict)       # host -> the scheduler's word
    _lost_asked: float = -LOST_CHECK_S

    def read(self, now: float | None = None) -> list[NodeReport]:
        now = time.monotonic() if now is None else now
        d = folder(self.run_dir)
        try:
            paths = sorted(d.glob("*.json"))
        except OSError:
            paths = []
        files = {}
        for p in paths:
            try:
                st = p.stat()
            except OSError:
                continue   # replaced or removed between the listing and now
            sig = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
            if self._files.get(p) == sig:
                files[p] = sig
                continue   # not rewritten since the last look: nothing new in it
            try:
                raw = json.loads(p.read_bytes())
            except (OSError, ValueError):
                continue   # being replaced, or cut: the last good report stays
            files[p] = sig
            host = raw.get("host") or p.stem
            seq = int(raw.get("seq", 0))
            old = self._seen.get(host)
            if old is None or old[0] != seq:
                self._seen[host] = (seq, now)
            gpus = [_gpu(g) for g in raw.get("gpus", [])]
            hs = raw.get("host_stats")
            self._last[host] = NodeReport(
                host, raw.get("stage", ""), raw.get("source", "none"), gpus,
                HostSample(**hs) if hs else None, raw.get("banner"), job=raw.get("job"))
        self._files = files
        ages = {host: now - self._seen[host][1] for host in self._last}
        self._ask_lost([h for h, age in ages.items() if age >= self.stale_after_s], now)
        # A new report each look (what was parsed is shared): a snapshot
        # already handed to the screen keeps the staleness it was read with.
        return [dataclasses.replace(rep, stale_s=ages[host], stale=ages[host] >= self.stale_after_s,
                                    lost=self._lost.get(host, "") if ages[host] >= self.stale_after_s
                                    else "")
                for host, rep in sorted(self._last.items())]

    def _ask_lost(self, stale: list[str], now: float) -> None:
        """The scheduler's word on the stale nodes (a Slurm run's: the files
        are only ever written by its jobs), at most every LOST_CHECK_S; none
        asked while every node writes."""
        if not stale or now - self._lost_asked < LOST_CHECK_S:
            return
        from pipeline.cluster import slurm
        if slurm.missing_tools() or slurm.controller_silent_s() is not None:
            self._lost_asked = now
            return   # (a silent controller: asked again after its own gate, not per look)
        found = slurm.nodes_not_up(stale)
        self._lost_asked = time.monotonic()   # after: a question that timed out is not due at once
        if found is not None:
            self._lost = found


_GPU_FIELDS = {f.name for f in dataclasses.fields(GpuSample)}


def _gpu(fields: dict) -> GpuSample:
    try:
        return GpuSample(**fields)
    except TypeError:   # a field this version does not know (a newer sampler)
        return GpuSample(**{k: v for k, v in fields.items() if k in _GPU_FIELDS})


def main() -> None:
    ap = argparse.ArgumentParser(description="write this node's GPU telemetry into a run "
                                             "directory (started in each Slurm job)")
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--stage", default="")
    ap.add_argument("--interval", type=float, default=1.0)
    a = ap.parse_args()
    try:
        sample_forever(a.run_dir, a.stage, max(Telemetry.MIN_INTERVAL, a.interval))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
