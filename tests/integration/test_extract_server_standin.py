"""The vllm-server extract backend against tests/fakes/standin_vllm.py, a
STAND-IN for `vllm serve`, for what a real vLLM on this CPU machine cannot
show: GPU servers in data parallel (TP groups), the stock connector of
vLLM 0.17-0.28 (GPU only), a death by SIGILL. The installed vLLM the stage
reads is a STAND-IN too (tests/fakes/installed_vllm.py: real source files
of that release, nothing that serves). The stand-in's hidden states come
from a real forward of the tiny target, so files are checked against the
hf backend's numbers. The real vLLM's tests: tests/vllm/test_vllm_real.py."""

import os
import stat
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.builtin.tiny_model import ensure_built
from pipeline.extract.hf import HFBackend
from pipeline.run.proctree import environ, live_pids
from pipeline.stages import extract
from pipeline.vllm.server import SERVER_TOKEN_VAR
from tests.configs import render
from tests.fakes import installed_vllm
from tests.helpers import assert_forward_matches, finished, hs_files, prepared_once, run_body

STANDIN = Path(__file__).resolve().parents[1] / "fakes" / "standin_vllm.py"
N = 12
# Servers inherit this, so a check for leftovers sees only this session's
# (another test session on the machine has its own).
MARK = f"EAGLE_PANEL_TEST_SESSION={os.getpid()}"
os.environ["EAGLE_PANEL_TEST_SESSION"] = str(os.getpid())


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory):
    """{version: interpreter whose envprobe sees a stand-in installed vLLM}."""
    base = tmp_path_factory.mktemp("installed_vllm")
    out = {}
    for version in ("0.22.0", "0.17.0", "0.33.0"):
        site = installed_vllm.make(base / version, version)
        py = base / f"python-{version}"
        py.write_text(f"#!/bin/sh\nPYTHONPATH={site}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
        py.chmod(py.stat().st_mode | stat.S_IEXEC)
        out[version] = py
    return out


def config(*server_args: str, tp: int = 1, vllm: Path | None = None,
           devices: tuple[int, ...] = (0,), **extract) -> str:
    """The stand-in server's extract; `extract`: more of its keys."""
    return render({"data": {"max_samples": N}, "gpus": {"devices": devices},
                   **({"runtime": {"vllm_python": str(vllm)}} if vllm else {}),
                   "stages": {"extract": {
                       "backend": "vllm-server", "layer_ids": [1, 2, 3],
                       "serve_command": f"{sys.executable} {STANDIN}",
                       "server_args": server_args, "startup_timeout_s": 120.0,
                       "max_inflight": 3, "tensor_parallel": tp, **extract}}})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepared_once(tmp_path_factory, "vllm_prepared", render({"data": {"max_samples": N}}))


@pytest.fixture(autouse=True)
def clean_extract(request, monkeypatch):
    """Each test starts with no hidden-state files, no server logs and no
    adaptations recorded (a stage process starts with none)."""
    from pipeline.vllm import compat
    monkeypatch.setattr(compat, "_fired", {})
    if "prepared" in request.fixturenames:
        _, rd = request.getfixturevalue("prepared")
        for f in hs_files(rd):
            f.unlink()
        for f in (rd.path / "extract").glob("vllm*.log"):
            f.unlink()


def no_server_left() -> bool:
    """No live process of this session carries a server token (the stand-in
    and its child)."""
    token = f"{SERVER_TOKEN_VAR}=".encode()
    return not any(MARK.encode() in (env := environ(pid)) and any(e.startswith(token) for e in env)
                   for pid in live_pids())


@pytest.mark.parametrize("version", ["0.22.0", "0.17.0", "0.33.0"])
def test_server_route_writes_the_hf_numbers_and_stops_the_server(prepared, fake_vllm, version):
    """0.17 and 0.22: vLLM's stock connector (a file per request id, moved
    into place); 0.33: eagle-panel's connector (hs_{i} written directly)."""
    from datasets import load_from_disk
    from safetensors.torch import load_file
    tmp, rd = prepared
    code, _, evs = run_body(tmp, "extract", extract.body,
                            config("--standin-version", version, "--standin-worker",
                                   vllm=fake_vllm[version]))
    assert code == 0, [e for e in evs if e["type"] == "error"]
    summary = finished(evs)["summary"]
    assert summary["computed"] == N and len(hs_files(rd)) == N
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    ref = HFBackend.load(ensure_built(), [1, 2, 3, 4], "cpu", torch.float32)
    for i in (0, 5, N - 1):
        ids = ds[i]["input_ids"]
        got = load_file(str(rd.out_dir("extract") / f"hidden_states/hs_{i}.safetensors"))
        assert got["hidden_states"].dtype == torch.bfloat16
        assert got["token_ids"].tolist() == ids
        want = ref.forward([ids])[0].to(torch.bfloat16)
        assert_forward_matches(got["hidden_states"], want)
    kv = [e for e in evs if e["type"] == "kv_cache"]
    assert kv and kv[0]["source"] == "log" and kv[0]["tokens_capacity"] == 116_480
    assert kv[0]["total_bytes"] == int(12.5 * (1 << 30)) and kv[0]["max_concurrency"] > 0
    own = version == "0.33.0"
    staging = rd.out_dir("extract") / ".staging"
    assert not staging.exists() or not list(staging.rglob("*"))   # nothing left staged
    assert not list((rd.out_dir("extract") / "hidden_states").glob("*.lock"))
    assert no_server_left()  # the server and its worker child are gone
    log = (rd.path / "extract" / "vllm-0.log").read_text()
    assert "extract_hidden_states" in log
    assert ("HiddenStatesConnector" if own else "ExampleHiddenStatesConnector") in log
    summary = finished(evs)["summary"]
    assert ("own_connector" in summary["adaptations"]) is own
    assert ("write_lock" in summary["adaptations"]) is (version != "0.17.0")


def test_server_killed_by_sigill_while_starting_is_named(prepared, fake_vllm):
    """A vLLM build for CPU instructions this machine lacks dies by SIGILL
    with nothing in its log: the error says what that means."""
    tmp, rd = prepared
    t0 = time.monotonic()
    code, _, evs = run_body(tmp, "extract", extract.body,
                            config("--standin-sigill", vllm=fake_vllm["0.33.0"]))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "was killed by SIGILL" in err["message"]
    assert "CPU instructions this machine lacks" in err["message"]
    assert "about to die by SIGILL" in err["message"]   # the last log lines, at least
    assert time.monotonic() - t0 < 60 and no_server_left()


def test_server_dying_mid_run_keeps_finished_files_and_resume_completes(prepared, fake_vllm):
    tmp, rd = prepared
    code, _, evs = run_body(tmp, "extract", extract.body,
                            config("--standin-die-after", "5", "--standin-worker",
                                   vllm=fake_vllm["0.22.0"]))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "exited with code 3" in err["message"]
    assert "EngineCore died" in err["message"]
    kept = len(hs_files(rd))
    assert 1 <= kept <= 5 and no_server_left()
    code, _, evs = run_body(tmp, "extract", extract.body, config(vllm=fake_vllm["0.22.0"]))
    summary = finished(evs)["summary"]
    assert code == 0 and summary["reused"] == kept and summary["computed"] == N - kept
    assert len(hs_files(rd)) == N


def test_data_parallel_servers_share_the_samples(prepared, fake_vllm):
    """[gpus] 0-3 with tensor_parallel = 2: two servers, on GPUs 0,1 and 2,3,
    pulling from one queue. (The stand-in ignores the GPUs; the stage only
    hands them over.)"""
    tmp, rd = prepared
    cfg = config(tp=2, vllm=fake_vllm["0.33.0"], devices=(0, 1, 2, 3))
    code, _, evs = run_body(tmp, "extract", extract.body, cfg)
    assert code == 0, [e for e in evs if e["type"] == "error"]
    assert len(hs_files(rd)) == N
    served = []
    for k, gpus in ((0, "0,1"), (1, "2,3")):
        log = (rd.path / "extract" / f"vllm-{k}.log").read_text()
        served.append(log.count("Received request"))
        assert f"CUDA_VISIBLE_DEVICES={gpus})" in log
    assert sum(served) == N and min(served) >= 1, served
    kv = {e["server"]: e for e in evs if e["type"] == "kv_cache"}
    assert set(kv) == {0, 1} and kv[1]["devices"] == [2, 3]
    assert no_server_left()
    from pipeline.config import ConfigError, parse
    with pytest.raises(ConfigError, match="tensor_parallel` = 3 does not divide the 4 GPUs"):
        parse(config(tp=3, devices=(0, 1, 2, 3)))


def test_serve_command_line_carries_the_extraction_settings(tmp_path):
    import json

    from pipeline.extract.server_flags import extraction_flags
    from pipeline.vllm.server import serve_argv
    extra = extraction_flags([2, 30, 58, 61], tmp_path, True) + ["--gpu-memory-utilization", "0.9"]
    argv = serve_argv("/opt/env/bin/python", "", Path("/models/kimi"), 8001, 8, "bfloat16",
                      4104, True, extra)
    assert argv[:5] == ["/opt/env/bin/python", "-m", "pipeline.vllm.launch", "serve",
                        "/models/kimi"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--api-key" not in argv   # ps shows argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2, 30, 58, 61]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "HiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "pipeline.vllm.connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert "--trust-remote-code" in argv and "--no-enable-chunked-prefill" in argv
    assert "--enforce-eager" not in argv     # a GPU server keeps vLLM's compile
    assert argv[-2:] == ["--gpu-memory-utilization", "0.9"]
    stock = json.loads(extraction_flags([1], tmp_path, False)[-1])
    assert stock["kv_connector"] == "ExampleHiddenStatesConnector"
    assert "kv_connector_module_path" not in stock
    cpu = serve_argv("py", "", Path("/m"), 1, 1, "float32", 16, False, [], eager=True)
    assert "--enforce-eager" in cpu


def test_stock_connector_file_is_trimmed_converted_and_checked(tmp_path):
    """A stock connector file with one position more than the prompt (the
    output token) in float32 is written as the prompt's positions in bf16."""
    from types import SimpleNamespace

    from safetensors.torch import load_file, save_file

    from pipeline.extract.vllm_server import take_staged
    from pipeline.stage_error import StageError
    job = SimpleNamespace(layer_ids=[1, 2], hidden=8, dtype=torch.bfloat16, fp8=False)
    ids = [5, 6, 7]
    hs = torch.randn(4, 2, 8)
    src = tmp_path / "cmpl-1.safetensors"
    save_file({"hidden_states": hs, "token_ids": torch.tensor(ids + [9])}, str(src))
    final = tmp_path / "hs_0.safetensors"
    take_staged(src, final, ids, job)
    got = load_file(str(final))
    assert got["token_ids"].tolist() == ids and got["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(got["hidden_states"], hs[:3].to(torch.bfloat16)) and not src.exists()
    save_file({"hidden_states": hs, "token_ids": torch.tensor([5, 6, 8, 9])}, str(src))
    with pytest.raises(StageError, match="token ids that differ"):
        take_staged(src, final, ids, job)


def test_server_route_stops_before_the_disk_fills(prepared, fake_vllm):
    tmp, rd = prepared
    code, _, evs = run_body(tmp, "extract", extract.body,
                            config(vllm=fake_vllm["0.33.0"], min_free_gb=100000.0))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "stopped before the disk fills" in err["message"]
    assert "resume" in err["hint"] and not hs_files(rd) and no_server_left()
