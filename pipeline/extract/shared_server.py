"""Regenerate and extract on one vLLM server: one target load instead of two.

Design note. On a trillion-parameter target a server start is the expensive
thing (10-20 minutes of loading on 8 GPUs). When a run regenerates its answers
and then extracts, both stages can use one server: extract's, which captures
hidden states (`extract_hidden_states` and the project's connector) and also
generates. What that costs is measured, not assumed (bench/target_loads.py
`--regenerate`): every decode step on a capture server goes through the
speculative verify path (2 tokens a step, the draft being the token just
sampled) and copies the aux hidden states aside, so generation is slower there:
1.37x and 1.52x on vLLM's CPU build (tiny target, 48 and 96 conversations,
greedy, the same tokens both ways; 1.94x before regenerate's requests told the
connector to save nothing). It pays while regeneration takes less than one
start / 0.5 (here ~50 s of generation against a 27 s start; on a target that
loads in 15 minutes, ~30 minutes); a regeneration of hours does not. So it is
asked for (`[stages.regenerate] share_server = true`; the demo's config.toml
does), and doctor counts the loads either way.

Who owns it: the driver (a run-level service, registered by pipeline.control:
run/ imports nothing above it). It starts the server before regenerate with
extract's capture flags and regenerate's longer max_model_len, writes where it
is (`<run>/shared-server/endpoint.json`, the API key beside it, 0600), stops it
once extract has ended and, however the driver ends, in its `finally`. A
driver killed outright takes it along: the server gets SIGTERM from the kernel
when the driver dies (PR_SET_PDEATHSIG), and what of it outlives that is the
next launch's to sweep: the record `state["shared_server"]` names the driver as
its supervisor (pipeline.run.leftovers finds it by its token and the driver's
session).

The stages adopt it (`adopt`): an AdoptedServer is a VllmServer whose start
and stop are the driver's. Each stage checks the server is the one it would
start (extract: the same capture flags; regenerate: room for its answers) and
otherwise starts its own, saying why. Regenerate's requests carry
compat.SKIP_KEY (the connector writes no file for them); extract's carry a cache salt
of their own: regenerate's prompt + answer is extract's row, token for token,
and without the salt a prefix it left in the cache would be read back
(computed while decoding) instead of extract's own prefill.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from pipeline.run.proctree import TOKEN_VAR
from pipeline.run.rundir import RunDir, atomic_write_json
from pipeline.stage_error import StageError
from pipeline.vllm import compat

ENV = "EAGLE_PANEL_SHARED_SERVER"   # a stage's environment: the endpoint file to adopt
FOLDER = "shared-server"


def why_not(cfg) -> str | None:
    """Why this config does not share a server between regenerate and extract
    (None: it does, where the installed vLLM allows it: `plan`)."""
    rg, ex = cfg.stages.regenerate, cfg.stages.extract
    if not rg.share_server:
        return "[stages.regenerate] share_server = false"
    reasons = [
        (not cfg.enabled("regenerate"), "regenerate is off"),
        (not cfg.enabled("extract"), "extract is off"),
        (cfg.cluster.scheduler != "local", "the stages are Slurm jobs (each on its node)"),
        (ex.backend not in ("auto", "vllm-server"), f"extract's backend is {ex.backend!r}"),
        (cfg.stage_devices("regenerate") != cfg.stage_devices("extract"),
         "regenerate and extract are given other GPUs ([gpus])"),
        (len(cfg.stage_devices("extract")) > max(1, ex.tensor_parallel),
         "extract runs several servers (data parallel): one would serve regenerate"),
        (list(rg.server_args) != list(ex.server_args) or rg.serve_command != ex.serve_command,
         "regenerate's and extract's server_args / serve_command differ"),
        (dict(rg.env) != dict(ex.env), "regenerate's and extract's [stages.*] env differ"),
    ]
    return next((why for bad, why in reasons if bad), None)


def capture_flags(cfg, storage: Path, own_connector: bool = True) -> tuple[list[str], int, int]:
    """(the flags extract's server gets, built by the function extract's own
    servers are built with, writing to `storage`; its max_model_len as
    regenerate needs it, which covers extract's rows: prepare cuts them at
    seq_length; the layers captured)."""
    from pipeline.extract.server_flags import extraction_flags
    from pipeline.model.info import read_model, validate_layer_ids
    m = read_model(cfg.target_path())
    layer_ids = validate_layer_ids(list(cfg.stages.extract.layer_ids), m.layers)
    flags = extraction_flags(layer_ids, storage, own_connector,
                             cfg.stages.extract.hidden_states_dtype == "fp8",
                             "linear" in m.kinds)
    return flags + list(cfg.stages.extract.server_args), regenerate_max_len(cfg), len(layer_ids)


def regenerate_max_len(cfg) -> int:
    """The longest request regenerate sends: a prompt prepare keeps (seq_length)
    and an answer (max_tokens), + 8; extract's rows, cut at seq_length, fit too."""
    return cfg.stages.prepare.seq_length + cfg.stages.regenerate.max_tokens + 8


