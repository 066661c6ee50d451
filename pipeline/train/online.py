"""Online training: no extract pass, no multi-terabyte disk. The train stage
runs vLLM server(s) on [gpus] extract (one per tensor_parallel group, the same
extraction flags and connector as the extract stage) and speculators' own
dataloader asks them for the hidden states of each sample it lacks
(`--vllm-endpoint --on-missing generate`); the connector writes each sample
under train/out/.hs_buffer, the dataloader waits for the write, loads it and
deletes it. The buffer holds only what is in flight.

What eagle-panel adds around speculators' online mode:
  - its servers are ours: loopback, a per-run API key, the process tree
    stopped at the end, on cancel and on failure. speculators' client sends
    the key "EMPTY", so the dataloader gets a dataset class of ours
    (`KeyedArrowDataset`, found by module path in spawned workers too) that
    sends the real key, and spreads its workers over the servers (speculators
    0.9 takes one --vllm-endpoint);
  - a server that dies mid-training is restarted on its port a bounded
    number of times ([stages.train] server_restarts) while the dataloader
    waits for /health before each request (speculators counts failed requests
    and gives up after 20 in a row, long before a server is back); when the
    restarts are spent, training is stopped gracefully (a checkpoint is saved)
    and the stage fails quoting the server's own error;
  - the producer/consumer view: an `online` event every few seconds with the
    servers' hidden-state tokens/s, running/waiting requests and KV use, the
    trainer's samples/s and the share of each step it waited for data, the
    buffer's size and peak, and a verdict when one side starves the other.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from pipeline.drive.stage_context import StageContext, StageError
from pipeline.extract.job import gpu_groups
from pipeline.extract.server_flags import extraction_flags
from pipeline.model.info import read_model
from pipeline.run.events import EventType
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.environment import probe
from pipeline.vllm.kv_plan import extraction_bytes_per_token
from pipeline.vllm.metrics import samples
from pipeline.vllm.server import VllmServer, make_server, served_model_name, server_log

ENDPOINTS_VAR = "EAGLE_PANEL_ONLINE_ENDPOINTS"
KEEP_VAR = "EAGLE_PANEL_ONLINE_KEEP"   # "<folder>:<bytes>:<fp8 0|1>:<min free bytes>"
COUNTS = ".counts-"   # in the buffer: each dataloader process's counts (samples from where)
KEY_VAR = "EAGLE_PANEL_ONLINE_KEY"
BUFFER_VAR = "EAGLE_PANEL_ONLINE_BUFFER"   # where the servers write (and the counts live)
WAIT_VAR = "EAGLE_PANEL_ONLINE_WAIT_S"   # how long a request waits for a server to be back
GONE = ".servers-gone"   # in the buffer: the watchdog gave up, stop waiting
REPORT_S = 3.0
# A side that waits this share of the time or more is starved.
STARVED = 0.3


def verdict(trainer_wait: float | None, server_idle: float | None) -> str:
    """One plain line on who waits for whom."""
    if trainer_wait is not None and trainer_wait >= STARVED:
        if server_idle is not None and server_idle >= 0.5:
            return (f"trainer waits on vLLM {trainer_wait:.0%} of the time while vLLM idles "
                    f"{server_idle:.0%}: too few requests in flight; raise [stages.train] "
                    "dataloader_workers, not the GPUs")
        return (f"trainer waits on vLLM {trainer_wait:.0%} of the time: give extract more "
                "GPUs")
    if server_idle is not None and server_idle >= 0.5 and (trainer_wait or 0) < 0.1:
        return (f"vLLM idles {server_idle:.0%} of the time: the trainer is the bottleneck; "
                "give train more GPUs (or extract fewer)")
    return "balanced: neither side waits long on the other"


def dir_bytes(folder: Path) -> int:
    total = 0
    for f in folder.iterdir() if folder.is_dir() else ():
        try:
            total += f.stat().st_size
        except OSError:
            pass   # consumed between the listing and the stat
    return total


class OnlineServers:
    """The servers online training reads from, watched while it runs."""

    def __init__(self, ctx: StageContext, meta: dict, lengths_max: int):
        self.ctx = ctx
        sec, ext = ctx.section, ctx.cfg.stages.extract
        self.env = probe(ctx.cfg.vllm_python())
        devices = ctx.cfg.stage_devices("extract")
        why = self.env.unusable(devices)
        if why:
            raise StageError(f'[pipeline] mode = "online" needs a vLLM that can serve the '
                             f"target: {why}", hint='or set [pipeline] mode = "offline"')
        self.buffer = ctx.out / ".hs_buffer"
        shutil.rmtree(self.buffer, ignore_errors=True)   # a killed run's leftovers
        self.buffer.mkdir(parents=True)
        target = ctx.cfg.target_path()
        self.model = served_model_name(target, ext.server_args)
        max_len = lengths_max + 8
        dtype = meta["dtype"]
        elem = 4 if dtype == "float32" else 2
        model = read_model(target)
        per_token = extraction_bytes_per_token(model, ext.tensor_parallel, elem,
                                               len(meta["layer_ids"]))
        self.servers: list[VllmServer] = [
            make_server(k, self.env, target, group, server_log(ctx.run.stage_dir("train"), k),
                        dtype, max_len, ctx.cfg.model.trust_remote_code,
                        extraction_flags(meta["layer_ids"], self.buffer, True,
                                         meta.get("stored") == "fp8", "linear" in model.kinds)
                        + list(ext.server_args), ext.serve_command,
                        sec.online_max_inflight * max_len, per_token,
                        what="vLLM server (online)", report=self._server_event,
                        stall_after_s=ext.stall_after_s)
            for k, group in enumerate(gpu_groups(devices, ext.tensor_parallel))]
        self.restarts = 0
        self.fatal: StageError | None = None
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None
        self.peak_buffer = 0
        self.trainer = {"wait": None, "tokens_per_s": None}   # set by the metric handler
        self.counts = {"from_disk": 0, "from_servers": 0, "kept_bytes": 0}

    def _server_event(self, kind: str, fields: dict) -> None:
        self.ctx.events.emit(kind, **fields)

    def endpoints(self) -> list[str]:
        return [s.url + vs.API_V1 for s in self.servers]

    def start(self) -> None:
        ext = self.ctx.cfg.stages.extract
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_ready(ext.startup_timeout_s, lambda: self.ctx.stop_requested)
        for s in self.servers:
            report = s.kv_report()
            if report:
                self.ctx.events.emit(EventType.KV_CACHE, **report)
        os.environ[ENDPOINTS_VAR] = ",".join(self.endpoints())
        os.environ[BUFFER_VAR] = str(self.buffer)
        os.environ[KEY_VAR] = self.servers[0].api_key
        os.environ[WAIT_VAR] = str(ext.startup_timeout_s)
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()

    def _restart(self, s: VllmServer) -> None:
        """The same command on the same port: the trainer's clients keep their URL."""
        s.stop(grace=self.ctx.cfg.runtime.term_grace_s)
        s.kv_reported = False
        s.start()
        s.wait_ready(self.ctx.cfg.stages.extract.startup_timeout_s, self._stop.is_set)

    def _watchdog(self) -> None:
        last: dict[int, tuple[float, float, float]] = {}
        busy: list[float] = []
        while not self._stop.wait(REPORT_S):
            for s in self.servers:
                died = s.died()
                if died is None:
                    continue
                if self.restarts >= self.ctx.section.server_restarts:
                    self.fatal = StageError(
                        f"{died}\n(restarted {self.restarts} time(s) already)", hint=died.hint)
                    self._give_up()
                    return
                self.restarts += 1
                self.ctx.events.warning(f"{s.name} died ({str(died).splitlines()[0]}); "
                                        f"restarting it ({self.restarts}/"
                                        f"{self.ctx.section.server_restarts})")
                try:
                    self._restart(s)
                except StageError as e:
                    self.fatal = e
                    self._give_up()
                    return
            self._report(last, busy)

    def _give_up(self) -> None:
        """No server any more: the trainer saves a checkpoint and stops, and
        requests stop waiting for a server to come back."""
        self.ctx.stop_requested = True
        (self.buffer / GONE).touch()

    def _report(self, last: dict, busy: list) -> None:
        """One `online` event. A server's busy share comes from Little's law:
        the growth of the summed request time per second of wall time is the
        mean number of requests in flight; below 1 the server idled. (Samples
        of `running` every few seconds miss requests that take milliseconds.)"""
        now, produced, inflight, running, waiting, usage = time.monotonic(), 0.0, 0.0, 0, 0, []
        for s in self.servers:
            text = s.metrics_text()
            if not text:
                continue
            vals: dict[str, float] = {}
            for name, _labels, value in samples(text):
                vals[name] = vals.get(name, 0.0) + value
            tokens = vals.get(vs.METRIC_PROMPT_TOKENS, 0.0)
            busy_s = vals.get(vs.METRIC_INFERENCE_TIME_SUM, 0.0)
            t0, n0, b0 = last.get(s.k, (now, tokens, busy_s))
            if now > t0:
                produced += (tokens - n0) / (now - t0)
                inflight += min(1.0, (busy_s - b0) / (now - t0))
            last[s.k] = (now, tokens, busy_s)
            running += int(vals.get(vs.METRIC_RUNNING, 0))
            waiting += int(vals.get(vs.METRIC_WAITING, 0))
            if vs.METRIC_KV_USAGE in vals:
                usage.append(vals[vs.METRIC_KV_USAGE])
        busy.append(inflight / len(self.servers))
        del busy[:-20]   # the last minute
        buffer = dir_bytes(self.buffer)
        self.peak_buffer = max(self.peak_buffer, buffer)
        counts = read_counts(self.buffer)
        server_idle = 1.0 - sum(busy) / len(busy)
        wait = self.trainer["wait"]
        self.ctx.events.emit(
            EventType.ONLINE, produced_tokens_per_s=round(produced, 1), running=running,
            waiting=waiting, kv_usage_perc=sum(usage) / len(usage) if usage else None,
            consumed_tokens_per_s=self.trainer["tokens_per_s"], trainer_wait_share=wait,
            server_idle_share=round(server_idle, 3), buffer_bytes=buffer,
            buffer_peak_bytes=self.peak_buffer, servers=len(self.servers),
            server_devices=self.ctx.cfg.stage_devices("extract"),
            trainer_devices=self.ctx.cfg.stage_devices("train"),
            restarts=self.restarts, verdict=verdict(wait, server_idle), **counts)

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.join(timeout=10)
        for s in self.servers:
            left = s.stop(grace=self.ctx.cfg.runtime.term_grace_s)
            if left:
                print(f"train: {s.name} processes {left} survived SIGKILL", flush=True)
        self.counts = read_counts(self.buffer)   # the dataloaders' last word
        shutil.rmtree(self.buffer, ignore_errors=True)


