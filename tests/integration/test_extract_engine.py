"""The vllm-engine extract backend against tests/fakes/standin_engine.py, a
STAND-IN for vLLM 0.11-0.16's scheduler, executor and model runner on GPUs
(the releases the engine route targets have no CPU build that runs the
capture here: see the README). The capture extension is the real one, mixed
into the stand-in worker as vLLM does; the hidden states come from a real
forward of the tiny target, so the files are checked against the hf
backend's numbers (to one bf16 rounding step), through chunked prefill, KV-block waits and a
reordered batch. The installed vLLM the stage probes is a STAND-IN too (a
GPU build of 0.16 in this interpreter)."""

import sys
import time

import pytest
import torch

from pipeline.builtin.tiny_model import ensure_built
from pipeline.extract.hf import HFBackend
from pipeline.stages import extract
from pipeline.vllm import compat as vllm_compat
from tests.configs import render
from tests.fakes import standin_engine as se
from tests.helpers import assert_forward_matches, finished, hs_files, prepared_once, run_body

N = 12


def config(tp: int = 1, devices: tuple[int, ...] = (0,), batch_tokens: int = 96,
           **extract) -> str:
    """The engine route's extract; `extract`: more of its keys."""
    return render({"gpus": {"devices": devices}, "data": {"max_samples": N},
                   "stages": {"extract": {"backend": "vllm-engine", "layer_ids": [0, 2, 3],
                                          "batch_tokens": batch_tokens, "max_num_seqs": 3,
                                          "tensor_parallel": tp, **extract}}})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepared_once(tmp_path_factory, "engine_prepared", config())


@pytest.fixture(autouse=True)
def fresh(request, monkeypatch):
    from pipeline.vllm.environment import VllmEnv
    monkeypatch.setattr(extract, "probe", lambda python: VllmEnv(
        sys.executable, version="0.16.0", dist="vllm", vllm_dir=None, cpu_flags=["avx2"]))
    monkeypatch.setattr(vllm_compat, "_fired", {})
    se.LAST.clear()
    if "prepared" in request.fixturenames:
        _, rd = request.getfixturevalue("prepared")
        for f in hs_files(rd):
            f.unlink()


def check_against_hf(rd, which=None):
    from datasets import load_from_disk
    from safetensors.torch import load_file
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    ref = HFBackend.load(ensure_built(), [0, 2, 3, 4], "cpu", torch.float32)
    for i in which or range(N):
        ids = ds[i]["input_ids"]
        got = load_file(str(rd.out_dir("extract") / f"hidden_states/hs_{i}.safetensors"))
        assert got["token_ids"].tolist() == ids
        want = ref.forward([ids])[0].to(torch.bfloat16)
        assert_forward_matches(got["hidden_states"], want)


@pytest.mark.parametrize("generation", ["0.11", "0.16"])
def test_engine_route_writes_the_hf_numbers(prepared, monkeypatch, capsys, generation):
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api",
                        se.api_0_11 if generation == "0.11" else se.api_0_16)
    code, _, evs = run_body(tmp, "extract", extract.body, config())
    assert code == 0, [e for e in evs if e["type"] == "error"]
    summary = finished(evs)["summary"]
    assert summary["computed"] == N and len(hs_files(rd)) == N
    check_against_hf(rd)
    ex = se.LAST["executor"]
    assert ex.shut_down
    sched_cfg = ex.vllm_config.scheduler_config
    assert sched_cfg.async_scheduling is False and sched_cfg.enable_chunked_prefill
    assert ex.vllm_config.compilation_config.__dict__ == (
        {"level": 0} if generation == "0.11" else {"level": None, "mode": 0})
    assert ex.vllm_config.model_config.enforce_eager is True
    kv = [e for e in evs if e["type"] == "kv_cache"]
    assert kv[0]["source"] == "engine" and kv[0]["num_blocks"] == se.BLOCKS
    assert kv[0]["block_size"] == 16 and kv[0]["tokens_capacity"] == se.BLOCKS * 16
    out = capsys.readouterr().out
    fired = vllm_compat.fired_so_far()
    if generation == "0.11":
        assert not {"sample_tokens", "scheduler_block_size", "scheduler_initvars"} & set(fired)
    else:
        assert {"sample_tokens", "scheduler_block_size", "scheduler_initvars",
                "compilation_mode"} <= set(fired)
        assert "vllm-compat: execute_model + sample_tokens" in out