def kv_sizing(cfg, m, captured: int) -> tuple[int, int, int]:
    """(requests in flight, the longest request, KV bytes a token) the shared
    server is sized for (and doctor plans with): the more of the two stages'
    requests; the captured hidden states (`captured` layers) take their room
    beside K and V (vLLM's HiddenStateCacheSpec)."""
    from pipeline.vllm.kv_plan import extraction_bytes_per_token
    devices = cfg.stage_devices("extract")
    elem = 4 if cfg.dtype_name(bool(devices)) == "float32" else 2
    per_token = extraction_bytes_per_token(m, max(1, len(devices)), elem, captured)
    requests = max(cfg.stages.regenerate.concurrency, cfg.stages.extract.max_inflight)
    return requests, regenerate_max_len(cfg), per_token


class SharedServer:
    """The driver's: started before regenerate, stopped after extract."""

    def __init__(self, run: RunDir, cfg, env):
        self.env = env
        from pipeline.model.info import read_model
        from pipeline.vllm.server import make_server, server_log
        self.run, self.cfg = run, cfg
        self.folder = run.path / FOLDER
        devices = cfg.stage_devices("extract")
        self.flags, max_len, captured = capture_flags(cfg, run.out_dir("extract") / "hidden_states")
        ex = cfg.stages.extract
        requests, _, per_token = kv_sizing(cfg, read_model(cfg.target_path()), captured)
        self.token = f"{run.id}/shared-server/{secrets.token_hex(4)}"
        self.server = make_server(0, env, cfg.target_path(), devices,
                                  server_log(self.folder, 0), cfg.dtype_name(bool(devices)),
                                  max_len, cfg.model.trust_remote_code, self.flags,
                                  ex.serve_command, requests * max_len, per_token,
                                  what="vLLM server (regenerate + extract)",
                                  stall_after_s=ex.stall_after_s,
                                  # the stages' own environment, as a stage's server gets it
                                  extra_env={**cfg.runtime.env, **ex.env, TOKEN_VAR: self.token},
                                  die_with_parent=True)
        self.max_len = max_len

    def start(self) -> None:
        """The server's process started (its load goes on while regenerate
        adopts it and reports the start), and where it is written down."""
        from pipeline.run.rundir import proc_start_ticks
        self.folder.mkdir(parents=True, exist_ok=True)
        key = self.folder / "key"
        key.unlink(missing_ok=True)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.server.api_key)
        with self.run.mutate_state() as state:
            state["shared_server"] = {
                "token": self.token, "status": "running", "started_at": time.time(),
                "supervisor_pid": os.getpid(),
                "supervisor_create_time": proc_start_ticks(os.getpid())}
        self.server.start()
        atomic_write_json(self.folder / "endpoint.json", {
            "url": self.server.url, "pid": self.server.proc.pid,
            "create_time": proc_start_ticks(self.server.proc.pid),
            "log": str(self.server.log_path), "flags": self.flags, "max_model_len": self.max_len,
            "argv": self.server.argv, "devices": self.server.devices,
            "vllm": {"version": self.env.version, "dist": self.env.dist,
                     "python": self.env.python},
            # what make_server adapted for the target (in this process): the
            # stages that adopt the server report them as their own
            "adaptations": compat.fired_so_far(),
            # its KV plan, which the adopting stages report with the allocation
            "kv_plan": self.server.kv_plan.to_json() if self.server.kv_plan else None})

    def stop(self, grace: float) -> None:
        """The server's whole tree stopped; its endpoint and record gone."""
        left = self.server.stop(grace=grace)
        if left:
            print(f"shared server: processes {left} survived SIGKILL", flush=True)
        for name in ("endpoint.json", "key"):
            (self.folder / name).unlink(missing_ok=True)
        with self.run.mutate_state() as state:
            if state.get("shared_server"):
                state["shared_server"] = dict(state["shared_server"], status="stopped",
                                              ended_at=time.time())


class Service:
    """The driver's run-level service (pipeline.drive.driver.SERVICES): the
    shared server while regenerate and extract both run."""

    def __init__(self):
        self.server: SharedServer | None = None

    def begin(self, run: RunDir, cfg, steps) -> None:
        planned = {s.stage for s in steps if s.action == "run"}
        why = why_not(cfg)
        if why is None and not {"regenerate", "extract"} <= planned:
            why = "regenerate and extract do not both run this time"
        env = None
        if why is None:
            from pipeline.vllm.environment import probe
            env = probe(cfg.vllm_python())
            why = _vllm_refuses(cfg, env)
        if why is not None:
            if cfg.stages.regenerate.share_server:
                print(f"shared server: not started ({why}): each stage starts its own",
                      flush=True)
            return
        self.server = SharedServer(run, cfg, env)
        self.server.start()
        print(f"shared server: started for regenerate and extract ({self.server.server.url})",
              flush=True)

    def env(self, stage: str) -> dict[str, str]:
        if self.server is None or stage not in ("regenerate", "extract"):
            return {}
        return {ENV: str(self.server.folder / "endpoint.json")}

    def after(self, stage: str, term_grace: float) -> None:
        if stage == "extract":
            self.close(term_grace)

    def close(self, term_grace: float) -> None:
        if self.server is not None:
            self.server.stop(term_grace)
            self.server = None