def hidden_states_folder(ctx: StageContext, buffer: Path) -> Path:
    """Where speculators' dataloader looks first for a sample's hidden states:
    extract's folder in hybrid mode (what an earlier extract left there), or
    whenever generated states are kept; else the buffer (online: nothing on
    disk)."""
    if ctx.cfg.pipeline.mode == "hybrid" or ctx.section.keep_generated_gb > 0:
        folder = ctx.out_of("extract") / "hidden_states"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return buffer


def online_argv(servers: OnlineServers, sec) -> list[str]:
    """speculators' online flags, pointed at our servers and buffer (and, in
    hybrid mode, at extract's files first)."""
    ctx = servers.ctx
    folder = hidden_states_folder(ctx, servers.buffer)
    if sec.keep_generated_gb > 0:
        os.environ[KEEP_VAR] = (f"{folder}:{int(sec.keep_generated_gb * 1e9)}:"
                                f"{int(ctx.cfg.stages.extract.hidden_states_dtype == 'fp8')}:"
                                f"{int(ctx.cfg.stages.extract.min_free_gb * 1e9)}")
    # Retries back off 2, 4, 8, ... s: 6 of them wait ~2 min in all, long
    # enough for a server that died to be restarted (a small model: ~40 s).
    return ["--vllm-endpoint", servers.endpoints()[0], "--on-missing", "generate",
            "--hidden-states-path", str(folder),
            "--request-timeout", str(ctx.cfg.stages.extract.request_timeout_s),
            "--max-retries", "6"]


