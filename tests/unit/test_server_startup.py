"""A vLLM server's start as the panel, `status` and `run --wait` show it:
phases read from its log as it grows (pipeline.vllm.startup), shard counts,
a stuck start called stalled. The fast tests feed lines of a real vLLM 0.32
log; the real one starts `vllm serve` on the built-in target saved in several
shards, freezes it with SIGSTOP while it starts, and lets it go on.

The parts in other tiers: tests/vllm/test_server_startup.py."""



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