def _vllm_refuses(cfg, env) -> str | None:
    """What the installed vLLM (`env`) lacks for sharing: a usable interpreter
    for extract's GPUs, the vllm-server backend, and the project's connector
    (0.29+, which also answers requests' `cache_salt`, vLLM 0.9+)."""
    from pipeline.model.info import read_model
    from pipeline.vllm import compat
    from pipeline.vllm.environment import choose_backend
    from pipeline.vllm.source import VllmSource
    devices = cfg.stage_devices("extract")
    problem = env.unusable(devices)
    if problem:
        return problem
    from pipeline.vllm.validation import model_refused
    backend, why = choose_backend(cfg.stages.extract.backend, env, devices,
                                  read_model(cfg.target_path()), cfg.dtype_name(bool(devices)),
                                  model_refused(env.python, cfg.target_path(), env.vllm_dir))
    if backend != "vllm-server":
        return f"extract would use {backend} ({why})"
    missing = compat.own_connector_missing(VllmSource.from_dir(Path(env.vllm_dir),
                                                                env.version or "?"))
    return f"vLLM {env.version} lacks {missing[0]} (eagle-panel's connector)" if missing else None


# ---- a stage's side ------------------------------------------------------------------

class _Process:
    """The shared server's process as a stage sees it: not its child, so its
    liveness by pid and start time (a reused pid is not it)."""

    def __init__(self, pid: int, create_time: int | None):
        self.pid, self.create_time, self.returncode = pid, create_time, None

    def poll(self):
        from pipeline.run.executor import proc_alive
        if self.returncode is None and not proc_alive(self.pid, self.create_time):
            self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None):
        import subprocess
        deadline = time.monotonic() + (timeout or 0)
        while self.poll() is None:
            if timeout is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("shared server", timeout)
            time.sleep(0.1)
        return self.returncode


def adopt(what: str, report=None, stall_after_s: float = 600.0):
    """The run's shared server for this stage, or None (none was started for
    it: the stage starts its own)."""
    from pipeline.run import provenance
    from pipeline.run.plans import read_kv
    from pipeline.vllm.server import VllmServer
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        ep = json.loads(Path(path).read_text())
        key = (Path(path).parent / "key").read_text()
        argv, devices, log, url, pid = ep["argv"], ep["devices"], ep["log"], ep["url"], ep["pid"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StageError(f"the run's shared vLLM server record {path} is unreadable ({e})",
                         hint="resume starts the server again; or set [stages.regenerate] "
                              "share_server = false") from None
    v = ep.get("vllm") or {}
    provenance.note_server(argv, v.get("version"), v.get("dist"), v.get("python") or "")
    for name, detail in (ep.get("adaptations") or {}).items():
        compat.fired(name, detail)

    class AdoptedServer(VllmServer):
        """A VllmServer whose start and stop are the driver's."""
        shared, flags, max_model_len = True, ep["flags"], ep["max_model_len"]

        def start(self) -> None:
            return None

        def wait_ready(self, timeout, should_stop, poll=None):
            if self.healthy():   # up already (regenerate brought it up): no start to report
                self.read_log()
                self.ready = True
                return
            super().wait_ready(timeout, should_stop, poll)

        def stop(self, grace: float = 10.0) -> list[int]:
            return []

    server = AdoptedServer(0, argv, int(url.rsplit(":", 1)[1]), key, devices, Path(log), {},
                           what, report, stall_after_s)
    server.proc = _Process(pid, ep.get("create_time"))
    server.kv_plan = read_kv(ep.get("kv_plan"))
    return server


CACHE_SALT = "eagle-panel-extract"   # extract's requests on a shared server: their own prefix hashes


def check_adoptable(server, flags: list[str] | None = None, max_len: int = 0) -> str | None:
    """Why a stage does not use the shared server: on the CPU it then starts
    its own (said); on GPUs that would be a second load of the target beside
    the first, on the same GPUs, so it is an error with the fix."""
    why = None
    if flags is not None and server.flags != flags:
        why = "it captures otherwise than this stage would (its flags differ)"
    elif max_len and server.max_model_len < max_len:
        why = f"its max_model_len {server.max_model_len} is under this stage's {max_len}"
    if server.died() is not None:
        raise StageError("the run's shared vLLM server has died",
                         hint=f"see {server.log_path}; resume starts it again")
    return declined(server, why)


def declined(server, why: str | None) -> str | None:
    """`why` a stage does not use the shared server, where it may start its own
    instead (the CPU); on GPUs its own would load the target a second time, on
    the GPUs the shared one holds: an error with the fix."""
    if why and server.devices:
        raise StageError(f"the run's shared vLLM server cannot serve this stage: {why}; a "
                         "server of its own would load the target again on the same GPUs",
                         hint="set [stages.regenerate] share_server = false, then resume")
    return why
