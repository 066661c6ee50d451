"""The `vllm-server` extract backend: vLLM's official hidden-state route.

One `vllm serve <target>` per GPU group (tensor-parallel size from config;
several groups = data parallel, samples pulled from one shared queue), each
started with the speculative method `extract_hidden_states` (the aux layer
ids + the last layer in the draft's hf_config) and the
`ExampleHiddenStatesConnector` writing under extract/out/.staging/<server>.
For each prepared sample: send its token ids (prompt only, 1 output token),
wait for the connector's write to finish (it holds `<file>.lock` from vLLM
0.22; before that the file is whole when the answer comes), check its token
ids and shape, and move it to hs_{i}.safetensors. Servers and their whole
process trees are stopped at the end, on cancel and on failure.

KV cache: the server's log lines give a `kv_cache` event (source "log"),
its /metrics a live `kv_usage` event.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from pipeline.events import tail_lines
from pipeline.proctree import stop_tree
from pipeline.stages.common import StageError
from pipeline.vllm_logs import KvLogReader, combine_usage, parse_metrics

SERVER_TOKEN_VAR = "EAGLE_PANEL_SERVER_TOKEN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(serve_command: str, python: str, target: Path, port: int, layer_ids: list[int],
               storage: Path, tp: int, dtype: str, max_model_len: int, trust: bool,
               extra: list[str]) -> list[str]:
    base = shlex.split(serve_command) if serve_command else [
        python, "-m", "vllm.entrypoints.cli.main", "serve"]
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    argv = [*base, str(target), "--host", "127.0.0.1", "--port", str(port),
            "--tensor-parallel-size", str(tp), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--no-enable-chunked-prefill",
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    if trust:
        argv.append("--trust-remote-code")
    return argv + list(extra)


class Server:
    """One vLLM server process group on a set of GPUs."""

    def __init__(self, k: int, argv: list[str], port: int, devices: list[int], log_path: Path):
        self.k, self.argv, self.devices, self.log_path = k, argv, devices, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.token = uuid.uuid4().hex
        self.proc: subprocess.Popen | None = None
        self.kv = KvLogReader()
        self.kv_sent = False
        self._log_pos = 0

    def start(self) -> None:
        env = dict(os.environ, **{SERVER_TOKEN_VAR: self.token})
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.devices))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        print(f"extract: server {self.k} on GPUs {self.devices or '-'}: "
              f"{shlex.join(self.argv)}", flush=True)
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()

    def last_lines(self, n: int = 15) -> str:
        lines, _ = tail_lines(self.log_path, n)
        return "\n".join(b.decode(errors="replace") for b in lines)

    def new_log_lines(self) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_pos)
                data = f.read()
        except OSError:
            return []
        cut = data.rfind(b"\n") + 1
        self._log_pos += cut
        return data[:cut].decode(errors="replace").splitlines()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float, should_stop, poll=None) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if poll:
                poll()
            if self.proc.poll() is not None:
                raise StageError(
                    f"vLLM server {self.k} exited with code {self.proc.returncode} while "
                    f"starting; its last log lines ({self.log_path}):\n{self.last_lines()}",
                    hint="fix what the log says (model path, GPU memory, vLLM version: "
                         "`eagle-panel doctor`), then resume")
            if should_stop():
                return
            if time.monotonic() > deadline:
                raise StageError(
                    f"vLLM server {self.k} did not answer /health within {timeout:.0f} s; "
                    f"its last log lines ({self.log_path}):\n{self.last_lines()}",
                    hint="raise [stages.extract] startup_timeout_s for a very large model")
            time.sleep(0.5)

    def complete(self, ids: list[int], model: str, timeout: float) -> dict:
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def metrics(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=2) as r:
                return parse_metrics(r.read().decode(errors="replace"))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def stop(self, grace: float = 10.0) -> list[int]:
        if self.proc is None:
            return []
        left = stop_tree(self.token, self.proc.pid, term_grace=grace, kill_grace=5.0,
                         var=SERVER_TOKEN_VAR)
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        return left


def wait_written(path: Path) -> None:
    """Block until the connector's write of `path` ends: from vLLM 0.22 it
    holds an exclusive flock on `<path>.lock` while writing."""
    lock = Path(str(path) + ".lock")
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)
    lock.unlink(missing_ok=True)


def take_file(src: Path, final: Path, ids: list[int], n_layers: int, hidden: int, dtype) -> int:
    """Check the connector's file (token ids, shape, finite values) and move
    it into place, rewritten when it has extra positions or another dtype;
    returns bytes."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file
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
    if tuple(hs.shape[1:]) != (n_layers, hidden):
        raise StageError(f"{src.name}: hidden_states shape {tuple(hs.shape)}, expected "
                         f"[{n}, {n_layers}, {hidden}]",
                         hint="the server's aux layer ids differ from [stages.extract] layer_ids")
    if not bool(torch.isfinite(hs[:n]).all()):
        raise StageError(f"{src.name}: the server produced non-finite hidden states",
                         hint="check [model] dtype and the model weights")
    if hs.shape[0] != n or tok.shape[0] != n or hs.dtype != dtype:
        # Extra positions (the generated token) or another dtype: rewrite.
        tmp = final.with_name(f".{final.name}.tmp")
        save_file({"hidden_states": hs[:n].to(dtype).contiguous(),
                   "token_ids": torch.as_tensor(ids, dtype=torch.long)}, str(tmp))
        os.replace(tmp, final)
        src.unlink()
    else:
        os.replace(src, final)
    return final.stat().st_size


