"""One `vllm serve` process, the way every stage that talks to vLLM starts
it: on loopback only, with a random API key, its GPUs (or the CPU build's
platform and KV size), its log in the run directory, health polled, its
KV-cache report and /metrics read, and its whole process tree stopped at
the end (vLLM's EngineCore and workers can outlive a killed parent and keep
their GPU memory: they are found by a token in their environment, and by
the stage's session once vLLM's process titles have erased it).

When it dies, the error quotes the log lines that explain it and names a
death by signal in words (pipeline.run.exit_reasons).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from pipeline.model.info import read_model, recurrent_bytes_per_seq
from pipeline.run import provenance
from pipeline.run.events import tail_lines
from pipeline.run.exit_reasons import explain_exit, quote_error
from pipeline.run.plans import KvPlan
from pipeline.run.proctree import TOKEN_VAR, stop_tree
from pipeline.stage_error import StageError
from pipeline.vllm import compat, contract, kv_plan, scratch, start_history
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.environment import VllmEnv, process_env
from pipeline.vllm.kv import KvLogReader, cache_config, parse_metrics
from pipeline.vllm.log_shape import VLLM
from pipeline.vllm.memory_fraction import ASSUMED
from pipeline.vllm.startup import STOPPED, StartupWatch
from pipeline.vllm.target_flags import target_flags

SERVER_TOKEN_VAR = "EAGLE_PANEL_SERVER_TOKEN"

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(python: str, serve_command: str, target: Path, port: int,
               tp: int, dtype: str, max_model_len: int, trust: bool, extra: list[str],
               eager: bool = False, target_flags: list[str] = ()) -> list[str]:
    """`vllm serve` for one server: the target's flags (target_flags), then
    `extra`, the stage's own flags (speculative / KV-transfer configs) and
    then the user's server_args. --enforce-eager (`eager`) unless `extra`
    sets a compilation of its own (the target's rope setting is not one).
    The API key is not here: a command line is readable by every user of
    the machine (`ps`), so VllmServer hands it over as VLLM_API_KEY."""
    base = shlex.split(serve_command) if serve_command else [
        python, "-m", "pipeline.vllm.launch", "serve"]
    argv = [*base, str(target), vs.FLAG_HOST, "127.0.0.1", vs.FLAG_PORT, str(port),
            vs.FLAG_TENSOR_PARALLEL, str(tp), vs.FLAG_DTYPE, dtype,
            vs.FLAG_MAX_MODEL_LEN, str(max_model_len)]
    if trust:
        argv.append(vs.FLAG_TRUST_REMOTE_CODE)
    own_compile = (vs.FLAG_ENFORCE_EAGER, vs.FLAG_OPT_LEVEL, vs.FLAG_COMPILATION_CONFIG)
    if eager and not any(a.startswith(own_compile) for a in extra):
        argv.append(vs.FLAG_ENFORCE_EAGER)
    return argv + list(target_flags) + list(extra)


def served_model_name(target: Path, server_args: list[str]) -> str:
    args = list(server_args)
    if vs.FLAG_SERVED_MODEL_NAME in args[:-1]:
        return args[args.index(vs.FLAG_SERVED_MODEL_NAME) + 1]
    return str(target)


# A process group of its own in the caller's session (Popen's process_group is
# new in Python 3.11; setpgid in the child does the same on 3.10).
OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def _dying_with_parent():
    """Popen's keywords for a child in a process group of its own that gets
    SIGTERM from the kernel when the process that started it dies
    (PR_SET_PDEATHSIG): a server owned by the driver ends with the driver,
    however the driver ends (SIGKILL included). prctl is looked up here, in
    the parent (no dlopen between fork and exec); a parent that died before
    the child set it is seen by the child's getppid, and the child exits."""
    import ctypes
    import signal
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_child() -> None:
        os.setpgrp()
        prctl(1, int(signal.SIGTERM))   # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    return {"preexec_fn": in_child}

class VllmServer:
    """One vLLM server process tree on a set of GPUs (or the CPU)."""

    shared = False   # the run's server, adopted by this stage (pipeline.extract.shared_server)

    def __init__(self, k: int, argv: list[str], port: int, api_key: str, devices: list[int],
                 log_path: Path, env: dict[str, str], what: str = "vLLM server",
                 report=None, stall_after_s: float = 600.0, die_with_parent: bool = False):
        """report(kind, fields): where its `server` events go (the stage's
        events); None: nowhere. die_with_parent: SIGTERM to it when its starter
        dies (the driver's shared server)."""
        self.die_with_parent = die_with_parent
        self.k, self.argv, self.devices, self.log_path = k, argv, devices, Path(log_path)
        self.env, self.api_key, self.what = env, api_key, what
        self.url = f"http://127.0.0.1:{port}"
        # the attempt's token inside the server's own: its processes are found by
        # the attempt's token whichever of the two a rename of theirs left readable
        # (pipeline.run.leftovers.session_processes)
        attempt = env.get(TOKEN_VAR) or os.environ.get(TOKEN_VAR)
        self.token = f"{attempt}/server{k}/{secrets.token_hex(8)}" if attempt else \
            secrets.token_hex(8)
        self.proc: subprocess.Popen | None = None
        self.ready = False    # answered /health once (wait_ready)
        self.stopped = False
        self.kv = KvLogReader()
        self.kv_reported = False
        self.kv_plan: KvPlan | None = None   # make_server's plan, reported with the allocation
        self.startup = StartupWatch(stall_after_s)
        self.report = report
        self._reported: tuple | None = None
        self._reported_at = 0.0
        self._gpu_memory = gpu_memory_reader(devices)
        self._log_pos = 0
        self.scratch: Path | None = None   # its temporary files (pipeline.vllm.scratch)

    @property
    def name(self) -> str:
        return f"{self.what} {self.k}"

    def start(self) -> None:
        # a restart starts over; the last start of this target here is the expectation
        last = start_history.last(start_history.start_key(self.argv))
        self.startup = StartupWatch(self.startup.stall_after_s,
                                    expected_s=last["elapsed_s"] if last else None)
        self._reported = None
        self.ready = self.stopped = False
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_pos = log.tell()
            print(f"{self.name} on GPUs {self.devices or '- (CPU)'}: {shlex.join(self.argv)}",
                  flush=True)
            # the key through the environment (vLLM reads VLLM_API_KEY when no
            # --api-key is given): /proc/PID/environ is readable by its owner only.
            # A process group of its own (a cancel's SIGINT to the stage's group
            # must not reach it: the stage stops it), but its starter's session
            # (the stage's; the driver's for the shared server): the supervisor, or
            # the next launch, finds it and its renamed EngineCore and workers there
            # even after a SIGKILL of its starter (pipeline.run.leftovers). It
            # carries the attempt's EAGLE_PANEL_TOKEN too (the driver's shared server:
            # the token the driver gave it).
            # The tokens go last: a process rename (setproctitle: vLLM's EngineCore and
            # workers) overwrites its environment's memory from the front, and where it
            # stops short of the end the last variables still read back.
            attempt = {TOKEN_VAR: self.env.get(TOKEN_VAR) or os.environ[TOKEN_VAR]} \
                if TOKEN_VAR in self.env or TOKEN_VAR in os.environ else {}
            rest = {k: v for k, v in self.env.items() if k != TOKEN_VAR}
            # a restart's old folder: the sweep removes it once its server is gone
            self.scratch = scratch.make(rest)
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**rest, **scratch.server_env(self.scratch, rest),
                         "VLLM_API_KEY": self.api_key, SERVER_TOKEN_VAR: self.token, **attempt},
                    **(_dying_with_parent() if self.die_with_parent else OWN_GROUP))
            except BaseException:
                scratch.remove(self.scratch)
                raise
            scratch.mark_owner(self.scratch, self.proc.pid)

    # -- its log ---------------------------------------------------------------
    def new_log_lines(self) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_pos)
                data = f.read()
        except OSError:
            return []
        cut = data.rfind(b"\n") + 1
        self._log_pos += cut
        # a line still being written (a frozen server's last words) is shown too
        self.startup.partial = data[cut:].decode(errors="replace")[-300:]
        return data[:cut].decode(errors="replace").splitlines()

    def read_log(self) -> bool:
        """Feed what the log gained to the KV-report reader and the startup
        watch; True if the start's picture changed."""
        changed = False
        for line in self.new_log_lines():
            self.kv.feed(line)
            changed |= self.startup.feed(line)
        return changed

    def report_startup(self, force: bool = False) -> None:
        """A `server` event when the phase, the shard count or being stuck
        changed, and every 10 s while it starts (its elapsed time)."""
        if self.report is None:
            return
        f = self.startup.fields()
        key = (f["phase"], f.get("done"), bool(f.get("stalled_s")))
        now = time.monotonic()
        if not force and key == self._reported and now - self._reported_at < 10.0:
            return
        self._reported, self._reported_at = key, now
        self.report("server", {**f, "server": self.k, "label": self.what,
                               "log": str(self.log_path), "devices": self.devices})

    def kv_report(self) -> dict | None:
        """The `kv_cache` event's fields, once, when the log has shown them."""
        self.read_log()
        if self.kv_reported or self.kv.event() is None:
            return None
        event = self.kv.event()
        text = self.metrics_text()
        if text is None and not self.healthy():
            return None   # the API is not up yet: /metrics adds blocks, bytes and dtype
        more = cache_config(text) if text else None
        if more:   # what /metrics adds to the log's figures (blocks, bytes, dtype)
            event.update(more, source="log+metrics")
        self.kv_reported = True
        planned = {"planned": self.kv_plan.to_json()} if self.kv_plan else {}
        return {**event, "server": self.k, "label": self.what, "devices": self.devices, **planned}

    def failure(self, what: str, hint: str) -> StageError:
        lines, _ = tail_lines(self.log_path, 300)
        quoted = quote_error([b.decode(errors="replace") for b in lines], shape=VLLM)
        return StageError(f"{self.name} {what}; from its log ({self.log_path}):\n{quoted}",
                          hint=hint)

    def died(self) -> StageError | None:
        """The error to report if the process has ended."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return self.failure(explain_exit(self.proc.returncode),
                            "fix what the log says (model path, memory, vLLM version: "
                            "`eagle-panel doctor`), then resume; finished work is kept")

    # -- HTTP ---------------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + vs.ROUTE_HEALTH, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float, should_stop, poll=None) -> None:
        deadline = time.monotonic() + timeout
        self.read_log()
        self.report_startup(force=True)
        while not self.healthy():
            self.read_log()
            if self._gpu_memory is not None:
                self.startup.memory(self._gpu_memory())
            self.report_startup()
            if poll:
                poll()
            err = self.died()
            if err is not None:
                raise self.failure(f"{explain_exit(self.proc.returncode)} while starting",
                                   err.hint)
            if should_stop():
                return
            if time.monotonic() > deadline:
                raise self.failure(f"did not answer /health within {timeout:.0f} s",
                                   "raise startup_timeout_s for a very large model")
            time.sleep(0.5)
        self.read_log()
        self.startup.ready()
        self.report_startup(force=True)
        self.ready = True
        start_history.record(start_history.start_key(self.argv), self.startup.elapsed_s(),
                             self.startup.phase_times)

    def post(self, path: str, body: dict, timeout: float) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json",
                     "Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body.strip() else {}   # (some routes answer 200 alone)

    def metrics_text(self) -> str | None:
        try:
            with urllib.request.urlopen(self.url + vs.ROUTE_METRICS, timeout=5) as r:
                return r.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            return None

    def usage(self) -> dict | None:
        """The `kv_usage` event's fields from /metrics, with the server's number."""
        text = self.metrics_text()
        parsed = parse_metrics(text) if text else None
        return {**parsed, "server": self.k} if parsed else None

    def stop(self, grace: float = 10.0) -> list[int]:
        """Stop the whole tree (once); returns pids that survived SIGKILL."""
        if self.proc is None or self.stopped:
            return []
        self.stopped = True
        folder = self.scratch   # this server's, whatever a restart in another thread makes
        if self.report is not None:
            self.report("server", {"phase": STOPPED, "server": self.k, "label": self.what,
                                   "elapsed_s": 0.0, "phase_s": 0.0, "last_line": "",
                                   "log": str(self.log_path), "devices": self.devices})
        left = stop_tree(self.token, self.proc.pid, term_grace=grace, kill_grace=5.0,
                         var=SERVER_TOKEN_VAR)
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        if not left:   # a survivor may still use it: the next start's sweep removes it
            scratch.remove(folder)
        return left


def server_log(stage_dir: Path, k: int) -> Path:
    """Where server k of a stage logs: one naming for every stage (the
    panel's Logs tab and `eagle-panel logs --server K` find them here)."""
    return Path(stage_dir) / f"vllm-{k}.log"


def gpu_memory_reader(devices: list[int]):
    """A function giving the memory its GPUs hold (NVML), or None on the CPU
    or without a driver: a load that fills GPU memory is alive even when
    its log is quiet."""
    if not devices:
        return None
    try:
        from pipeline.telemetry import NvmlSource
        src = NvmlSource()
    except Exception:  # noqa: BLE001 - no library, no driver: the log alone says
        return None

    def used():
        return tuple(g.mem_used for g in src.sample() if g.index in devices)
    return used


def serve_args(env: VllmEnv, target: Path, devices: list[int], dtype: str, max_model_len: int,
               trust: bool, flags: list[str], serve_command: str = "", port: int = 0,
               fired: bool = False) -> tuple[list[str], int]:
    """(the server's whole command line, how many of its words come before
    the model): what every stage starts and what vLLM's own validation
    (pipeline.vllm.validation) checks — the target's flags, then the stage's
    `flags`, tensor parallel over its GPUs. `fired`: the target's flags are
    adaptations this process applies (recorded in provenance)."""
    needs = target_flags(target, env.cpu_build, env.source())
    if fired:
        for t in needs:
            compat.fired(t.key, t.detail)
    argv = serve_argv(env.python, serve_command, target, port, max(1, len(devices)), dtype,
                      max_model_len, trust, list(flags), eager=env.cpu_build,
                      target_flags=[f for t in needs for f in t.flags])
    return argv, argv.index(str(target))


def make_server(k: int, env: VllmEnv, target: Path, devices: list[int], log_path: Path,
                dtype: str, max_model_len: int, trust: bool, flags: list[str],
                serve_command: str = "", kv_tokens: int = 0, kv_bytes_per_token: int = 0,
                what: str = "vLLM server", report=None,
                stall_after_s: float = 600.0, extra_env: dict | None = None,
                die_with_parent: bool = False) -> VllmServer:
    """A server (not started) the way every stage starts one: the stage's
    own `flags` then the user's server_args in them; tensor parallel over
    its GPUs; on the CPU build a KV space for `kv_tokens` tokens in flight
    (whole requests of `max_model_len`) at `kv_bytes_per_token`. Its KV plan
    (`server.kv_plan`) goes out with what vLLM allocates."""
    port, key = free_port(), secrets.token_hex(16)
    argv, _ = serve_args(env, target, devices, dtype, max_model_len, trust, flags,
                         serve_command, port, fired=True)
    plan = server_kv_plan(env, target, devices, dtype, max_model_len, flags, kv_tokens,
                          kv_bytes_per_token, extra_env or {})
    provenance.note_server(argv, env.version, env.dist, env.python)
    server = VllmServer(k, argv, port, key, devices, log_path,
                        {**process_env(env, devices, plan.space_gib if plan else None),
                         **(extra_env or {})}, what, report, stall_after_s, die_with_parent)
    server.kv_plan = plan
    return server


def server_kv_plan(env: VllmEnv, target: Path, devices: list[int], dtype: str, max_len: int,
                   flags: list[str], kv_tokens: int, per_token: int,
                   extra_env: dict) -> KvPlan | None:
    """The server's KV cache as planned (pipeline.vllm.kv_plan): on the CPU
    build the space it is given — the user's VLLM_CPU_KVCACHE_SPACE where
    one is set, which the server keeps; on GPUs what its share of the
    smallest one should leave after the weights. None: nothing to plan with."""
    if not per_token:
        return None
    elem = 4 if dtype == "float32" else 2
    tp = max(1, len(devices))
    try:
        m = read_model(target)
        per_seq, weights = recurrent_bytes_per_seq(m, tp, elem), m.weights_bytes
    except (OSError, ValueError, KeyError):   # a target config.json cannot say: plan without
        per_seq, weights = 0, None
    if env.cpu_build:
        if not kv_tokens:
            return None
        plan = kv_plan.cpu_plan(max(1, -(-kv_tokens // max_len)), max_len, per_token, per_seq)
        user = extra_env.get(contract.ENV_CPU_KV_SPACE) or os.environ.get(contract.ENV_CPU_KV_SPACE)
        return kv_plan.with_space(plan, user) if user else plan
    try:
        util, why = kv_plan.server_util(flags, env.source(), "the server's flags")
    except (OSError, SyntaxError, ValueError, TypeError) as e:   # a source unread: a forecast
        util, why = ASSUMED, f"vLLM's default assumed: its source unread ({e})"   # not a start
    return kv_plan.gpu_plan(tp, max_len, per_token, per_seq, gpu_memory(devices), util, why,
                            weights)


def gpu_memory(devices: list[int]) -> int | None:
    """The smallest of `devices`' memory (NVML); None without a driver."""
    try:
        from pipeline.telemetry import NvmlSource
        src = NvmlSource()
    except Exception:  # noqa: BLE001 - no library, no driver: no figure to plan with
        return None
    try:
        sizes = [g["memory_total"] for g in src.inventory() if g["index"] in devices]
    except Exception:  # noqa: BLE001 - a GPU lost, a call the driver lacks: the plan is a
        return None   # forecast, never a reason for the server not to start
    finally:
        src.close()
    return min(sizes) if sizes else None


def bring_up(server: VllmServer, startup_timeout: float, should_stop, poll=None) -> None:
    """Start the server (unless it was started ahead) and wait until it
    answers; what it allocated goes out as the stage's kv_cache event. The
    caller stops it (`serving` does, however its block ends)."""
    if server.proc is None:
        server.start()
    if not server.ready:
        server.wait_ready(startup_timeout, should_stop, poll)
    kv = server.kv_report()
    if kv is not None and server.report is not None:
        server.report("kv_cache", kv)


@contextmanager
def serving(server: VllmServer, startup_timeout: float, should_stop, term_grace: float = 10.0,
            poll=None):
    """Start the server (unless it was started ahead), wait until it answers,
    yield it; its whole process tree is stopped however the block ends."""
    try:
        bring_up(server, startup_timeout, should_stop, poll)
        yield server
    finally:
        left = server.stop(grace=term_grace)
        if left:
            print(f"{server.name}: processes {left} survived SIGKILL", flush=True)
