"""Chaos run: SIGKILL any process of a running pipeline at random instants,
resume, until the run ends; then compare with an uninterrupted run.

    python bench/chaos.py --kills 100 [--seed 1] [--samples 96] [--backend auto]
                          [--work DIR] [--json OUT]

The smallest size (CI, ~1 min on 2 cores; tests/integration/test_chaos.py makes a larger one):
    python bench/chaos.py --kills 1 --samples 16 --epochs 1 --no-evaluate --backend hf \
        --max-gap 2 --work DIR

Victims, chosen at random among those alive at that instant:
  stage     a stage's process group (the stage and its children)
  driver    the detached driver that walks the stages
  supervisor a stage's supervisor (the stage goes on, unrecorded)
  vllm      a vLLM server with its workers (the vllm-server backend, evaluate,
            regenerate; absent with the hf backend)
  panel     a panel attached to the run (in tmux, 80x24; absent without tmux)
  session   the whole session of a `run --wait` / `resume --wait`
When nothing drives the run any more, it is resumed (`resume --wait` in a
session of its own, itself a victim). After the last kill the run goes on
undisturbed to its end.

The same config runs once without kills (the reference). Compared: the
prepared dataset, hidden-state files (same backend), d2t/t2d, the loss per
step, the final checkpoint's tensors, evaluate's results. With the hf
backend they must be equal bit for bit; vLLM batches whatever requests are
in flight (a restart changes the batches), so there its hidden states, and
training on them, must agree to float rounding (1e-4; the figures are
printed). Counted: kills
made / survived (after each kill the run directory is checked: state.json
parses, every hidden-state file present is whole, no checkpoint without its
marker is trusted), corrupt files found by the stages on resume, files left
over (temporaries, set-aside checkpoints), processes left over (by the
run's path and tokens, by every attempt's supervisor session, and by vLLM's
process names VLLM::EngineCore / VLLM::Worker: any one fails the run), train
steps redone, and for each stage killed the seconds from the kill until the
attempt's last process is gone (its children, its vLLM servers and their
renamed workers, its supervisor once it has recorded the end; one not gone
within 120 s fails the run). `--seed` replays the same choices of victims and delays (process
timing is the machine's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.run.events import read_events  # noqa: E402
from pipeline.run.executor import proc_alive  # noqa: E402
from pipeline.run.leftovers import attempt_processes, vllm_processes  # noqa: E402
from pipeline.run.proctree import TOKEN_VAR, cmdline, environ, live_pids, proc_name  # noqa: E402
from pipeline.run.rundir import DONE, RunDir  # noqa: E402
from tests.configs import write  # noqa: E402


def cli(work: Path, *args, session=False, wait=True, timeout=1800):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "app.cli", "--config", str(work / "config.toml"), *args]
    if not wait:
        return subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=session)
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def write_config(work: Path, name: str, a) -> None:
    work.mkdir(parents=True, exist_ok=True)
    write(work / "config.toml", {
        "run": {"name": name, "runs_dir": str(work / "runs")},
        "data": {"max_samples": a.samples},
        "runtime": {"cancel_grace_s": 5.0, "term_grace_s": 5.0},
        "stages": {
            "regenerate": {"enabled": False},
            "prepare": {"seq_length": 256},
            "extract": {"backend": a.backend, "layer_ids": [1, 2, 3], "min_free_gb": 0.0,
                        "max_inflight": 4, "startup_timeout_s": 600.0},
            "vocab": {"draft_vocab_size": 224},
            "train": {"epochs": a.epochs, "lr": 0.001, "total_seq_len": 1024},
            "evaluate": {"enabled": a.evaluate, "max_prompts": 8, "max_tokens": 32,
                         "baseline": False, "startup_timeout_s": 600.0}}})


# -- finding victims ---------------------------------------------------------

def run_processes(rd: RunDir) -> list[int]:
    """Every live process of this run: driver, supervisors (their command
    names the run directory), stages and what they started (the token)."""
    token = f"{TOKEN_VAR}={rd.id}/".encode()
    return [pid for pid in live_pids()
            if str(rd.path) in cmdline(pid) or any(e.startswith(token) for e in environ(pid))]


def note_attempts(rd: RunDir, seen: dict) -> None:
    """Remember every stage attempt's identity (token, supervisor): state.json
    keeps only the latest attempt's, and an earlier one's orphans must be found."""
    try:
        stages = rd.read_state()["stages"]
    except Exception:  # noqa: BLE001 - a state being replaced: next time
        return
    for st in stages.values():
        if st.get("token") and st.get("supervisor_pid"):
            seen[st["token"]] = {k: st.get(k) for k in
                                 ("token", "supervisor_pid", "supervisor_create_time")}


def leftover_processes(rd: RunDir, seen: dict, vllm_before: set[int]) -> list[int]:
    """What is still alive once the run has ended: by the run's path or token
    (run_processes), by each attempt's identity (its supervisor's session:
    vLLM's renamed EngineCore and workers carry no readable token), and by
    vLLM's process names (VLLM::...) working in this run's directory (their
    cwd: another test's servers beside this bench are not counted) that were
    not there when the bench began."""
    left = set(run_processes(rd))
    for st in seen.values():
        left.update(attempt_processes(st))
    left.update(p for p in vllm_processes(under=rd.path.resolve()) if p not in vllm_before)
    return sorted(left)


def victims(rd: RunDir, sessions: list, panels: list) -> dict[str, list]:
    """kind -> [(what, kill function)] of what is alive now."""
    out: dict[str, list] = {k: [] for k in
                            ("stage", "driver", "supervisor", "vllm", "panel", "session")}
    try:
        state = rd.read_state()
    except Exception:  # noqa: BLE001 - a state being replaced: no victims this instant
        return out
    d = state.get("driver") or {}
    if proc_alive(d.get("pid"), d.get("create_time")):
        out["driver"].append(("driver", lambda p=d["pid"]: os.kill(p, signal.SIGKILL)))
    for stage, st in state["stages"].items():
        if st["status"] != "running":
            continue
        if proc_alive(st.get("pid"), st.get("create_time")) and st.get("pgid"):
            out["stage"].append((stage, lambda g=st["pgid"]: os.killpg(g, signal.SIGKILL)))
        if proc_alive(st.get("supervisor_pid"), st.get("supervisor_create_time")):
            out["supervisor"].append(
                (stage, lambda p=st["supervisor_pid"]: os.kill(p, signal.SIGKILL)))
    for pid in run_processes(rd):
        cmd = cmdline(pid)
        if "pipeline.vllm.launch" in cmd and os.getpgid(pid) == pid:
            out["vllm"].append(("vllm server", lambda g=pid: os.killpg(g, signal.SIGKILL)))
    for p in sessions:
        if p.poll() is None:
            out["session"].append(("run --wait", lambda s=p.pid: os.killpg(s, signal.SIGKILL)))
    for name in panels:
        pane = subprocess.run(["tmux", "list-panes", "-t", name, "-F", "#{pane_pid}"],
                              capture_output=True, text=True, check=False).stdout.split()
        for pid in pane:
            out["panel"].append(("panel", lambda p=int(pid): os.kill(p, signal.SIGKILL)))
    return out


def start_panel(work: Path, rd: RunDir, panels: list) -> None:
    if not shutil.which("tmux"):
        return
    name = f"chaos-panel-{os.getpid()}-{len(panels)}"
    cmd = (f"cd {work} && PYTHONPATH={ROOT} TERM=xterm-256color exec {sys.executable} "
           f"-m app.cli --config {work / 'config.toml'} ui")
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24", cmd],
                   capture_output=True, check=False)
    panels.append(name)


# -- integrity ---------------------------------------------------------------

def integrity(rd: RunDir) -> list[str]:
    """What a later step would trust and is wrong, right now."""
    problems = []
    try:
        rd.read_state()
    except Exception as e:  # noqa: BLE001 - any failure to read it is the finding
        problems.append(f"state.json: {e}")
    hs = rd.out_dir("extract") / "hidden_states"
    if hs.is_dir():
        from safetensors.torch import load_file
        for f in hs.glob("hs_*.safetensors"):
            try:
                data = load_file(str(f))
                assert set(data) == {"hidden_states", "token_ids"}
            except Exception as e:  # noqa: BLE001
                problems.append(f"{f.name}: {e}")
    for name in ("d2t", "t2d"):
        for f in rd.out_dir("vocab").glob(f"{name}-*.npy"):
            import numpy as np
            try:
                np.load(f)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{f.name}: {e}")
    return problems


def leftovers(rd: RunDir) -> list[str]:
    found = []
    for p in rd.path.rglob("*"):
        rel = p.relative_to(rd.path)
        if p.name.endswith(".tmp") or ".incomplete_checkpoints" in rel.parts or \
                p.name.startswith(".trash-") or ".staging" in rel.parts:
            found.append(str(rel))
    return found


# -- comparison ----------------------------------------------------------------

def train_losses(rd: RunDir) -> dict:
    """(epoch, step) -> the last train loss logged for it."""
    out = {}
    for e in read_events(rd.events_path("train")):
        loss = (e.get("values") or {}).get("loss")
        if e.get("type") == "metric" and e.get("split") == "train" and loss is not None:
            out[(e.get("epoch"), e.get("step"))] = loss
    return out


def train_steps_logged(rd: RunDir) -> int:
    return sum(1 for e in read_events(rd.events_path("train"))
               if e.get("type") == "metric" and e.get("split") == "train")


def compare(ref: RunDir, got: RunDir) -> dict:
    import numpy as np
    import torch
    from datasets import load_from_disk
    from safetensors.torch import load_file
    out = {}
    a = load_from_disk(str(ref.out_dir("prepare") / "data")).with_format(None)
    b = load_from_disk(str(got.out_dir("prepare") / "data")).with_format(None)
    out["dataset_identical"] = a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    diffs, missing = [], 0
    for f in sorted((ref.out_dir("extract") / "hidden_states").glob("hs_*.safetensors")):
        g = got.out_dir("extract") / "hidden_states" / f.name
        if not g.exists():
            missing += 1
            continue
        x, y = load_file(str(f)), load_file(str(g))
        diffs.append(float((x["hidden_states"].float() - y["hidden_states"].float()).abs().max()))
        if not torch.equal(x["token_ids"], y["token_ids"]):
            diffs[-1] = float("inf")
    out["hidden_state_files"] = len(diffs)
    out["hidden_state_files_missing"] = missing
    out["hidden_states_max_abs_diff"] = max(diffs) if diffs else None
    out["vocab_identical"] = all(
        np.array_equal(np.load(f), np.load(got.out_dir("vocab") / f.name))
        for f in ref.out_dir("vocab").glob("*.npy"))
    la, lb = train_losses(ref), train_losses(got)
    out["loss_steps"] = len(la)
    out["loss_curve_equal"] = bool(la) and la == lb
    out["loss_max_abs_diff"] = max((abs(la[k] - lb.get(k, float("inf"))) for k in la), default=None)
    ca = ref.out_dir("train") / "checkpoints"
    last = max((d for d in ca.iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    wa = load_file(str(last / "model.safetensors"))
    wb = load_file(str(got.out_dir("train") / "checkpoints" / last.name / "model.safetensors"))
    out["final_checkpoint_equal"] = wa.keys() == wb.keys() and all(
        torch.equal(wa[k], wb[k]) for k in wa)
    out["final_checkpoint_max_abs_diff"] = max(
        (float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if k in wb), default=None)
    # hf computes each sample the same way whatever ran before: bit for bit.
    # vLLM batches whatever requests are in flight, and a restart changes the
    # batches: the same values up to float rounding, and training on them too.
    backend = next((e["summary"].get("backend") for e in read_events(ref.events_path("extract"))
                    if e.get("type") == "stage_finished" and e.get("summary")), "hf")
    out["exact"] = backend == "hf"
    tol = {"hidden": 0.0, "loss_rel": 0.0, "weights": 0.0} if out["exact"] else \
        {"hidden": 1e-4, "loss_rel": 1e-4, "weights": 1e-3}
    out["tolerances"] = tol
    out["within_tolerance"] = (
        out["hidden_states_max_abs_diff"] is not None
        and out["hidden_states_max_abs_diff"] <= tol["hidden"]
        and bool(la) and la.keys() == lb.keys()
        and all(abs(la[k] - lb[k]) <= tol["loss_rel"] * max(1.0, abs(la[k])) for k in la)
        and out["final_checkpoint_max_abs_diff"] is not None
        and out["final_checkpoint_max_abs_diff"] <= tol["weights"])
    res = got.out_dir("evaluate") / "results.json"
    out["evaluate_results"] = res.exists() or not (ref.out_dir("evaluate") / "results.json").exists()
    return out


# -- the run -----------------------------------------------------------------

def chaos(work: Path, name: str, kills: int, seed: int, max_gap: float, timeout: float,
          vllm_before: set[int] = frozenset()) -> dict:
    rng = random.Random(seed)
    seen: dict = {}
    rd = RunDir(work / "runs" / name)
    sessions = [cli(work, "run", "--wait", session=True, wait=False)]
    panels: list[str] = []
    made, survived, problems, resumes = [], 0, [], 0
    t0, deadline = time.time(), time.time() + timeout
    while not rd.is_run():
        time.sleep(0.1)
    start_panel(work, rd, panels)
    streak, last_running = 0, None
    while time.time() < deadline:
        note_attempts(rd, seen)
        state = rd.read_state()
        d = state.get("driver") or {}
        driving = proc_alive(d.get("pid"), d.get("create_time"))
        statuses = [st["status"] for st in state["stages"].values()]
        if not driving and all(s in DONE for s in statuses):
            break
        if not driving and not any(p.poll() is None for p in sessions):
            sessions.append(cli(work, "resume", "--wait", session=True, wait=False))
            resumes += 1
            time.sleep(1.0)
            continue
        if len(made) >= kills:
            time.sleep(0.5)
            continue
        running = [s for s, st in state["stages"].items() if st["status"] == "running"]
        if running != last_running:
            streak, last_running = 0, running
        # a stage hit again and again gets longer quiet spells, so that it
        # can finish a unit of work (a checkpoint, a chunk) between kills
        time.sleep(rng.uniform(0.2, max_gap * 1.5 ** min(streak, 6)))
        if len(panels) < 1 + len(made) // 10 and rng.random() < 0.3:
            start_panel(work, rd, panels)
        alive = victims(rd, sessions, panels)
        kinds = sorted(k for k, v in alive.items() if v)
        if not kinds:
            continue
        kind = rng.choice(kinds)
        what, kill = rng.choice(alive[kind])
        attempt = killed_attempt(rd, kind, what)
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            continue
        t = round(time.time() - t0, 1)
        record = {"t": t, "kind": kind, "what": what}
        if attempt:
            time_to_gone(attempt, record)
        time.sleep(0.5)
        found = integrity(rd)
        record["problems"] = found
        made.append(record)
        problems += found
        survived += not found
        streak += kind in ("stage", "vllm")
    else:
        raise TimeoutError(f"chaos run did not end within {timeout:.0f} s")
    return {"kills_made": len(made), "kills_survived": survived, "integrity_problems": problems,
            "resumes": resumes, "kills": made, "wall_s": round(time.time() - t0, 1),
            "leftover_processes": _after(rd, panels, seen, vllm_before)}


def killed_attempt(rd: RunDir, kind: str, what: str) -> dict | None:
    """The identity (token, supervisor) of the stage attempt a stage kill (its
    process group, SIGKILL) ends, read before the kill; None for the other
    kinds (a vLLM server killed under a live stage is restarted by it)."""
    if kind != "stage":
        return None
    try:
        stages = rd.read_state()["stages"]
    except Exception:  # noqa: BLE001 - a state being replaced: not measured
        return None
    running = [st for s, st in stages.items() if st["status"] == "running" and s == what
               and st.get("token")]
    return {k: running[0].get(k) for k in ("token", "supervisor_pid", "supervisor_create_time")} \
        if running else None


GONE_WAIT_S = 120.0


def time_to_gone(attempt: dict, record: dict) -> None:
    """In a thread: seconds from the kill until no process of the attempt is
    alive (by its token and its supervisor's session, pipeline/run/leftovers.py:
    the stage's children, its vLLM servers and their renamed workers, the
    supervisor once it has recorded the end), into record["gone_s"] (None:
    still there after GONE_WAIT_S)."""
    import threading
    t0 = time.time()

    def watch():
        while time.time() - t0 < GONE_WAIT_S:
            if not attempt_processes(attempt):
                record["gone_s"] = round(time.time() - t0, 2)
                return
            time.sleep(0.05)
        record["gone_s"] = None
    record["gone_s"] = "watching"
    threading.Thread(target=watch, daemon=True).start()


def gone_summary(rounds: list[dict]) -> dict:
    """Kill-to-gone seconds of the stage kills."""
    out = {}
    for kind in ("stage",):
        got = [k.get("gone_s") for r in rounds for k in r["kills"] if k["kind"] == kind]
        done = sorted(g for g in got if isinstance(g, float | int))
        out[kind] = {"n": len(got), "median_s": done[len(done) // 2] if done else None,
                     "max_s": done[-1] if done else None,
                     "not_gone": sum(1 for g in got if not isinstance(g, float | int))}
    return out


def _after(rd: RunDir, panels: list[str], seen: dict, vllm_before: set[int]) -> list[str]:
    """Close the panels; the processes left over, each as "pid NAME"."""
    for name in panels:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True, check=False)
    time.sleep(2.0)
    note_attempts(rd, seen)
    return [f"{p} {proc_name(p)}" for p in leftover_processes(rd, seen, vllm_before)]


def corrupt_found_on_resume(rd: RunDir) -> int:
    """Files the stages themselves found invalid when resuming."""
    n = 0
    for stage in ("extract", "train"):
        for e in read_events(rd.events_path(stage)):
            msg = e.get("message") or ""
            if e.get("type") == "warning" and ("invalid" in msg or "incomplete checkpoint" in msg):
                n += 1
    return n


def check_round(ref: RunDir, got: RunDir) -> dict:
    state = got.read_state()
    out = {"run": got.id,
           "final_statuses": {s: st["status"] for s, st in state["stages"].items()},
           "attempts": {s: st["attempt"] for s, st in state["stages"].items()},
           "corrupt_found_on_resume": corrupt_found_on_resume(got),
           "leftover_files": leftovers(got),
           "train_steps_redone": train_steps_logged(got) - train_steps_logged(ref),
           "comparison": compare(ref, got)}
    c = out["comparison"]
    out["ok"] = all(s in DONE for s in out["final_statuses"].values()) \
        and c["dataset_identical"] and c["vocab_identical"] and c["within_tolerance"] \
        and c["evaluate_results"] and c["hidden_state_files_missing"] == 0
    return out


def summarize(rounds: list[dict], a, ref_wall: float) -> dict:
    by_kind: dict[str, int] = {}
    for r in rounds:
        for k in r["kills"]:
            by_kind[k["kind"]] = by_kind.get(k["kind"], 0) + 1
    total = lambda key: sum(r[key] for r in rounds)  # noqa: E731
    report = {
        "seed": a.seed, "backend": a.backend, "samples": a.samples, "epochs": a.epochs,
        "reference_wall_s": round(ref_wall, 1), "rounds": rounds,
        "kills_made": total("kills_made"), "kills_survived": total("kills_survived"),
        "kills_by_kind": by_kind, "resumes": total("resumes"), "wall_s": total("wall_s"),
        "corrupt_found_on_resume": total("corrupt_found_on_resume"),
        "leftover_files": [f for r in rounds for f in r["leftover_files"]],
        "leftover_processes": [p for r in rounds for p in r["leftover_processes"]],
        "train_steps_redone": total("train_steps_redone"),
        "kill_to_gone": gone_summary(rounds),
        "hidden_states_max_abs_diff": max(
            (r["comparison"]["hidden_states_max_abs_diff"] or 0.0 for r in rounds), default=None),
        "loss_max_abs_diff": max(
            (r["comparison"]["loss_max_abs_diff"] or 0.0 for r in rounds), default=None),
        "final_checkpoint_max_abs_diff": max(
            (r["comparison"]["final_checkpoint_max_abs_diff"] or 0.0 for r in rounds),
            default=None),
    }
    report["ok"] = bool(rounds) and all(r["ok"] for r in rounds) \
        and report["kills_survived"] == report["kills_made"] >= a.kills \
        and not report["leftover_processes"] \
        and not any(g["not_gone"] for g in report["kill_to_gone"].values())
    return report


def render(r: dict, a) -> str:
    exact = all(x["comparison"]["exact"] for x in r["rounds"])
    each = lambda key: all(x["comparison"][key] for x in r["rounds"])  # noqa: E731
    lines = [
        f"chaos (seed {a.seed}, backend {a.backend}, {a.samples} samples, {a.epochs} epochs): "
        f"{len(r['rounds'])} run(s), each compared with the undisturbed reference",
        f"  kills made / survived: {r['kills_made']} / {r['kills_survived']}  {r['kills_by_kind']}",
        f"  resumes: {r['resumes']}   wall: {r['wall_s']:.0f} s "
        f"(reference run {r['reference_wall_s']} s)",
        f"  corrupt files found on resume: {r['corrupt_found_on_resume']}",
        f"  leftover files: {len(r['leftover_files'])}  processes: {len(r['leftover_processes'])}",
        f"  train steps redone: {r['train_steps_redone']}",
        "  kill to gone (the attempt's last process): " + "; ".join(
            f"{kind} kills {g['n']}, median {g['median_s']} s, max {g['max_s']} s"
            + (f", {g['not_gone']} not gone" if g["not_gone"] else "")
            for kind, g in r["kill_to_gone"].items() if g["n"]) if any(
            g["n"] for g in r["kill_to_gone"].values()) else "  kill to gone: no stage killed",
        f"  datasets identical: {each('dataset_identical')}   "
        f"d2t/t2d identical: {each('vocab_identical')}   "
        f"evaluate results: {each('evaluate_results')}",
        f"  max |diff| hidden states {r['hidden_states_max_abs_diff']}, loss "
        f"{r['loss_max_abs_diff']}, final checkpoint {r['final_checkpoint_max_abs_diff']}",
        f"  {'bit for bit (hf)' if exact else 'within float noise (vLLM batching)'}: "
        f"{each('within_tolerance')}",
        "  OK" if r["ok"] else "  NOT OK"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--backend", default="auto", help="extract backend (auto: vLLM where installed)")
    ap.add_argument("--no-evaluate", dest="evaluate", action="store_false")
    ap.add_argument("--max-gap", type=float, default=6.0, help="seconds between kills, at most")
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--work", help="folder for both runs (default: a temporary one)")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="chaos-"))
    (work / "ref").mkdir(parents=True, exist_ok=True)
    write_config(work / "ref", "ref", a)
    vllm_before = set(vllm_processes())   # (another user's servers are not ours to count)
    t = time.time()
    r = cli(work / "ref", "run", "--wait")
    if r.returncode:
        print(r.stdout[-3000:], r.stderr[-3000:])
        return 1
    ref_wall = time.time() - t
    ref = RunDir(work / "ref" / "runs" / "ref")
    rounds, made = [], 0
    while made < a.kills:
        # A run that ends before all kills are made is checked, and the
        # next round starts a new one (a run id of its own: processes are
        # found by it, never another run's); seeds follow from --seed.
        name = f"chaos-{os.getpid()}-{len(rounds)}"
        write_config(work / "chaos", name, a)
        rnd = chaos(work / "chaos", name, a.kills - made, a.seed + 1000 * len(rounds),
                    a.max_gap, a.timeout, vllm_before)
        rnd.update(check_round(ref, RunDir(work / "chaos" / "runs" / name)))
        rnd["ok"] = rnd["ok"] and rnd["kills_survived"] == rnd["kills_made"] \
            and not rnd["leftover_processes"]
        rounds.append(rnd)
        made += rnd["kills_made"]
        if not rnd["ok"] or not rnd["kills_made"]:
            break
    report = summarize(rounds, a, ref_wall)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    print(render(report, a))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
