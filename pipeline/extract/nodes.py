"""Extract across the nodes of a Slurm allocation (`[cluster] nodes` > 1):
data parallel over nodes through one shared queue of samples
(pipeline.cluster.workqueue) in the run directory.

The extract stage (on the allocation's first node, under its supervisor)
is the coordinator: it writes the queue and the job, starts one node
worker per Slurm task with `srun` (each runs the configured backend on its
node's GPUs: one vLLM server or engine per tensor-parallel group, or the
hf workers), and folds what the workers report into the stage's progress
and KV-cache events. A worker that reports an error stops them all (the
same error would hit every node); a worker that goes silent (its node
lost, its task killed) is not waited for: its unfinished chunks go back
to the queue for the others. srun runs with --kill-on-bad-exit=0 and
--no-kill, and the job with --no-kill, so one lost task or node does not end
the rest (without srun's own --no-kill, Slurm's "Node failure" killed the
step on every node: the live nodes' work with it). Then srun waits for the
lost node's task, which may never answer: once every sample is extracted
and only lost workers are left, the coordinator ends srun itself.

    python -m pipeline.extract.nodes --queue DIR    one node's worker
"""

from __future__ import annotations

import argparse
import pickle
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from pipeline.cluster.workqueue import WorkQueue, plan_chunks, worker_id
from pipeline.extract.backends import backend_runner
from pipeline.extract.job import ExtractJob
from pipeline.model.hsfile import Counters
from pipeline.run.diskspace import DiskFull
from pipeline.run.rundir import atomic_write_bytes
from pipeline.stage_error import StageError
from pipeline.vllm.kv import combine_usage

REPORT_S = 0.5     # node workers' status files, and how often the stage reads them
USAGE_S = 2.0      # one kv_usage event for all nodes at most this often (as one node's)


def run_across_nodes(job: ExtractJob, backend: str, queue_dir: Path, tasks: int,
                     lost_after_s: float, warn) -> Counters:
    """Extract `job.todo` with one worker per Slurm task; returns the
    workers' summed counters."""
    chunks = plan_chunks(job.todo, job.lengths, tasks * len(job.groups()))
    WorkQueue.create(queue_dir, chunks)
    atomic_write_bytes(queue_dir / "job.pkl", pickle.dumps(
        {"backend": backend, "job": job.shard([]), "lost_after_s": lost_after_s}))
    print(f"extract: {len(job.todo)} samples in {len(chunks)} chunks for {tasks} node "
          f"workers (srun; queue {queue_dir})", flush=True)
    argv = ["srun", f"--ntasks={tasks}", "--kill-on-bad-exit=0", "--no-kill", "--label",
            sys.executable, "-m", "pipeline.extract.nodes", "--queue", str(queue_dir)]
    proc = subprocess.Popen(argv)
    return Coordinator(job, WorkQueue(queue_dir, "coordinator", lost_after_s), warn).follow(proc)


