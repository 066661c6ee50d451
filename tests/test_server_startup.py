"""A vLLM server's start as the panel, `status` and `run --wait` show it:
phases read from its log as it grows (pipeline.vllm.startup), shard counts,
a stuck start called stalled. The fast tests feed lines of a real vLLM 0.32
log; the real one starts `vllm serve` on the built-in target saved in several
shards, freezes it with SIGSTOP while it starts, and lets it go on."""

import os
import signal
import threading
import time

import pytest

from pipeline.vllm import startup
from pipeline.vllm.startup import StartupWatch, describe

# lines of a real vLLM 0.32 CPU-build server log, in order (prefixes shortened)
REAL_LOG = [
    "(APIServer pid=1) INFO 12-01 05:00:00 [api_server.py:1] vLLM API server version 0.32.0",
    "(EngineCore pid=2) INFO 12-01 05:00:09 [cpu_model_runner.py:68] Starting to load model "
    "/m...",
    "Loading safetensors checkpoint shards:   0% Completed | 0/5 [00:00<?, ?it/s]",
    "Loading safetensors checkpoint shards:  40% Completed | 2/5 [00:00<00:00,  9.1it/s]",
    "Loading safetensors checkpoint shards: 100% Completed | 5/5 [00:00<00:00, 11.5it/s]",
    "(EngineCore pid=2) INFO 12-01 05:00:10 [default_loader.py:501] Loading weights took 0.10 "
    "seconds",
    "(EngineCore pid=2) INFO 12-01 05:00:10 [cpu_model_runner.py:75] Loading drafter model...",
    "(EngineCore pid=2) INFO 12-01 05:00:10 [cpu_worker.py:260] Explicitly set (1.0/14.96) GiB "
    "for KV cache on node 0.",
    "(EngineCore pid=2) INFO 12-01 05:00:10 [kv_cache_utils.py:2327] CPU KV cache size: 186,368 "
    "tokens, Maximum concurrency for 512 tokens per request: 364.00x",
    "(EngineCore pid=2) INFO 12-01 05:00:11 [core.py:402] init engine (profile, create kv cache, "
    "warmup model) took 0.79 s",
    "(APIServer pid=1) INFO:     Application startup complete.",
]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_phases_in_order_from_a_real_log():
    clock = Clock()
    w = StartupWatch(stall_after_s=60, clock=clock)
    seen = [(w.phase, w.shards)]
    for line in REAL_LOG:
        clock.t += 1
        if w.feed(line):
            seen.append((w.phase, w.shards))
    assert [p for p, _ in seen] == [startup.STARTING, startup.LOADING, startup.LOADING,
                                    startup.LOADING, startup.LOADING, startup.DRAFT,
                                    startup.PROFILING, startup.WARMUP, startup.READY]
    assert [s for _, s in seen[1:5]] == [None, (0, 5), (2, 5), (5, 5)]
    assert w.took == {"Loading weights took": 0.10,
                      "init engine (profile, create kv cache, warmup model) took": 0.79}
    assert describe(w.fields()) == "ready in 11s"
    # every phase it went through, timed (what the next start is told to expect)
    assert set(w.phase_times) == {startup.STARTING, startup.LOADING, startup.DRAFT,
                                  startup.PROFILING, startup.WARMUP}
    assert sum(w.phase_times.values()) == w.elapsed_s() == 11


def test_the_last_start_here_is_the_expectation(tmp_path):
    from pipeline.vllm import start_history as h
    path = tmp_path / "starts.jsonl"
    argv = ["python", "-m", "pipeline.vllm.launch", "serve", "/m/kimi", "--dtype", "float32",
            "--tensor-parallel-size", "8"]
    key = h.start_key(argv)
    assert key == "/m/kimi|tp=8|"
    assert h.start_key([*argv, "--speculative-config", '{"method": "eagle3"}']).endswith("|eagle3")
    assert h.start_key([*argv, "--speculative-config=not json"]).endswith("|draft")
    assert h.last(key, path) is None                      # no file: no history
    h.record(key, 660.0, {startup.LOADING: 600.0}, path)
    h.record("/m/other|tp=1|", 30.0, {}, path)
    with open(path, "a") as f:
        f.write("{damaged\n")                              # a torn line is skipped
    assert h.last(key, path)["elapsed_s"] == 660.0
    clock = Clock()
    w = StartupWatch(clock=clock, expected_s=h.last(key, path)["elapsed_s"])
    w.feed(REAL_LOG[1])
    clock.t += 250
    assert describe(w.fields()) == "loading weights (4m10s of ~11m00s last time)"
    for i in range(2 * h.KEEP + 50):                        # bounded: cut to its last KEEP
        h.record(f"k{i}", 1.0, {startup.LOADING: 0.5, startup.WARMUP: 0.5}, path)
    h.record(key, 700.0, {}, path)
    lines = path.read_text().splitlines()
    assert len(lines) <= 2 * h.KEEP and h.last(key, path)["elapsed_s"] == 700.0


