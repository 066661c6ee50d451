"""A vLLM server's start as the panel, `status` and `run --wait` show it:
phases read from its log as it grows (pipeline.vllm.startup), shard counts,
a stuck start called stalled. The fast tests feed lines of a real vLLM 0.32
log; the real one starts `vllm serve` on the built-in target saved in several
shards, freezes it with SIGSTOP while it starts, and lets it go on.

The vllm tier's part of tests/unit/test_server_startup.py."""

import os
import signal
import threading
import time

import pytest

from pipeline.vllm import startup


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
