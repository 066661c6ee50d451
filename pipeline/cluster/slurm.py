"""Stages as Slurm jobs: `[cluster] scheduler = "slurm"`.

A stage attempt is one batch job whose only command is our supervisor, so
everything the supervisor does locally (pid, exit code, events, stopping
leftovers) happens inside the job and lands in the run directory exactly as
on one machine; `status`, `logs`, resume and the panel read it as always.
What only the scheduler knows comes from it: whether the job is still
pending or running (`squeue`), and why it ended when the supervisor could
not say (`scontrol show job` while Slurm remembers the job, `sacct` where
accounting is set up): cancelled, timed out, preempted, node failure. A job
that ended any of those ways is a stage gone without recording its exit:
resumable like a killed stage.

With `[cluster] nodes` > 1, extract and train jobs get one task per node
(--no-kill: a lost node does not end the job); the stage spreads itself
over them with srun (pipeline.extract.nodes, torchrun). Every GPU
stage's job also runs a sampler step per node (pipeline.cluster.node_telemetry).

Liveness is asked often (every refresh), so answers are cached for a
second; a scheduler that does not answer counts as "still alive" (a slow
slurmctld must not fail a running stage). `SlurmScheduler` is this module
as pipeline.run.executor's `Scheduler`: run/ asks and acts only through
that interface (it never imports cluster/); pipeline.control registers it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.run.events import EventWriter
from pipeline.run.executor import ALIVE, GONE, Scheduler, SchedulerError
from pipeline.run.rundir import RunDir

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
          "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
TOOLS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo")
CACHE_S = 1.0
# While slurmctld does not answer, each question costs its MessageTimeout (10 s by
# default) before failing: ask again only this often, and answer "no verdict" between.
SILENT_RETRY_S = 15.0
_cache: dict[str, tuple[float, JobState | None]] = {}
_silence: dict[str, float | None] = {"since": None, "asked": 0.0}


class SlurmError(SchedulerError):
    """The scheduler refused or is not there: said before anything is submitted."""


@dataclass(frozen=True)
class JobState:
    state: str            # Slurm's word: PENDING, RUNNING, COMPLETED, TIMEOUT, ...
    reason: str = ""      # why pending, or how it ended (exit code, node)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def describe(self, job: str) -> str:
        return f"Slurm job {job} {self.state.lower()}" + (f" ({self.reason})" if self.reason else "")


# A question to slurmctld that has no answer by then has none: the client tools
# retry a controller that does not answer for 30 s and more (measured: squeue 35 s
# at MessageTimeout=5), and `status` or the panel must not wait that long.
QUERY_TIMEOUT_S = 10.0
CANCEL_TIMEOUT_S = 30.0   # a cancel is an action, not a question: waited for longer


def _run(argv: list[str], timeout: float = QUERY_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def preflight(cluster, runs_dir: Path | None = None) -> None:
    """Refuse, with the fix, before anything is submitted."""
    if runs_dir is not None and cluster.nodes > 1 and fs_type(runs_dir) == "tmpfs":
        raise SlurmError(f"[cluster] nodes = {cluster.nodes}, but the runs directory {runs_dir} "
                         "is on tmpfs, which every node has its own of: the other nodes would "
                         "not see the run. Set [run] runs_dir to a filesystem every node mounts "
                         "(NFS, Lustre, GPFS, BeeGFS, ...).")
    missing = missing_tools()
    if missing:
        raise SlurmError(f'[cluster] scheduler = "slurm", but {", ".join(missing)} is not on '
                         "PATH here. Run eagle-panel on a node with the Slurm client tools, or "
                         'set [cluster] scheduler = "local".')
    try:
        r = _run(["sinfo", "-h", "-o", "%R|%a"])
    except subprocess.TimeoutExpired:
        raise SlurmError(f"slurmctld did not answer sinfo within {QUERY_TIMEOUT_S:.0f} s: "
                         "nothing was submitted. Is the controller up and reachable from "
                         "here (`scontrol ping`)?") from None
    if r.returncode:
        raise SlurmError(f"sinfo failed: {(r.stderr or r.stdout).strip()[:300]}. "
                         "Is slurmctld up and this node part of the cluster?")
    parts = dict(line.split("|", 1) for line in r.stdout.split() if "|" in line)
    if cluster.partition and cluster.partition not in parts:
        raise SlurmError(f"[cluster] partition = {cluster.partition!r} does not exist; this "
                         f"cluster has {', '.join(sorted(parts)) or 'no partitions'}. Fix "
                         "`cluster.partition`.")
    if cluster.partition and parts.get(cluster.partition) != "up":
        raise SlurmError(f"partition {cluster.partition!r} is {parts[cluster.partition]}: "
                         "jobs would wait there. Pick another `cluster.partition`.")


# The stages that spread over `[cluster] nodes`: extract (one worker per node,
# pipeline.extract.nodes) and train (torchrun over the nodes).
MULTI_NODE_STAGES = ("extract", "train")


def job_nodes(cluster, up: int | None) -> int:
    """The nodes a multi-node job asks for: `nodes`; with `min_nodes` below it,
    as many of the partition's nodes as are up (`up`; None: unknown), never
    fewer than `min_nodes` (a resume after a lost node runs on the nodes left).
    An exact count, not sbatch's MIN-MAX range: a range may start a job on
    fewer nodes while one is briefly busy (seen: 1 of 2 idle nodes)."""
    if not 0 < cluster.min_nodes < cluster.nodes or up is None:
        return cluster.nodes
    return max(cluster.min_nodes, min(cluster.nodes, up))


def nodes_up(partition: str) -> tuple[int, list[str]] | None:
    """(how many of the partition's nodes can take a job, "n1 down*" for each
    that cannot); None when the controller does not answer."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %T"] + ([f"--partition={partition}"] if partition else [])
    try:
        r = _run(argv, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode:
        return None
    states = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
    down = sorted(f"{n} {st}" for n, st in states.items() if not takes_jobs(st))
    return len(states) - len(down), down


def takes_jobs(state: str) -> bool:
    """Whether a node in sinfo's state `state` can run a job: a trailing `*` is
    a node not responding; the other flags (`~` powered down, `#` powering up,
    `%`, `+`, `-`, `$`, `@`, `^`, `!`) leave its base state (idle, mixed, ...)."""
    if state.endswith("*"):
        return False
    return state.rstrip("~#%+-$@^!") in {"idle", "mixed", "allocated", "completing", "planned"}


def sbatch_argv(cluster, stage: str, run_id: str, log: Path, workdir: Path,
                gpu_stage: bool, nodes: int | None = None) -> list[str]:
    argv = ["sbatch", "--parsable", f"--job-name=ep-{run_id}-{stage}", f"--output={log}",
            "--open-mode=append", f"--chdir={workdir}"]
    if cluster.nodes > 1 and stage in MULTI_NODE_STAGES:
        # One task per node; a failed node does not end the job: the others
        # take over its samples (extract), or the stage resumes (train).
        argv += [f"--nodes={nodes or cluster.nodes}", "--ntasks-per-node=1", "--no-kill"]
    else:
        argv += ["--nodes=1", "--ntasks=1"]
    if cluster.partition:
        argv.append(f"--partition={cluster.partition}")
    if cluster.account:
        argv.append(f"--account={cluster.account}")
    if cluster.time_limit:
        argv.append(f"--time={cluster.time_limit}")
    if gpu_stage and cluster.gpus_per_node:
        argv.append(f"--gpus-per-node={cluster.gpus_per_node}")
    return argv + list(cluster.sbatch_args)


def submit(cluster, stage: str, run_id: str, log: Path, workdir: Path, gpu_stage: bool,
           command: list[str], script: Path, env: dict[str, str]) -> tuple[str, str]:
    """Write the batch script (kept beside the stage's log) and submit it;
    returns the job id and a note for the user ("" or why it asks for fewer
    nodes). The job gets the stage's environment (sbatch exports it), so it
    runs exactly what a local launch would."""
    nodes, note = None, ""
    if cluster.nodes > 1 and stage in MULTI_NODE_STAGES and 0 < cluster.min_nodes < cluster.nodes:
        seen = nodes_up(cluster.partition)
        nodes = job_nodes(cluster, seen[0] if seen else None)
        if seen and nodes < cluster.nodes:
            note = (f"{len(seen[1])} of the partition's nodes cannot take a job "
                    f"({', '.join(seen[1])}): the {stage} job asks for {nodes} of [cluster] "
                    f"nodes = {cluster.nodes} (min_nodes = {cluster.min_nodes})")
    argv = sbatch_argv(cluster, stage, run_id, log, workdir, gpu_stage, nodes)
    text = ("#!/bin/sh\n# written by eagle-panel; submitted with:\n# " + shlex.join(argv) + "\n")
    if gpu_stage:
        # Each node's GPUs into the run directory for the panel
        # (pipeline.cluster.node_telemetry); a step beside the stage's, ended with the job.
        text += ('srun --ntasks="${SLURM_JOB_NUM_NODES:-1}" '
                 + shlex.join(["--overlap", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                               "--output=/dev/null", command[0], "-m", "pipeline.cluster.node_telemetry",
                               "--run-dir", str(workdir), "--stage", stage]) + " &\n")
    script.write_text(text + "exec " + shlex.join(command) + "\n")
    script.chmod(0o700)
    r = subprocess.run([*argv, str(script)], capture_output=True, text=True, env=env, timeout=60,
                       check=False)
    if r.returncode:
        raise SlurmError(f"sbatch refused the {stage} job: {(r.stderr or r.stdout).strip()[:400]}")
    return r.stdout.strip().split(";")[0], note


def job_state(job: str, fresh: bool = False) -> JobState | None:
    """The job's state, or None when the scheduler could not be asked."""
    now = time.monotonic()
    hit = _cache.get(job)
    if hit and not fresh and now - hit[0] < CACHE_S:
        return hit[1]
    if not fresh and _silence["since"] is not None and now - _silence["asked"] < SILENT_RETRY_S:
        return None
    state = _ask(job)
    answered = time.monotonic()   # a silent controller's question takes QUERY_TIMEOUT_S
    _silence["asked"] = answered
    _silence["since"] = (_silence["since"] or now) if state is None else None
    _cache[job] = (answered, state)
    return state


def controller_silent_s() -> float | None:
    """How long slurmctld has not answered this process (None: it answers)."""
    since = _silence["since"]
    return None if since is None else time.monotonic() - since


def silence_text() -> str:
    """The controller's silence in words, "" while it answers."""
    silent = controller_silent_s()
    if silent is None:
        return ""
    return (f"Slurm controller not answering for {silent:.0f} s: the stage is taken to be "
            f"alive (no verdict without it); asked again every {SILENT_RETRY_S:.0f} s")


def _ask(job: str) -> JobState | None:
    try:
        r = _run(["squeue", "-h", "-j", job, "-o", "%T|%r"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode == 0 and r.stdout.strip():
        state, _, reason = r.stdout.strip().splitlines()[0].partition("|")
        return JobState(state, "" if reason in ("None", "(null)") else reason)
    if r.returncode and not _forgotten(r):
        return None   # slurmctld did not answer: no verdict
    # Gone from the queue (squeue also fails for an id it forgot): how it ended.
    try:
        r = _run(["scontrol", "-o", "show", "job", job])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode and not _forgotten(r):
        return None
    if r.returncode == 0 and "JobState=" in r.stdout:
        f = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
        why = [f"exit {f['ExitCode']}" if f.get("ExitCode") not in (None, "0:0") else "",
               f.get("Reason", "") if f.get("Reason") not in (None, "None") else ""]
        return JobState(f["JobState"], ", ".join(w for w in why if w))
    try:
        r = _run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,ExitCode"])
    except (OSError, subprocess.TimeoutExpired):
        r = None
    if r is not None and r.returncode == 0 and r.stdout.strip():
        state, _, code = r.stdout.strip().splitlines()[0].partition("|")
        return JobState(state.split()[0], f"exit {code}" if code not in ("", "0:0") else "")
    return JobState("GONE", "the scheduler no longer knows this job")


def _forgotten(r: subprocess.CompletedProcess) -> bool:
    """The controller answered, and does not know the job (any more)."""
    return "Invalid job id" in (r.stderr + r.stdout)


def cancel(job: str, signal: str | None = None) -> None:
    """scancel the job; with a signal, to the batch script and every
    process of the job (--full), so the stage gets it as on one machine."""
    argv = ["scancel", job] if signal is None else ["scancel", f"--signal={signal}", "--full", job]
    try:
        _run(argv, timeout=CANCEL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        # a controller that does not answer: the job is reported as still there
        print(f"scancel {job}: no answer ({type(e).__name__})", flush=True)
    _cache.pop(job, None)


class SlurmScheduler(Scheduler):
    """Stage attempts as Slurm batch jobs, for pipeline.run's driver and readers."""

    name, title = "slurm", "Slurm"

    def job_liveness(self, job: str) -> str:
        """Its processes are on a compute node: the scheduler knows; when it
        cannot be asked, the stage is taken to be alive (never failed for that)."""
        state = job_state(job)
        return ALIVE if state is None or state.active else GONE

    def describe(self, st: dict) -> str:
        if not st.get("slurm_job"):
            return ""
        state = job_state(st["slurm_job"])
        return state.describe(st["slurm_job"]) if state else silence_text()

    def submit(self, cfg, rd: RunDir, stage: str, attempt: int, gpu_stage: bool,
               command: list[str], env: dict[str, str]) -> str:
        """The batch script beside the stage's log (slurm-ATTEMPT.sh), submitted;
        a job asking for fewer nodes than `[cluster] nodes` is the stage's warning."""
        job, note = submit(cfg.cluster, stage, rd.id, rd.log_path(stage), rd.path, gpu_stage,
                           command, rd.stage_dir(stage) / f"slurm-{attempt}.sh", env)
        if note:
            with EventWriter(rd.events_path(stage)) as events:
                events.warning(note, hint="once the node is back, the next job asks for all "
                                          "`nodes` again")
        return job

    def job_gone(self, job: str) -> bool:
        state = job_state(job, fresh=True)
        return state is not None and not state.active

    def cancel(self, job: str, signal: str | None = None) -> None:
        cancel(job, signal)


def allocation_tasks() -> int:
    """Tasks of the Slurm allocation this process runs in (0: not in one)."""
    if not os.environ.get("SLURM_JOB_ID"):
        return 0
    return int(os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NNODES") or 0)


def nodes_not_up(nodes: list[str] | str) -> dict[str, str] | None:
    """Of these nodes (names, or a Slurm hostlist), those Slurm does not count
    as up, each with its word for it ("down* (Not responding)"); None when the
    controller does not answer. `*` after a state: the node does not respond."""
    nodelist = nodes if isinstance(nodes, str) else ",".join(nodes)
    if not nodelist:
        return {}
    try:
        r = _run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%T|%E"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode:
        return None
    out = {}
    for line in r.stdout.splitlines():
        node, _, rest = line.partition("|")
        state, _, why = rest.partition("|")
        if not takes_jobs(state):
            why = why if why and why != "none" else "not responding" if state.endswith("*") else ""
            out[node] = state + (f" ({why})" if why else "")
    return out


def allocation_nodes_down() -> str:
    """What Slurm says of this allocation's nodes that are not up ("Slurm: node
    n1 down* (Not responding)"), asked from inside the job; "" when all are
    up, or outside a job, or the controller does not answer."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    bad = nodes_not_up(nodelist) if nodelist else None
    return ("Slurm: " + ", ".join(f"node {n} {why}" for n, why in sorted(bad.items()))
            if bad else "")


def rendezvous(port_base: int = 29500) -> str:
    """host:port where torchrun's agents meet: the allocation's first node,
    a port from the job id (two jobs on one node do not collide)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    r = _run(["scontrol", "show", "hostnames", nodelist]) if nodelist else None
    hosts = r.stdout.split() if r is not None and r.returncode == 0 else []
    head = hosts[0] if hosts else socket.gethostname()
    return f"{head}:{port_base + int(os.environ.get('SLURM_JOB_ID', '0')) % 2000}"


def fs_type(path: Path) -> str:
    """The filesystem type of `path` (or of its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return _run(["stat", "-f", "-c", "%T", str(path)]).stdout.strip()
    except OSError:
        return ""


def shared_filesystem_note(path: Path) -> str | None:
    """A warning when the run directory looks node-local (other nodes would
    not see the stages' outputs), from the filesystem type."""
    kind = fs_type(path)
    local = {"tmpfs", "ext2/ext3", "ext4", "xfs", "btrfs", "overlayfs", "zfs"}
    if kind in local:
        return (f"{path} is on a {kind} filesystem: if that is local to this node, the jobs on "
                "other nodes cannot see the run. Put [run] runs_dir on a shared filesystem "
                "(NFS, Lustre, GPFS, BeeGFS, ...).")
    return None