def read_counts(buffer: Path) -> dict:
    """The dataloader processes' counts, summed: samples read from disk and
    from the servers, and the generated states kept (their bytes)."""
    total = {"from_disk": 0, "from_servers": 0, "kept_bytes": 0}
    for f in buffer.glob(COUNTS + "*") if buffer.is_dir() else ():
        try:
            counts = json.loads(f.read_text())
        except (OSError, ValueError):
            continue   # being replaced
        for k in total:
            total[k] += int(counts.get(k, 0))
    return total


def keyed_dataset_class():
    """speculators' ArrowDataset, with our API key, one of our servers per
    dataloader worker, and a wait for that server's health before each
    request (spawned workers import this module to unpickle it)."""
    from speculators.train.data import ArrowDataset
    return _keyed(ArrowDataset)


def wait_healthy(endpoint: str, timeout: float, gone: Path) -> None:
    """Until the server answers /health (it may be restarting), the watchdog
    gives up, or the timeout passes (the request then fails as it would)."""
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + timeout
    health = endpoint.removesuffix(vs.API_V1) + vs.ROUTE_HEALTH
    while time.monotonic() < deadline and not gone.exists():
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)


_CLASS: list = []


def _keyed(base):
    if not _CLASS:
        class _Keyed(base):
            def _endpoint(self) -> str:
                import torch
                endpoints = os.environ[ENDPOINTS_VAR].split(",")
                info = torch.utils.data.get_worker_info()
                return endpoints[(info.id if info else 0) % len(endpoints)]

            def _get_raw_data(self, index):
                self._file_idx = self._map_to_file_idx(index)
                return super()._get_raw_data(index)

            def _generate_hidden_states_once(self, dataset_item, client_item):
                wait_healthy(self._endpoint(), float(os.environ.get(WAIT_VAR, "600")),
                             Path(os.environ[BUFFER_VAR]) / GONE)
                loaded = super()._generate_hidden_states_once(dataset_item, client_item)
                self._counter().generated(self._file_idx, loaded)
                return loaded

            def __getitem__(self, index):
                out = super().__getitem__(index)
                self._counter().seen()
                return out

            def _counter(self):
                if getattr(self, "_eagle_counter", None) is None:
                    self._eagle_counter = Counter(Path(os.environ[BUFFER_VAR]),
                                                  os.environ.get(KEEP_VAR, ""))
                return self._eagle_counter

            def _setup_client(self):
                import openai
                url = self._endpoint()
                client = openai.OpenAI(base_url=url, api_key=os.environ[KEY_VAR], max_retries=0)
                model_id = client.models.list().data[0].id
                if self.model and self.model != model_id:
                    raise ValueError(f"the vLLM server at {url} serves {model_id}, not "
                                     f"{self.model}")
                self.model = model_id
                self.transfer.setup()
                self.client = client

        _Keyed.__name__ = _Keyed.__qualname__ = "KeyedArrowDataset"
        _Keyed.__module__ = __name__
        _CLASS.append(_Keyed)
    return _CLASS[0]