def test_chunking_kv_waits_and_preemption_really_happened(prepared, monkeypatch):
    """The samples are longer than the token budget (chunked prefill), the
    KV blocks cannot hold every admitted request at once, and running
    requests were preempted and recomputed from position 0 — and the files
    are still the hf backend's numbers."""
    from datasets import load_from_disk
    tmp, rd = prepared
    lengths = load_from_disk(str(rd.out_dir("prepare") / "data"))["seq_len"]
    assert max(lengths) > 96 and sum(lengths) > se.BLOCKS * 16
    monkeypatch.setattr(vllm_compat, "load_engine_api", se.api_0_16)
    seen = []
    real = se.Scheduler_0_12.schedule

    def spy(self):
        out = real(self)
        seen.append((dict(out.num_scheduled_tokens), len(self.waiting)))
        schedulers.add(self)
        return out
    schedulers = set()
    monkeypatch.setattr(se.Scheduler_0_12, "schedule", spy)
    monkeypatch.setattr(se.Scheduler_0_12, "chunk_cap", 40)
    code, _, evs = run_body(tmp, "extract", extract.body, config())
    assert code == 0
    assert any(len(c) > 1 for c, _ in seen)                      # several requests per step
    assert any(0 < n < lengths[int(r[3:])] for c, _ in seen for r, n in c.items())  # a chunk
    assert any(w for _, w in seen)                               # requests waited
    assert sum(s.preemptions for s in schedulers) > 0
    check_against_hf(rd)
    usage = [e for e in evs if e["type"] == "kv_usage"]
    assert usage and 0 <= usage[0]["usage_perc"] <= 1


def test_tensor_parallel_rank_0_writes_alone(prepared, monkeypatch):
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api", se.api_0_16)
    code, _, evs = run_body(tmp, "extract", extract.body, config(tp=2, devices=(0, 1)))
    assert code == 0, [e for e in evs if e["type"] == "error"]
    ex = se.LAST["executor"]
    assert [w.rank for w in ex.workers] == [0, 1]
    assert ex.workers[0]._eagle_hooks and not ex.workers[1]._eagle_hooks
    assert not ex.workers[1]._eagle.jobs and ex.workers[1]._eagle.writer.done.samples == 0
    check_against_hf(rd, [0, N - 1])


@pytest.mark.parametrize("fault, words", [
    ("positions", "not laid out the way"), ("tokens", "differ from the prepared sample")])
def test_a_layout_or_token_mismatch_fails_the_stage(prepared, monkeypatch, fault, words):
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api", lambda: se.api_with_fault(fault))
    code, _, evs = run_body(tmp, "extract", extract.body, config())
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and words in err["message"] and "capture" in err["message"]
    assert se.LAST["executor"].shut_down


def test_a_request_vllm_ends_short_or_a_lost_file_fails_the_stage(prepared, monkeypatch):
    """Guards against hanging: a request vLLM finishes before all its prompt
    positions were captured fails at once; one whose file never comes fails
    after STUCK_S."""
    from pipeline.extract import vllm_engine as extract_engine
    from pipeline.extract.vllm_capture import Capture
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api", se.api_0_16)
    monkeypatch.setattr(se.Scheduler_0_12, "finish_early", True)
    code, _, evs = run_body(tmp, "extract", extract.body, config())
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "before their hidden states were all captured" in err["message"]
    monkeypatch.setattr(se.Scheduler_0_12, "finish_early", False)
    monkeypatch.setattr(extract_engine, "STUCK_S", 1.0)
    monkeypatch.setattr(Capture, "_finish", lambda self, step: None)   # a capture that loses data
    t0 = time.monotonic()
    code, _, evs = run_body(tmp, "extract", extract.body, config())
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "no file came for them in 1 s" in err["message"]
    assert time.monotonic() - t0 < 60 and se.LAST["executor"].shut_down


def test_cancel_keeps_finished_files_and_resume_completes(prepared, monkeypatch):
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api", se.api_0_11)
    steps = [0]
    real = se.Executor_0_11.execute_model

    def stop_after_a_few(self, so, non_block=False):
        steps[0] += 1
        if steps[0] == 6:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGTERM)   # the panel's cancel
        return real(self, so, non_block)
    monkeypatch.setattr(se.Executor_0_11, "execute_model", stop_after_a_few)
    code, _, evs = run_body(tmp, "extract", extract.body, config())
    kept = len(hs_files(rd))
    assert code != 0 and 1 <= kept < N and se.LAST["executor"].shut_down
    assert not list((rd.out_dir("extract") / "hidden_states").glob(".*.tmp"))
    monkeypatch.setattr(se.Executor_0_11, "execute_model", real)
    code, _, evs = run_body(tmp, "extract", extract.body, config())
    summary = finished(evs)["summary"]
    assert code == 0 and summary["reused"] == kept and summary["computed"] == N - kept
    check_against_hf(rd)


