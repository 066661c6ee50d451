"""The vLLM route against the real vLLM of this machine: vLLM 0.32's CPU
build in .venv-vllm (scripts/install.sh). Skipped, with the reason, only
when no usable vLLM is installed; CI installs it, so there these run.

One module-wide run extracts the tiny target's hidden states through a real
`vllm serve` and eagle-panel's connector: the server is SIGKILLed mid-way
(the stage fails quoting why, finished files stay), the stage is resumed to
the end, and then everything else is checked on what it left: the files
against the hf backend's (float32, different kernels: close, not equal),
the KV-cache events from the real log and /metrics, the KV tab showing
them, doctor's predicted adaptations against the ones that fired, and that
no vLLM process is left."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.paths import VLLM_VENV
from pipeline.run.plans import read_kv
from pipeline.run.proctree import environ, live_pids
from pipeline.run.rundir import RunDir
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.server import SERVER_TOKEN_VAR
from tests.configs import merged, render, write
from tests.helpers import (
    ROOT,
    finished,
    hs_files,
    kv_tab_text,
    prepared_once,
    select_stage,
    wait_for,
)

N = 24
PY = VLLM_VENV / "bin" / "python"


CONFIG = {"data": {"max_samples": N},
          "stages": {"extract": {"backend": "auto", "layer_ids": [1, 2, 3], "max_inflight": 2},
                     "vocab": {"draft_vocab_size": 256}}}


def server_pids() -> list[int]:
    """Live processes of any vLLM server this test session's stages started."""
    mine, token = f"RUN_OF={os.getpid()}".encode(), f"{SERVER_TOKEN_VAR}=".encode()
    return [pid for pid in live_pids()
            if mine in (env := environ(pid)) and any(e.startswith(token) for e in env)]


