"""The whole pipeline through the real vLLM of this machine (.venv-vllm):
regenerate (the target answers the user turns) and extract on one server
(share_server), prepare, vocab, train, evaluate (the trained draft served as
EAGLE-3: acceptance length from the real /metrics; both checkpoints on one
server, the second swapped in), with kills: regenerate SIGKILLed after its first chunk and evaluate while
it measures the baseline, each resumed, redoing only what was not finished,
with no server left behind. A swapped draft measured against a fresh server
of it. Skipped, with the reason, when no usable vLLM is installed. Without
one, regenerate and evaluate are skipped (not failed) and say why — tested
with an interpreter that has none."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from pipeline.paths import VLLM_VENV
from pipeline.run.rundir import RunDir
from pipeline.vllm.environment import probe
from tests.configs import merged, render, tiny_pipeline, write
from tests.helpers import ROOT, cli, finished, run_body, stage_summary, wait_for
from tests.vllm.test_vllm_real import server_pids

PY = VLLM_VENV / "bin" / "python"
# the module's run (regenerate killed and resumed, then evaluate killed and resumed, each
# through real servers) is set up inside its first test: 601 s on a loaded fresh clone
# (2026-12-07), past pytest's default 600
pytestmark = pytest.mark.timeout(1800)

CONFIG = tiny_pipeline("p", 48, stages={
    "regenerate": {"enabled": True, "max_tokens": 64, "share_server": True, "chunk_size": 8},
    "evaluate": {"checkpoints": "all"}}, tracking={"loggers": ["tensorboard", "mlflow"]})


def kill_stage(rd: RunDir, stage: str) -> None:
    """SIGKILL a stage that must still be running, and check the kill is what
    ended it: a stage that finished first would test no kill at all, and is
    said plainly (never a ProcessLookupError, never a signal to a reused group)."""
    st = rd.read_state()["stages"][stage]
    assert st["status"] == "running", f"{stage} ended before the kill: {st}"
    try:
        os.killpg(st["pgid"], signal.SIGKILL)
    except ProcessLookupError:
        pass   # it ended between the read and the kill: the state says how
    wait_for(lambda: rd.read_state()["stages"][stage]["status"] != "running", timeout=60,
             what=f"{stage} to be recorded as ended")
    assert rd.read_state()["stages"][stage]["signal"] == "SIGKILL", f"{stage} ended first"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not PY.exists() or probe(str(PY)).unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    tmp = tmp_path_factory.mktemp("pipeline")
    write(tmp / "config.toml", CONFIG)
    env = dict(os.environ, RUN_OF=str(os.getpid()))
    rd = RunDir(tmp / "runs" / "p")
    seen = {}
    # 1. regenerate: SIGKILL once its first chunk is saved; resume.
    cli("run", cwd=tmp, check=0, env=env)
    chunk = rd.out_dir("regenerate") / ".chunks-8" / "chunk_000000.json"
    wait_for(chunk.exists, timeout=600, poll=0.05, what="regenerate's first chunk")
    seen["chunk_mtime"] = chunk.stat().st_mtime_ns
    kill_stage(rd, "regenerate")
    # the server regenerate shared: the driver's, stopped as its run ended (regenerate failed)
    wait_for(lambda: not server_pids(), timeout=60, what="the shared server gone")
    # 2. resume; SIGKILL evaluate once both checkpoints are measured (the second
    # swapped into the first one's server) and the baseline is being measured;
    # resume to the end: only the baseline is measured again.
    cli("resume", cwd=tmp, check=0, env=env)
    out = rd.out_dir("evaluate")
    wait_for((out / "checkpoints" / "1.json").exists, timeout=1200, poll=0.05,
             what="evaluate's second measurement")
    seen["measured"] = {n: (out / "checkpoints" / f"{n}.json").read_text() for n in "01"}
    kill_stage(rd, "evaluate")
    assert not (out / "baseline.json").exists(), "the baseline was measured before the kill"
    wait_for(lambda: not server_pids(), timeout=30, what="the evaluate servers gone")
    p = cli("resume", "--wait", cwd=tmp, timeout=1200, env=env)
    seen["wait_out"] = p.stdout
    assert p.returncode == 0, p.stdout + p.stderr
    seen["results"] = (out / "results.json").read_text()
    return tmp, rd, seen


def test_regenerate_resumed_from_its_chunks(run):
    tmp, rd, seen = run
    chunk = rd.out_dir("regenerate") / ".chunks-8" / "chunk_000000.json"
    assert chunk.stat().st_mtime_ns == seen["chunk_mtime"]   # not redone
    s = stage_summary(rd, "regenerate")
    assert s["conversations"] == 48 and s["failed"] == 0 and s["rows"] >= 48
    rows = [json.loads(line) for line in open(rd.out_dir("regenerate") / "rows.jsonl")]
    assert len(rows) == s["rows"]
    for r in rows[:20]:
        assert len(r["input_ids"]) == len(r["loss_mask"]) and sum(r["loss_mask"]) > 0
        assert r["messages"][-1]["role"] == "assistant"
    # prepare read the target's answers
    assert stage_summary(rd, "prepare")["rows_in"] == s["rows"]
    # both attempts of regenerate, and extract, on a server the driver started; the
    # resumed one regenerated only the chunks left (6 chunks of 8)
    log = rd.log_path("regenerate").read_text()
    assert log.count("on the run's shared server") == 2, log
    assert re.search(r"resuming, [1-5]/6 chunks already done", log), log
    assert "on the run's shared server" in rd.log_path("extract").read_text()
    assert rd.read_state()["shared_server"]["status"] == "stopped"
    assert not [p for p in (rd.out_dir("extract") / "hidden_states").iterdir()
                if not p.name.startswith("hs_")]


def test_doctor_planned_the_kv_space_the_shared_server_was_given(run):
    """doctor's KV plan for this config (pipeline/doctor/plans.py) is the one
    the driver's shared server was started with and reported beside vLLM's
    allocation (the kv_cache event's `planned`), and vLLM's bytes a token are
    the plan's."""
    from pipeline import control
    from pipeline.doctor.plans import cpu_kv_finding, extract_cpu_plan
    from pipeline.model.info import read_model, validate_layer_ids
    from pipeline.run.events import read_events
    from pipeline.run.plans import read_kv
    tmp, rd, _ = run
    cfg = control.load_config(tmp / "config.toml")
    m = read_model(cfg.target_path())
    doctors, keys = extract_cpu_plan(m, cfg, validate_layer_ids(
        list(cfg.stages.extract.layer_ids), m.layers))
    (kv, *_) = [e for e in read_events(rd.events_path("extract")) if e["type"] == "kv_cache"]
    served = read_kv(kv["planned"])
    assert (served.requests, served.max_len, served.bytes_per_token, served.space_gib) == \
        (doctors.requests, doctors.max_len, doctors.bytes_per_token, doctors.space_gib)
    assert served.bytes_per_token == kv["bytes_per_block"] // kv["block_size"]
    assert f"VLLM_CPU_KVCACHE_SPACE={served.space_gib} GiB for {served.requests} requests" \
        in cpu_kv_finding(doctors, keys).message


def test_evaluate_measured_every_checkpoint_on_one_server_and_resumed(run):
    tmp, rd, seen = run
    results = json.loads(seen["results"])
    assert set(results["checkpoints"]) == {"0", "1"}
    # The measurements saved before the kill were kept, not redone.
    for n in "01":
        assert json.loads(seen["measured"][n]) == results["checkpoints"][n]
    # checkpoint 1 loaded into checkpoint 0's server, its log saying so
    assert results["checkpoints"]["0"]["served_by"] == "a new server"
    assert results["checkpoints"]["1"]["served_by"] == "swapped into the running server"
    log = (rd.stage_dir("evaluate") / "stage.log").read_text()
    assert "checkpoint 1 loaded into the running server" in log
    # the resumed attempt started the baseline's server only
    assert results["servers"] == {"target_loads": 1, "swaps": 0, "restarts": [],
                                  "one_server": "yes"}
    for name, m in results["checkpoints"].items():
        assert m["drafts"] > 0 and m["draft_tokens"] == 3 * m["drafts"]
        assert 1.0 <= m["acceptance_length"] <= 4.0
        assert len(m["per_position"]) == 3 and "--speculative-config" in m["vllm_command"]
        assert f"checkpoints/{name}" in m["vllm_command"] and "eagle3" in m["vllm_command"]
    assert results["baseline"]["decode_tokens_per_s"] > 0 and results["speedup"] > 0
    # the baseline's server started beside the first draft's (CPU only: BaselineAhead),
    # and was up before that draft's prompts went out
    events = [json.loads(x) for x in open(rd.events_path("evaluate"))]
    servers = [e for e in events if e["type"] == "server"]
    base = [e["t"] for e in servers if "no draft" in e["label"]]
    ready = [e["t"] for e in servers if "checkpoint" in e["label"] and e["phase"] == "ready"]
    assert base and ready and base[0] < ready[0], "the baseline's server was not started ahead"
    s = stage_summary(rd, "evaluate")
    last = results["checkpoints"]["1"]
    print(f"estimate {s['acceptance_estimate']:.3f} vs measured {s['acceptance_length']:.3f}, "
          f"per position {s['per_position']}, speedup {s['speedup']}")
    # train's estimate and vLLM's measurement of the same checkpoint agree
    assert abs(last["estimate"] - last["acceptance_length"]) / last["acceptance_length"] < 0.25
    assert "measured by vLLM" in seen["wait_out"] and "estimated by train" in seen["wait_out"]
    assert "evaluate: 1 of 2 checkpoints measured on a running server" in seen["wait_out"]
    assert f"to ship it: eagle-panel export {rd.id} " in seen["wait_out"]
    assert f"trackers: tensorboard --logdir {rd.path / 'tracking' / 'logs'}" \
        in seen["wait_out"]
    st = cli("status", cwd=tmp, check=0)
    assert "acceptance length" in st.stdout and "x" in st.stdout
    assert not server_pids()


def test_a_swapped_draft_measures_what_a_fresh_server_does(run):
    """bench/target_loads.py on this run's two checkpoints (its smallest size
    in CI): a server each, then both on one server, checkpoint 1 swapped in:
    greedy, the same prompts, the same accepted tokens in every request."""
    tmp, rd, seen = run
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "target_loads.py"), "--run-dir",
                        str(rd.path), "--config", str(tmp / "config.toml"), "--prompts", "12"],
                       cwd=tmp, capture_output=True, text=True, timeout=900, check=False)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from tests.bench.test_bench import CASES
    missing = [rx for rx in CASES["target_loads.py"].expect if not re.search(rx, p.stdout, re.M)]
    assert not missing, missing
    assert re.search(r"^before\s+server starts 2,", p.stdout, re.M)
    assert re.search(r"^after\s+server starts 1,", p.stdout, re.M)
    assert "drafts swapped in: 1" in p.stdout and "identical per request (greedy): True" in p.stdout
    assert not server_pids()