class Counter:
    """One dataloader process's counts (samples seen, generated by the
    servers, kept), saved to the buffer after each sample; and the keeping:
    a generated sample written beside extract's files (atomically, in the
    run's dtype or FP8) while the kept bytes stay under the budget and the
    disk above min_free_gb, so later epochs read it from disk."""

    def __init__(self, buffer: Path, keep: str):
        self.path = buffer / f"{COUNTS}{os.getpid()}"
        self.counts = {"seen": 0, "from_servers": 0, "kept_bytes": 0}
        folder, budget, fp8, min_free = (keep.rsplit(":", 3) if keep else ("", "0", "0", "0"))
        self.folder, self.budget = Path(folder) if folder else None, int(budget)
        self.fp8, self.min_free = fp8 == "1", int(min_free)

    def seen(self) -> None:
        self.counts["seen"] += 1
        self.save()

    def generated(self, file_idx: int, loaded: dict) -> None:
        self.counts["from_servers"] += 1
        if self.folder is not None and self.counts["kept_bytes"] < self.budget and \
                shutil.disk_usage(self.folder).free > self.min_free:
            from pipeline.model.hsfile import hs_path, write_sample
            self.counts["kept_bytes"] += write_sample(
                hs_path(self.folder, file_idx), loaded["hidden_states"], loaded["token_ids"],
                fp8=self.fp8)
        self.save()

    def save(self) -> None:
        # after every sample: a dataloader worker ends without a goodbye
        # (multiprocessing skips atexit), and one small atomic write is
        # nothing beside loading a sample's hidden states
        from pipeline.run.rundir import atomic_write_bytes
        c = dict(self.counts, from_disk=max(0, self.counts["seen"] - self.counts["from_servers"]))
        try:
            atomic_write_bytes(self.path, json.dumps(c).encode())
        except OSError:
            pass   # the buffer is being removed at the end


def __getattr__(name):
    # pickle looks the class up by name in a spawned worker: build it there too
    if name == "KeyedArrowDataset":
        return keyed_dataset_class()
    raise AttributeError(name)