def test_a_quiet_start_is_stalled_and_a_gpu_memory_change_is_life():
    clock = Clock()
    w = StartupWatch(stall_after_s=300, clock=clock)
    w.feed(REAL_LOG[1])
    w.feed(REAL_LOG[3])
    clock.t += 299
    assert w.stalled_s() == 0
    w.memory((40 << 30,))               # the GPUs filled: the load is alive
    clock.t += 200
    assert w.stalled_s() == 0
    clock.t += 200
    f = w.fields()
    assert f["stalled_s"] == 400 and f["done"] == 2 and f["total"] == 5
    assert describe(f) == "stalled 6m40s in loading weights"
    assert "2/5" in f["last_line"]


@pytest.mark.vllm
def test_a_real_server_start_phase_by_phase_and_a_frozen_one_stalled(tmp_path):
    from pipeline.builtin.tiny_model import ensure_built
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm.environment import probe
    from pipeline.vllm.server import make_server, server_log
    py = VLLM_VENV / "bin" / "python"
    if not py.exists() or probe(str(py)).unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(ensure_built())).save_pretrained(
        sharded, max_shard_size="1MB")
    AutoTokenizer.from_pretrained(str(ensure_built())).save_pretrained(sharded)
    shards = len(list(sharded.glob("*.safetensors")))
    assert shards >= 3
    events = []
    server = make_server(0, probe(str(py)), sharded, [], server_log(tmp_path, 0), "float32",
                         256, False, [], kv_tokens=512, kv_bytes_per_token=1 << 14,
                         report=lambda kind, f: events.append(f), stall_after_s=3)
    began = time.time()
    server.start()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (server.wait_ready(600, lambda: False),
                                              done.set()), daemon=True)
    try:
        # freeze the whole server (its session) before it has loaded anything
        deadline = time.monotonic() + 60
        while server.log_path.stat().st_size == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(server.proc.pid, signal.SIGSTOP)
        thread.start()
        deadline = time.monotonic() + 30
        while not any(e.get("stalled_s") for e in events) and time.monotonic() < deadline:
            time.sleep(0.2)
        stalled = [e for e in events if e.get("stalled_s")]
        assert stalled and stalled[0]["phase"] in (startup.STARTING, startup.LOADING)
        assert stalled[0]["stalled_s"] >= 3 and stalled[0]["last_line"]
        os.killpg(server.proc.pid, signal.SIGCONT)
        assert done.wait(600), "the server never became ready"
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
        server.stop(grace=5)
    assert events[-1]["phase"] == startup.STOPPED   # the stop is reported too
    events = events[:-1]
    phases = [e["phase"] for e in events]
    order = [startup.ORDER.index(p) for p in phases]
    assert order == sorted(order), phases            # never backwards
    assert phases[-1] == startup.READY and startup.LOADING in phases
    loading = [(e["done"], e["total"]) for e in events if e.get("total")]
    assert loading and loading[-1] == (shards, shards), loading
    assert not events[-1].get("stalled_s") and events[-1]["server"] == 0
    assert events[-1]["log"] == str(server_log(tmp_path, 0))
    # the start is kept in the project's cache: the next one of this target expects it
    from pipeline.vllm import start_history
    kept = start_history.last(start_history.start_key(server.argv))
    assert kept and kept["at"] >= began and kept["elapsed_s"] >= stalled[0]["stalled_s"]
    assert startup.LOADING in kept["phases"]
    print("real start:", [(e["phase"], e.get("done"), e["elapsed_s"]) for e in events])