def test_engine_route_stops_before_the_disk_fills(prepared, monkeypatch):
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api", se.api_0_16)
    code, _, evs = run_body(tmp, "extract", extract.body, config(min_free_gb=1e9))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "before the disk fills" in err["message"]
    assert not hs_files(rd)


def test_data_parallel_engines_share_the_samples(prepared, monkeypatch):
    """2 GPUs at tensor_parallel 1: two engine processes (spawned), each
    with its own share; together every sample, once."""
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api", se.api_0_16)
    code, _, evs = run_body(tmp, "extract", extract.body, config(devices=(0, 1)))
    assert code == 0, [e for e in evs if e["type"] == "error"]
    assert finished(evs)["summary"]["computed"] == N and len(hs_files(rd)) == N
    ends = [i for i, e in enumerate(evs) if e["type"] == "stage_finished"]
    start = ends[-2] + 1 if len(ends) > 1 else 0   # this attempt's events
    kv = [e for e in evs[start:] if e["type"] == "kv_cache"]
    assert sorted(e["server"] for e in kv) == [0, 1] and [e["devices"] for e in
                                                         sorted(kv, key=lambda e: e["server"])] \
        == [[0], [1]]
    check_against_hf(rd, [0, 5, N - 1])


def test_the_decoder_is_found_through_multimodal_wrappers():
    import torch.nn as nn

    from pipeline.extract.vllm_capture import CaptureError, find_base_model

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.layers = nn.Embedding(4, 2), nn.ModuleList()

    class LM(nn.Module):   # XForCausalLM: the decoder under .model
        def __init__(self):
            super().__init__()
            self.model = Decoder()

    class Wrapper(nn.Module):   # Kimi-K2.5 / Qwen-VL style: the LM behind get_language_model()
        def __init__(self):
            super().__init__()
            self.vision, self.lm = nn.Linear(2, 2), LM()

        def get_language_model(self):
            return self.lm
    w = Wrapper()
    assert find_base_model(w) is w.lm.model and find_base_model(w.lm) is w.lm.model
    with pytest.raises(CaptureError, match="Linear"):
        find_base_model(nn.Linear(2, 2))


def test_engines_fed_by_the_shared_queue_of_the_nodes(prepared, monkeypatch, tmp_path):
    """The engine loop fed chunk by chunk from the queue that nodes share
    (pipeline.cluster.workqueue), as on each node of a multi-node extract: two engine
    processes (2 GPUs), each its own place in the queue, no rows given up
    front; every sample once, the hf backend's numbers."""
    from pipeline.cluster.workqueue import WorkQueue, plan_chunks
    tmp, rd = prepared
    monkeypatch.setattr(vllm_compat, "load_engine_api", se.api_0_16)
    real = extract.backend_runner
    seen = {}

    def fed(name):
        def run(job):
            qdir = tmp_path / "queue"
            WorkQueue.create(qdir, plan_chunks(job.todo, job.lengths, 2, chunk_samples=2))
            seen["rows"] = sorted(job.todo)
            job.todo, job.feed = [], WorkQueue(qdir, "node0", 30.0)
            return real(name)(job)
        return run

    monkeypatch.setattr(extract, "backend_runner", fed)
    code, _, evs = run_body(tmp, "extract", extract.body, config(devices=(0, 1)))
    assert code == 0, [e for e in evs if e["type"] == "error"]
    assert seen["rows"] == list(range(N)) and len(hs_files(rd)) == N
    q = WorkQueue(tmp_path / "queue", "observer")
    assert q.remaining_rows() == 0
    # Each chunk claimed once (generation 0), by the engines' own places in
    # the queue (how many each took depends on which engine came up first).
    owners = q.owners()
    assert len(owners) == len(q.chunks) and {g for g, _ in owners.values()} == {0}
    assert {w for _, w in owners.values()} <= {"node0.0", "node0.1"}
    check_against_hf(rd)