def run_servers(ctx, target: Path, layer_ids: list[int], dtype, hidden: int, data_ids, todo,
                lengths, folder: Path, bytes_per_token: int, min_free: float,
                emit) -> tuple[int, int, int]:
    """Extract `todo` through vLLM servers; returns (samples, tokens, bytes)."""
    from pipeline.stages.extract import GB, hs_path
    sec = ctx.section
    gpus = ctx.cfg.stage_devices("extract")
    tp = sec.tensor_parallel  # divides len(gpus): checked with the config
    groups = [gpus[i:i + tp] for i in range(0, len(gpus), tp)] or [[]]
    staging = ctx.out / ".staging"
    dtype_name = str(dtype).replace("torch.", "")
    max_len = max(lengths) + 8 if lengths else 16
    servers = []
    for k, group in enumerate(groups):
        store = staging / f"server{k}"
        if store.exists():
            for f in store.iterdir():  # a killed run's half-written files
                f.unlink()
        store.mkdir(parents=True, exist_ok=True)
        port = free_port()
        argv = serve_argv(sec.serve_command, ctx.cfg.python(), target, port, layer_ids, store, tp,
                          dtype_name, max_len, ctx.cfg.model.trust_remote_code,
                          list(sec.server_args))
        servers.append(Server(k, argv, port, group, ctx.run.path / "extract" / f"vllm{k}.log"))
    work: queue.Queue = queue.Queue()
    for i in sorted(todo, key=lambda i: -lengths[i]):
        work.put(i)
    lock = threading.Lock()
    done = [0, 0, 0]
    errors: list[BaseException] = []
    extra = list(sec.server_args)
    model = (extra[extra.index("--served-model-name") + 1]
             if "--served-model-name" in extra[:-1] else str(target))
    in_flight_bytes = [0]
    last_usage = [0.0, None]

    def poll_server_state():
        for s in servers:
            for line in s.new_log_lines():
                if s.kv.feed(line) and not s.kv_sent and s.kv.event():
                    s.kv_sent = True
                    ctx.events.emit("kv_cache", server=s.k, devices=s.devices, **s.kv.event())
        now = time.monotonic()
        if now - last_usage[0] >= 2.0:
            last_usage[0] = now
            usage = [u for u in (s.metrics() for s in servers) if u]
            if usage:
                agg = combine_usage(usage)
                if agg != last_usage[1]:
                    last_usage[1] = agg
                    ctx.events.emit("kv_usage", **agg)

    def client(server: Server):
        while not errors and not ctx.stop_requested:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            ids = list(data_ids[i])
            need = bytes_per_token * len(ids)
            with lock:
                free = shutil.disk_usage(folder).free
                if free - in_flight_bytes[0] - need < min_free:
                    errors.append(StageError(
                        f"stopped before the disk fills: {free / GB:.2f} GiB free at {folder}, "
                        "below min_free_gb plus the samples in flight",
                        hint="free space (or move [run] runs_dir to a bigger disk) and resume; "
                             "finished files are kept"))
                    return
                in_flight_bytes[0] += need
            try:
                resp = server.complete(ids, model, sec.request_timeout_s)
                params = resp.get("kv_transfer_params") or {}
                path = params.get("hidden_states_path")
                if not path:
                    raise StageError("the server's answer has no kv_transfer_params."
                                     "hidden_states_path", hint="the server must run with the "
                                     "ExampleHiddenStatesConnector (vLLM >= 0.17)")
                wait_written(Path(path))
                nbytes = take_file(Path(path), hs_path(folder, i), ids, len(layer_ids), hidden,
                                   dtype)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                try:  # a dropped connection is often the server dying: give it a moment
                    server.proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    errors.append(e)
                else:
                    errors.append(StageError(
                        f"vLLM server {server.k} died (exit code {server.proc.returncode}); "
                        f"its last log lines:\n{server.last_lines()}",
                        hint="finished files are kept; resume continues with the rest"))
                return
            finally:
                with lock:
                    in_flight_bytes[0] -= need
            with lock:
                done[0] += 1
                done[1] += len(ids)
                done[2] += nbytes

    threads: list[threading.Thread] = []
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(sec.startup_timeout_s, lambda: ctx.stop_requested, poll_server_state)
        ctx.check_stop()
        t0 = time.time()
        for s in servers:
            for _ in range(sec.max_inflight):
                t = threading.Thread(target=client, args=(s,), daemon=True)
                t.start()
                threads.append(t)
        while any(t.is_alive() for t in threads):
            time.sleep(0.25)
            poll_server_state()
            with lock:
                emit(*done)
        poll_server_state()
        if errors:
            e = errors[0]
            if isinstance(e, StageError):
                raise e
            raise StageError(f"request to the vLLM server failed: {type(e).__name__}: {e}",
                             hint="see the server logs extract/vllm*.log") from e
        print(f"extract: {done[0]} samples through {len(servers)} server(s) in "
              f"{time.time() - t0:.1f} s", flush=True)
    finally:
        for s in servers:
            left = s.stop(grace=ctx.cfg.runtime.term_grace_s)
            if left:
                print(f"extract: server {s.k} processes {left} survived SIGKILL", file=sys.stderr)
    return tuple(done)