def stage(tmp, name="extract", config=CONFIG, run="r"):
    """The real stage, as the runner starts it: its own process."""
    write(tmp / "config.toml", config)
    return subprocess.Popen(
        [sys.executable, "-m", f"pipeline.stages.{name}", "--run-dir", str(tmp / run),
         "--config", str(tmp / "config.toml")],
        env=dict(os.environ, PYTHONPATH=str(ROOT), RUN_OF=str(os.getpid())),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def extracted(vllm_env, tmp_path_factory):
    from pipeline.run.events import read_events
    tmp, rd = prepared_once(tmp_path_factory, "real_vllm", render(CONFIG))
    t0 = time.monotonic()
    # 1. Start, and SIGKILL the server's whole tree once a few files are written.
    p = stage(tmp)
    wait_for(lambda: len(hs_files(rd)) >= 3 or p.poll() is not None, timeout=300, poll=0.02,
             what="3 files from the real server")
    for pid in server_pids():
        os.kill(pid, signal.SIGKILL)
    out1 = p.communicate(timeout=120)[0]
    first = read_events(rd.events_path("extract"))
    kept = len(hs_files(rd))
    first_s = time.monotonic() - t0
    # 2. Resume to the end.
    p = stage(tmp)
    out2 = p.communicate(timeout=600)[0]
    return {"tmp": tmp, "rd": rd, "code1": None, "out1": out1, "out2": out2, "code2": p.returncode,
            "first": first, "kept": kept, "events": read_events(rd.events_path("extract")),
            "first_s": first_s}


def test_killed_server_is_reported_and_resume_completes(extracted):
    x = extracted
    errors = [e for e in x["first"] if e["type"] == "error"]
    assert errors, x["out1"]
    msg = errors[-1]["message"]
    assert "vLLM server 0" in msg and "killed by SIGKILL" in msg, msg
    assert 3 <= x["kept"] < N
    assert x["code2"] == 0, x["out2"]
    summary = finished(x["events"])["summary"]
    assert summary["backend"] == "vllm-server"
    assert summary["reused"] == x["kept"] and summary["computed"] == N - x["kept"]
    assert len(hs_files(x["rd"])) == N
    wait_for(lambda: not server_pids(), timeout=30, what="no vLLM process left")
    assert not list((x["rd"].out_dir("extract") / "hidden_states").glob(".*"))


def test_real_files_match_the_hf_backend(extracted):
    """Same prepared samples through transformers: float32 on both sides,
    other kernels (vLLM's CPU attention), so close rather than equal."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from pipeline.builtin.tiny_model import ensure_built
    from pipeline.extract.hf import HFBackend
    rd = extracted["rd"]
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    ref = HFBackend.load(ensure_built(), [1, 2, 3, 4], "cpu", torch.float32)
    worst_abs = worst_rel = 0.0
    for i in range(N):
        got = load_file(str(rd.out_dir("extract") / f"hidden_states/hs_{i}.safetensors"))
        ids = ds[i]["input_ids"]
        assert got["token_ids"].tolist() == ids and got["hidden_states"].dtype == torch.float32
        want = ref.forward([ids])[0]
        diff = (got["hidden_states"] - want).abs()
        worst_abs = max(worst_abs, diff.max().item())
        worst_rel = max(worst_rel, (diff / want.abs().clamp_min(1e-2)).max().item())
    print(f"real vLLM vs hf over {N} samples: max abs {worst_abs:.2e}, max rel {worst_rel:.2e}")
    assert worst_abs < 1e-3 and worst_rel < 1e-2


def test_kv_events_come_from_the_real_server(extracted):
    events = extracted["events"]
    kv = [e for e in events if e["type"] == "kv_cache"]
    assert kv and kv[-1]["source"] == "log+metrics" and kv[-1]["pool"] == "CPU"
    assert kv[-1]["tokens_capacity"] > 10_000 and kv[-1]["max_concurrency"] > 1
    log = (extracted["rd"].path / "extract" / "vllm-0.log").read_text()
    assert f"{kv[-1]['tokens_capacity']:,} tokens" in log   # the real line, parsed
    # /metrics' vllm:cache_config_info: blocks, their size and bytes, the dtype (with
    # extract_hidden_states a token also holds its hidden states: fewer tokens than slots)
    k = kv[-1]
    assert k["tokens_capacity"] <= k["num_blocks"] * k["block_size"]
    assert k["bytes_per_block"] * k["num_blocks"] == k["total_bytes"] and k["cache_dtype"]
    # the server's KV plan (pipeline.vllm.kv_plan) against what vLLM made of it: the
    # bytes a token takes (K,V + the captured hidden states) are vLLM's own, and the
    # space the panel gave it (VLLM_CPU_KVCACHE_SPACE) is the cache vLLM allocated
    plan = read_kv(k["planned"])
    assert plan.where == "cpu" and plan.bytes_per_token == k["bytes_per_block"] // k["block_size"]
    assert k["num_blocks"] == plan.space_bytes // k["bytes_per_block"]
    assert abs(plan.tokens - k["num_blocks"] * k["block_size"]) < k["block_size"]
    usage = [e for e in events if e["type"] == "kv_usage"]
    assert usage and all(0.0 <= u["usage_perc"] <= 1.0 for u in usage)


async def test_kv_tab_shows_the_real_report(extracted):
    from app.panel import PanelApp
    from pipeline.telemetry import Telemetry
    rd = RunDir(extracted["rd"].path)
    kv = [e for e in extracted["events"] if e["type"] == "kv_cache"][-1]
    app = PanelApp(rd, telemetry=Telemetry(simulate=0, host=False), interval=3600)
    async with app.run_test(size=(100, 30)) as pilot:
        await select_stage(app, pilot, "extract")   # the tab is the selected stage's
        text = await kv_tab_text(app, pilot)
    # the server has stopped: its allocation stays, its live use is history, not shown
    assert f"{kv['tokens_capacity']:,}" in text and "live use" not in text
    assert "log+metrics, CPU memory" in text and f"{kv['max_concurrency']:.2f}x" in text
    # the plan beside the allocation: the space given, all of it made into slots
    plan = read_kv(kv["planned"])
    assert f"~{plan.tokens:,} tokens: {plan.space_gib} GiB for {plan.requests} x" in text, text
    # nothing the server reports is shown as "-"
    for row in ("blocks", "bytes per block", "total", "bytes per token", "cache dtype"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(row))
        assert not line.rstrip().endswith(" -"), line
    assert f"{kv['num_blocks']:,} x {kv['block_size']} tokens" in text


def test_doctor_predicts_the_adaptations_that_fired(extracted, vllm_env):
    from pipeline import config as config_mod
    from pipeline import doctor
    cfg = config_mod.load(extracted["tmp"] / "config.toml")
    findings = doctor.diagnose(cfg, gpus=None)
    predicted = {f.key for f in findings if f.area == "compat" and f.key}
    fired = set(finished(extracted["events"])["summary"]["adaptations"])
    assert predicted == fired == {"own_connector", "write_lock", "vllm_cpu_dist"}
    backends = " ".join(f.message for f in findings if f.area == "backends")
    assert '"auto" -> vllm-server' in backends and not doctor.blocking(findings)
    assert any(f.area == "vllm" and "0.32.0+cpu" in f.message for f in findings)


def test_a_server_that_cannot_start_is_quoted(vllm_env, tmp_path):
    """A real start failure: a max length past what the model allows."""
    from pipeline.run.events import read_events
    tmp, rd = tmp_path, RunDir(tmp_path / "r")
    bad = merged(CONFIG, {"stages": {"extract": {"server_args": ["--max-model-len", "100000"]}}})
    p = stage(tmp, "prepare", bad)
    assert p.wait(timeout=300) == 0
    p = stage(tmp, "extract", bad)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 1, out
    err = [e for e in read_events(rd.events_path("extract")) if e["type"] == "error"][-1]
    assert "exited with code 1 while starting" in err["message"], err
    assert "max_model_len" in err["message"] and "nanobind" not in err["message"]
    assert "doctor" in err["hint"] and not hs_files(rd)
    wait_for(lambda: not server_pids(), timeout=30, what="no vLLM process left")


@pytest.fixture(scope="module")
def served(vllm_env, tmp_path_factory):
    """One real server for the tests that only talk to one (each start is
    ~45 s on 2 cores): the built-in target laid out as a Hugging Face cache
    snapshot (blobs, the snapshot's files links to them: what a hub id
    resolves to), with evaluate's draft-swap flags and development routes
    (draft_swap: the run's key on them). vLLM 0.32 serves
    /v1/chat/completions/render only with --enable-scale-out."""
    from pipeline.vllm import draft_swap
    from pipeline.vllm.server import make_server, serving
    from tests.unit.test_hub_targets import REPO, SHA_A, lay_out, target_files
    tmp = tmp_path_factory.mktemp("served")
    snap = lay_out(tmp / "hf-cache", REPO, SHA_A, target_files())
    server = make_server(0, vllm_env, snap, [], tmp / "vllm.log", "float32", 512, False,
                         ["--enable-scale-out", *draft_swap.SERVER_FLAGS], kv_tokens=2048,
                         kv_bytes_per_token=1 << 14, extra_env=draft_swap.SERVER_ENV)
    with serving(server, 600, lambda: False) as s:
        s.snapshot = snap
        yield s


def test_the_real_vllm_serves_a_hub_snapshot_from_the_cache(served):
    """A hub id resolves to a snapshot folder of links into blobs (the
    resolution: tests/unit/test_hub_targets.py); vLLM loads and serves it."""
    assert (served.snapshot / "config.json").is_symlink()
    out = served.post(vs.ROUTE_COMPLETIONS, {"model": str(served.snapshot), "prompt": "Hello",
                                             "max_tokens": 4, "temperature": 0.0}, 120)
    assert out["choices"][0]["text"], out


def test_the_development_routes_want_the_runs_key(served):
    """/collective_rpc calls any worker method and vLLM's own key check leaves
    it open: route_guard refuses it without the run's key, even from this
    machine; with the key, our worker extension answers (this server has no
    draft: nothing to swap, said)."""
    import urllib.error
    import urllib.request

    from pipeline.vllm import draft_swap
    from pipeline.vllm.swap_worker import METHOD
    for route in (vs.ROUTE_COLLECTIVE_RPC, vs.ROUTE_RESET_PREFIX_CACHE):
        req = urllib.request.Request(served.url + route, data=json.dumps(
            {"method": "get_model"}).encode(), headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 401, route
    with urllib.request.urlopen(served.url + vs.ROUTE_HEALTH, timeout=10) as r:
        assert r.status == 200   # the read-only ones stay open
    r = served.post(vs.ROUTE_COLLECTIVE_RPC, {"method": METHOD, "args": ["/nowhere"]}, 60)
    assert r == {"results": [{"error": "this server has no draft model"}]}
    with pytest.raises(draft_swap.SwapFailed, match="no draft model"):
        draft_swap.swap(served, Path("/nowhere"), 60)
    assert served.post(vs.ROUTE_RESET_PREFIX_CACHE, {}, 60) == {"success": True}


def test_servers_listen_on_loopback_only_and_want_the_runs_key(served):
    """Another account on a shared GPU server can neither reach the server
    from the network nor use it from this machine without the run's key,
    and cannot read the key off the process list."""
    import socket
    import urllib.error
    import urllib.request

    s = served
    port = int(s.url.rsplit(":", 1)[1])
    req = urllib.request.Request(s.url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 401
    req.add_header("Authorization", f"Bearer {s.api_key}")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    # not on the machine's other addresses
    hostname_ip = socket.gethostbyname(socket.gethostname())
    if not hostname_ip.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((hostname_ip, port), timeout=3).close()
    listening = open("/proc/net/tcp").read().splitlines()[1:]
    ours = [ln.split()[1] for ln in listening if ln.split()[1].endswith(f":{port:04X}")
            and ln.split()[3] == "0A"]
    assert ours == [f"0100007F:{port:04X}"], ours   # 127.0.0.1 only
    # the key is in no command line (`ps` shows them to every user)
    for pid in [s.proc.pid, *server_pids()]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert s.api_key.encode() not in f.read()


def test_the_real_server_keeps_its_sockets_in_a_folder_of_its_own(served):
    """vLLM binds its ZMQ IPC sockets under VLLM_RPC_BASE_PATH and leaves them
    in the temporary directory when signalled: the server's own folder
    (pipeline.vllm.scratch) holds them, and goes at its stop (the stop:
    tests/integration/test_server_scratch.py)."""
    import stat
    folder = served.scratch
    sockets = [p.name for p in folder.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert sockets, sorted(p.name for p in folder.iterdir())
    assert len(str(folder / sockets[0])) < 107   # a unix socket's path limit


def test_the_real_server_renders_tool_conversations_as_prepare_does(served):
    """Agentic rows (tools, tool_calls with content null, tool turns) and a
    conversation the assistant opens, through vLLM's own render endpoint:
    the same token ids and loss masks as prepare's local renderer. And the
    request regenerate sends with tools (tool_choice "none", no tool parser
    on the server) is accepted, its prompt rendered with the tools."""
    from transformers import AutoTokenizer

    from pipeline.builtin.tiny_model import ensure_built
    from pipeline.data.chat_mask import EndpointRenderer, LocalRenderer, normalize, wire_messages
    from tests.data_corpus import AGENTIC, AGENTIC_STRING_ARGS
    tok = AutoTokenizer.from_pretrained(str(ensure_built()))
    opening = {"messages": [{"role": "assistant", "content": "Welcome back!"},
                            {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "Hello."}]}
    rows = [normalize(r)[1:] for r in (AGENTIC, AGENTIC_STRING_ARGS, opening)]
    s = served
    remote = EndpointRenderer(s.url, 60, api_key=s.api_key)
    local = LocalRenderer(tok)
    for msgs, tools in rows:
        a, b = local.rows(msgs, tools), remote.rows(msgs, tools)
        assert [(r.input_ids, r.loss_mask) for r in a] == \
            [(r.input_ids, r.loss_mask) for r in b], msgs
    msgs, tools = rows[0]
    resp = s.post("/v1/chat/completions",
                  {"model": str(s.snapshot), "messages": wire_messages(msgs[:3]),
                   "max_tokens": 4, "temperature": 0.0, "return_token_ids": True, "tools": tools,
                   "tool_choice": "none"}, 120)
    want = tok(local.text(msgs[:3], True, tools), add_special_tokens=False)["input_ids"]
    assert resp["prompt_token_ids"] == want