def end_srun(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End an srun that waits only for lost tasks (their node cut off)."""
    print("extract: every sample is extracted; srun still waits for a lost node's task: "
          "ended", flush=True)
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Coordinator:
    def __init__(self, job: ExtractJob, queue: WorkQueue, warn):
        self.job, self.queue, self.warn = job, queue, warn
        self.total = Counters()
        self.kv_seen: set[tuple[str, str]] = set()
        self.servers_seen: dict[tuple[str, str], dict] = {}
        self.usage: dict[tuple[str, str], dict] = {}
        self.usage_at, self.last_usage = -USAGE_S, None
        self.said_lost: set[str] = set()
        self.error: dict | None = None

    def follow(self, proc: subprocess.Popen) -> Counters:
        job, q = self.job, self.queue
        while True:
            ended = proc.poll() is not None
            if job.should_stop() and not q.stop_requested():
                q.request_stop()
            statuses = q.statuses()
            self.read(statuses)
            if self.error and not q.stop_requested():
                q.request_stop()    # the same error would stop every node: stop them now
            if not ended and self.only_lost_left(statuses):
                end_srun(proc)
                self.read(q.statuses())   # the others' last words, written before they exited
                ended = True
            if ended:
                break
            time.sleep(REPORT_S)
        if self.error:
            e = self.error
            message = f"node worker {e['worker']}: {e['error']}"
            if e.get("disk_full"):
                raise DiskFull(job.folder, message=message)
            raise StageError(message, hint=e.get("hint") or "see the stage log (lines are "
                                                            "prefixed with the task number)")
        if job.should_stop():
            return self.total
        left = q.remaining_rows()
        if left:
            raise StageError(f"{left} samples are not extracted: every node worker ended "
                             f"(srun exit code {proc.returncode})",
                             hint="resume: finished files are kept and only the rest is done")
        return self.total

    def only_lost_left(self, statuses: dict[str, dict]) -> bool:
        """Nothing left for srun to wait for but a lost task (its node cut off):
        every sample extracted, or the workers stopped (an error, a cancel); every
        worker exited with its last status (`statuses`, this poll's) written, or
        silent for lost_after_s, and at least one silent."""
        q = self.queue
        if q.remaining_rows() and not q.stop_requested():
            return False
        workers = set(statuses) | {w for _, w in q.owners().values()}
        if not workers or not q.lost(workers) >= workers:
            return False
        exited = {w for w in workers if q.exited(w)}
        if any(statuses.get(w, {}).get("state") == "running" for w in exited):
            return False    # exited, its last status not written yet: read it first
        return bool(workers - exited)

    def read(self, statuses: dict[str, dict]) -> None:
        total = Counters()
        for w, st in sorted(statuses.items()):
            total.add(Counters(*st.get("counters", (0, 0, 0))))
            if st.get("error") and self.error is None:
                self.error = st
            for k, report in st.get("kv_cache", {}).items():
                if (w, k) not in self.kv_seen:
                    self.kv_seen.add((w, k))
                    self.job.on_event("kv_cache", {**report, "server": f"{w}/{k}"})
            for k, u in st.get("kv_usage", {}).items():
                self.usage[(w, k)] = u
            for k, ev in st.get("servers", {}).items():
                # each node's server starts, as the stage's own server events
                if self.servers_seen.get((w, k)) != ev:
                    self.servers_seen[(w, k)] = ev
                    self.job.on_event("server", {**ev, "server": f"{w}/{k}"})
        now = time.monotonic()
        if self.usage and now - self.usage_at >= USAGE_S:   # as often as one node's servers
            combined = {**combine_usage(list(self.usage.values())), "server": "all nodes"}
            if combined != self.last_usage:
                self.usage_at, self.last_usage = now, combined
                self.job.on_event("kv_usage", combined)
        self.total = total
        self.job.on_progress(total)
        holders = {w for _, w in self.queue.owners().values()} | set(statuses)
        for w in sorted(self.queue.lost(holders) - self.said_lost):
            if self.queue.exited(w):
                continue   # ended on its own (done, stopped or failed: said elsewhere)
            self.said_lost.add(w)
            self.warn(f"node worker {w} stopped reporting (lost for "
                      f"{self.queue.lost_after_s:.0f} s): its unfinished samples go back to "
                      "the queue for the other nodes")


# ---- one node's worker ------------------------------------------------------

def node_main(queue_dir: Path) -> int:
    if not (queue_dir / "job.pkl").exists():
        print(f"extract: {queue_dir} is not visible on node {worker_id()}: the run directory "
              "must be on a filesystem every node mounts ([run] runs_dir); the other nodes "
              "do this node's share", file=sys.stderr, flush=True)
        return 1
    spec = pickle.loads((queue_dir / "job.pkl").read_bytes())
    job: ExtractJob = spec["job"]
    me = worker_id()
    worker = NodeWorker(WorkQueue(queue_dir, me, spec["lost_after_s"]))
    worker.queue.start_beating()   # alive while its GPUs' processes claim under their own ids
    signal.signal(signal.SIGINT, worker.on_signal)
    signal.signal(signal.SIGTERM, worker.on_signal)
    job.todo, job.feed, job.node = [], worker.queue, me
    job.log_dir = job.log_dir / "nodes" / me
    job.log_dir.mkdir(parents=True, exist_ok=True)
    job.should_stop, job.on_progress, job.on_event = \
        worker.should_stop, worker.on_progress, worker.on_event
    code = worker.run(job, spec["backend"])
    status = worker.status
    print(f"extract: node worker {me} {status['state']}: {status['counters'][0]} samples",
          flush=True)
    return code


class NodeWorker:
    """One node's worker: its status file in the queue, kept current from
    the backend's progress and events, and the stop it watches for."""

    def __init__(self, queue: WorkQueue):
        self.queue = queue
        self.stop_flag, self.stop_checked, self.stop_file = False, 0.0, False
        self.status = {"state": "running", "counters": (0, 0, 0), "kv_cache": {},
                       "kv_usage": {}, "servers": {}}
        self.said_at = 0.0

    def on_signal(self, _signum, _frame) -> None:
        self.stop_flag = True   # scancel --signal=INT reaches every task: end like a stop

    def should_stop(self) -> bool:
        now = time.monotonic()
        if now - self.stop_checked >= REPORT_S:   # a stat on a shared filesystem: not per sample
            self.stop_checked, self.stop_file = now, self.queue.stop_requested()
        return self.stop_flag or self.stop_file

    def report(self, force: bool = False) -> None:
        if force or time.monotonic() - self.said_at >= REPORT_S:
            self.said_at = time.monotonic()
            self.queue.report(self.status)

    def on_progress(self, c: Counters) -> None:
        self.status["counters"] = c.as_tuple()
        self.report()

    def on_event(self, kind: str, fields: dict) -> None:
        status = self.status
        k = str(fields.get("server", 0))
        if kind == "server":
            before = status["servers"].get(k, {})
            status["servers"][k] = fields
            self.report(force=(before.get("phase"), before.get("done")) !=
                        (fields.get("phase"), fields.get("done")))
            return
        status["kv_cache" if kind == "kv_cache" else "kv_usage"][k] = fields
        self.report(force=kind == "kv_cache")

    def run(self, job: ExtractJob, backend: str) -> int:
        """Run the backend on this node's share; the exit code (its last
        status reported either way)."""
        status, code = self.status, 0
        try:
            done = backend_runner(backend)(job)
            status.update(counters=done.as_tuple(),
                          state="stopped" if self.should_stop() else "done")
        except (StageError, DiskFull) as e:
            status.update(state="failed", error=str(e), hint=getattr(e, "hint", None),
                          disk_full=isinstance(e, DiskFull))
            code = 1
        except BaseException as e:  # noqa: BLE001 - reported to the coordinator, then exit 1
            traceback.print_exc()
            status.update(state="failed", error=f"{type(e).__name__}: {e}")
            code = 1
        finally:
            job.finish()
        self.report(force=True)
        return code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queue", required=True, type=Path)
    sys.exit(node_main(ap.parse_args().queue))


if __name__ == "__main__":
    main()