def test_trackers_hold_train_and_measured_and_export_ships_the_draft(run):
    """[tracking]: speculators' TensorBoard and MLflow loggers for train, and
    evaluate's measured acceptance in the same run, read back with the
    libraries' own readers; `export`: the served draft, d2t/t2d and a model
    card with the measured figures and the command that serves the folder."""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tmp, rd, seen = run
    results = json.loads(seen["results"])
    chosen = stage_summary(rd, "evaluate")["checkpoint"]
    m = results["checkpoints"][chosen]
    ea = EventAccumulator(str(rd.path / "tracking" / "logs" / rd.id))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    print("TensorBoard scalars:", ", ".join(f"{t} ({len(ea.Scalars(t))})" for t in sorted(tags)))
    assert "train/loss" in tags and "val/loss_epoch" in tags
    measured = {e.step: e.value for e in ea.Scalars("eval/acceptance_length")}
    assert measured[m["checkpoint"]["global_step"]] == pytest.approx(m["acceptance_length"])
    assert "eval/accept_rate_0" in tags
    mlflow.set_tracking_uri(f"sqlite:///{rd.path / 'tracking' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["eagle-panel"])
    assert runs["tags.mlflow.runName"].tolist() == [rd.id]   # one run: train's and evaluate's
    client = mlflow.MlflowClient()
    run_id = runs["run_id"][0]
    assert client.get_metric_history(run_id, "train/loss")
    hist = {x.step: x.value for x in client.get_metric_history(run_id, "eval/acceptance_length")}
    assert hist[m["checkpoint"]["global_step"]] == pytest.approx(m["acceptance_length"])
    # export: the default checkpoint is evaluate's choice; an unmeasured one is refused
    p = cli("export", "--checkpoint", "9", cwd=tmp, check=2)
    assert "not measured by evaluate (measured: 0, 1)" in p.stderr
    cli("export", cwd=tmp, check=0)
    out = rd.path / "export" / chosen
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert not (out / "optimizer_state_dict.pt").exists()
    assert (out / "d2t-256.npy").exists() and (out / "t2d-256.npy").exists()
    card = (out / "README.md").read_text()
    print(card)
    assert f"acceptance length **{m['acceptance_length']:.3f}**" in card
    assert f'"model": "{out}"' in card and "vllm serve " in card and "--port" not in card
    assert f"hf upload <user>/<repo> {out}" in card
    assert "Measured on vLLM's CPU build: give it a KV-cache size" in card   # (0.32.0+cpu)
    assert cli("export", cwd=tmp, check=2).stderr.count("already exists") == 1
    # the folder alone, served by the card's command, measures what evaluate did
    again = measure_export(card, out, results)
    assert (again["drafts"], again["accepted_tokens"]) == (m["drafts"], m["accepted_tokens"])
    assert again["acceptance_length"] == pytest.approx(m["acceptance_length"])
    assert not server_pids()
    check_watch(again, m, out)


def check_watch(again: dict, m: dict, out) -> None:
    """`watch --once` after the export's load: since the server started, the
    counters as read by hand (this server served nothing else); nothing in
    its interval; the export's measurement beside it. And the watch's
    arithmetic on the real /metrics texts around the load is evaluate's."""
    from pipeline.vllm.metrics import spec_counters
    from pipeline.watch.figures import between, read
    w, (before, after) = again["watch"], again["texts"]
    by_hand = spec_counters(after)
    since = w["since_start"]
    print("watch --once --json:", json.dumps({k: w[k] for k in ("since_start", "window")}))
    assert (since["drafts"], since["accepted_tokens"]) == (by_hand["drafts"], by_hand["accepted"])
    assert since["acceptance_length"] == pytest.approx(1 + by_hand["accepted"] / by_hand["drafts"])
    assert since["per_position"] == pytest.approx(
        [by_hand["per_position"][k] / by_hand["drafts"] for k in sorted(by_hand["per_position"])])
    assert w["window"]["drafts"] == 0 and w["window"]["acceptance_length"] is None
    assert w["model"] and w["spec_decode"] and w["running"] == 0
    assert w["measured"]["acceptance_length"] == pytest.approx(m["acceptance_length"])
    assert w["measured"]["source"] == f"export {out}"
    interval = between(read(before, 0.0), read(after, 1.0))
    assert (interval.drafts, interval.accepted_tokens) == (again["drafts"], again["accepted_tokens"])
    assert interval.per_position == pytest.approx(again["per_position"])


def measure_export(card: str, out, results: dict) -> dict:
    """The card's `vllm serve` command on a free port (vLLM's CPU build has no
    `vllm` that runs: pipeline/vllm/launch.py is that command for it), the
    prompts the export ships sent the way the card says evaluate sent them."""
    import secrets
    import shlex
    from types import SimpleNamespace

    from pipeline.data.prompt_sets import PROMPTS_FILE, from_jsonl
    from pipeline.evaluate.load import generate
    from pipeline.vllm import contract_strings as vs
    from pipeline.vllm.environment import process_env
    from pipeline.vllm.metrics import acceptance, spec_counters
    from pipeline.vllm.server import VllmServer, free_port, served_model_name, serving
    argv = shlex.split(card.split("## Serve it")[1].split("```")[1])
    assert argv[:2] == ["vllm", "serve"] and str(out) in argv[argv.index(vs.FLAG_SPECULATIVE_CONFIG) + 1]
    port = free_port()
    argv = [str(PY), "-m", "pipeline.vllm.launch", *argv[1:], vs.FLAG_HOST, "127.0.0.1",
            vs.FLAG_PORT, str(port)]
    server = VllmServer(0, argv, port, secrets.token_hex(8), [], out.parent / "serve.log",
                        process_env(probe(str(PY)), [], 2))   # the CPU build's KV space, as
    # evaluate gives it (VLLM_CPU_KVCACHE_SPACE): without, it asks for 92% of the memory
    sec = SimpleNamespace(max_tokens=results["max_tokens"], temperature=results["temperature"],
                          seed=0, concurrency=results["concurrency"], request_timeout_s=300)
    per_request = "response" if vs.FLAG_PER_REQUEST_SPEC_METRICS in argv else "metrics"
    with serving(server, 600, lambda: False):
        before_text = server.metrics_text() or ""
        generate(server, served_model_name(argv[4], argv), from_jsonl(out / PROMPTS_FILE), sec,
                 lambda: False, per_request, results["num_speculative_tokens"])
        after_text = server.metrics_text() or ""
        measured = acceptance(spec_counters(before_text), spec_counters(after_text))
        # `eagle-panel watch` on the same server, the load over: what it says since the
        # server started is the counters read by hand (issue 54)
        watched = cli("watch", server.url, "--once", "--json", "--interval", "0.5", "--draft",
                      out, "--api-key-env", "SERVED_KEY", cwd=out.parent, check=0,
                      env=dict(os.environ, SERVED_KEY=server.api_key))
        return {**measured, "watch": json.loads(watched.stdout), "texts": (before_text,
                                                                           after_text)}


def test_mt_bench_per_category_the_gate_and_provenance(run):
    """MT-bench's questions (two turns, the second after the target's own first
    answer) on the trained draft: each request's acceptance from the real
    responses, aggregated per category; the gate failing (passing: the tiny-kimi
    pipeline test, gated at 2.5); the server's command in the provenance."""
    tmp, rd, seen = run
    mt = {"stages": {"evaluate": {"prompts": "mt-bench", "max_prompts": 16, "max_tokens": 32,
                                  "checkpoints": "last", "baseline": False,
                                  # the most a step can accept (3 drafted + 1): no
                                  # real draft measures it, the gate fails
                                  "min_acceptance": 4.0}}}
    write(tmp / "config.toml", merged(CONFIG, mt))
    p = cli("run", "--stage", "evaluate", "--wait", cwd=tmp, timeout=900)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "below min_acceptance 4" in p.stdout and "lowest category:" in p.stdout
    results = json.loads((rd.out_dir("evaluate") / "results.json").read_text())
    cats = results["per_category"]
    assert sorted(cats) == sorted(["writing", "roleplay", "reasoning", "math", "coding",
                                   "extraction", "stem", "humanities"])
    m = results["checkpoints"]["1"]
    assert m["per_request"] == "response"
    reqs = m["requests_measured"]
    assert len(reqs) == 32 and {r["turn"] for r in reqs} == {0, 1}   # 16 prompts x 2 turns
    # the per-request figures add up to what /metrics counted for the whole run
    assert sum(r["steps"] for r in reqs) == m["drafts"]
    assert sum(r["accepted"] for r in reqs) == m["accepted_tokens"]
    assert sum(c["requests"] for c in cats.values()) == 32
    assert results["worst_prompts"] and results["worst_prompts"][0]["text"]
    print("MT-bench per category:", {c: round(v["acceptance_length"], 2)
                                     for c, v in cats.items()})
    # provenance: the server's exact command and the vLLM that ran it
    status = json.loads(cli("status", "--json", cwd=tmp, check=0).stdout)
    prov = status["provenance"]["evaluate"]
    assert prov["servers"] and "--per-request-spec-decode-metrics" in prov["servers"][0][
        "command"] and prov["servers"][0]["vllm"].endswith("+cpu")
    assert not server_pids()


def test_without_a_usable_vllm_regenerate_and_evaluate_are_skipped(tmp_path):
    """An interpreter with no vLLM: one clear line each, status skipped."""
    cfg = render({"runtime": {"vllm_python": sys.executable},
                  "stages": {"regenerate": {"enabled": True}}})
    code, rd, evs = run_body(tmp_path, "regenerate", __import__(
        "pipeline.stages.regenerate", fromlist=["body"]).body, cfg)
    fin = finished(evs)
    assert code == 0 and fin["status"] == "skipped" and "vLLM is not installed" in \
        fin["summary"]["skipped"] and "prepare uses [data]" in fin["summary"]["skipped"]
    from pipeline.stages import evaluate
    code, rd, evs = run_body(tmp_path, "evaluate", evaluate.body, cfg)
    fin = finished(evs)
    assert code == 0 and fin["status"] == "skipped" and "ends at train" in fin["summary"]["skipped"]


@pytest.mark.timeout(120)
def test_a_stop_while_regenerate_probes_vllm_is_a_cancel_not_a_skip(tmp_path):
    """`cancel` signals the stage's whole process group: the vLLM probe it is
    running dies of the same SIGINT, and read as "no usable vLLM" the stage
    was once recorded skipped, which resume keeps (regenerate never ran: CI,
    test_shared_server). The interpreter here does what the group's signal
    does: SIGINT to the stage, then exits as interrupted."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -INT $PPID\necho KeyboardInterrupt >&2\nexit 130\n")
    fake.chmod(0o755)
    from pipeline.stages import regenerate
    cfg = render({"runtime": {"vllm_python": str(fake)},
                  "stages": {"regenerate": {"enabled": True}}})
    code, rd, evs = run_body(tmp_path, "regenerate", regenerate.body, cfg)
    fin = finished(evs)
    assert code == 130 and fin["status"] == "cancelled", fin
    assert "resume runs it again" in fin["summary"]["stopped"]
