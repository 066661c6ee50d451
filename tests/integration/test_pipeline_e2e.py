"""The real four stages on the built-in tiny model, with kills and resumes.

One run is driven like a user with bad luck would: extract is SIGKILLed
half-way, resumed; train is SIGKILLed after a mid-epoch checkpoint, resumed;
then cancelled with SIGINT (it saves), resumed to the end. The finished run
is then checked as speculators and vLLM would use it.
"""

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.run.events import read_events
from pipeline.run.rundir import RunDir
from pipeline.train.checkpoints import STATE_FILE, complete_checkpoint
from tests.configs import write
from tests.helpers import cli, wait_for

CONFIG = {
    "run": {"name": "e2e", "runs_dir": "runs"},
    "stages": {
        "prepare": {"seq_length": 192},
        "extract": {"layer_ids": [1, 2, 3], "batch_tokens": 192},
        "vocab": {"draft_vocab_size": 256},
        "train": {"epochs": 2, "lr": 0.003, "total_seq_len": 768, "checkpoint_freq": 0.25},
        "evaluate": {"enabled": False},   # measured through the real vLLM in test_vllm_pipeline.py
    },
}


def kill_stage(rd: RunDir, stage: str) -> None:
    """SIGKILL a stage that must still be running (one that finished first
    would test no kill at all: said plainly rather than failing later)."""
    st = rd.read_state()["stages"][stage]
    assert st["status"] == "running", f"{stage} ended before the kill: {st}"
    try:
        os.killpg(st["pgid"], signal.SIGKILL)
    except ProcessLookupError:
        pass   # it ended between the read and the kill: the state says how
    wait_for(lambda: rd.read_state()["stages"][stage]["status"] != "running", timeout=30,
             what=f"{stage} to be recorded as ended")
    assert rd.read_state()["stages"][stage]["signal"] == "SIGKILL", f"{stage} ended first"


def keep_lowest(folder: Path, n: int) -> None:
    """Keep the n lowest-numbered hidden-state files: the state a kill at that
    point would have left, however many more the stage wrote before it landed."""
    files = sorted(folder.glob("hs_*.safetensors"), key=lambda p: int(p.name[3:-12]))
    assert len(files) >= n
    for p in files[n:]:
        p.unlink()


def newest_checkpoint_state(rd: RunDir) -> dict:
    """The training state of the newest complete checkpoint (what a resume starts from)."""
    folder = rd.out_dir("train") / "checkpoints"
    done = [d for d in folder.iterdir() if d.name.isdigit() and complete_checkpoint(d)]
    assert done, f"no complete checkpoint in {folder}: {sorted(p.name for p in folder.iterdir())}"
    return json.loads((max(done, key=lambda d: int(d.name)) / STATE_FILE).read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    write(tmp / "config.toml", CONFIG)
    rd = RunDir(tmp / "runs" / "e2e")
    hs = rd.out_dir("extract") / "hidden_states"
    log = {}

    # 1. SIGKILL extract half-way.
    cli("run", cwd=tmp, check=0)
    wait_for(lambda: hs.is_dir() and len(list(hs.glob("hs_*.safetensors"))) >= 100,
             timeout=300, poll=0.01, what="100 hidden-state files")
    kill_stage(rd, "extract")
    st = rd.read_state()["stages"]["extract"]
    assert st["status"] == "failed" and st["signal"] == "SIGKILL"
    # the point this test controls: the run goes on from exactly 100 files,
    # however many the stage finished before the kill landed
    keep_lowest(hs, 100)
    before = {p.name: p.stat().st_mtime_ns for p in hs.glob("hs_*.safetensors")}
    assert len(before) == 100
    log["extract_files_before_kill"] = before

    # 2. Resume; SIGKILL train after its first mid-epoch checkpoint.
    cli("resume", cwd=tmp, check=0)
    # Killed as soon as the first is complete: speculators saves every mid-epoch
    # checkpoint of an epoch into the same folder, and a kill during the next
    # save (a fixed sleep here could land in it) would leave none complete.
    first_ckpt = rd.out_dir("train") / "checkpoints" / "0"
    wait_for(lambda: complete_checkpoint(first_ckpt), timeout=600, poll=0.05,
             what="a mid-epoch checkpoint")
    kill_stage(rd, "train")
    log["killed_at_state"] = newest_checkpoint_state(rd)

    # 3. Resume; cancel with SIGINT mid-training (it saves); resume to the end.
    cli("resume", cwd=tmp, check=0)
    # 30 steps of attempt 2 itself: counted over the file, attempt 1's steps
    # could make it true before attempt 2's process had its SIGINT handler
    wait_for(lambda: len(a := train_attempts(rd)) == 2 and len(a[1]) >= 30,
             timeout=600, what="training attempt 2 to make progress")
    assert rd.read_state()["stages"]["train"]["status"] == "running", "train ended first"
    p = cli("cancel", cwd=tmp, check=0)
    log["cancel_output"] = p.stdout
    log["after_cancel"] = dict(rd.read_state()["stages"]["train"])
    p = cli("resume", "--wait", cwd=tmp, timeout=900)
    log["final_output"] = p.stdout + p.stderr
    assert p.returncode == 0, log["final_output"]
    return tmp, rd, log


def train_attempts(rd):
    """Train metric events grouped by attempt (stage_started separates them)."""
    attempts, cur = [], None
    for e in read_events(rd.events_path("train")):
        if e["type"] == "stage_started":
            cur = []
            attempts.append(cur)
        elif e["type"] == "metric" and e.get("split") == "train" and cur is not None:
            cur.append(e)
    return attempts


def test_all_stages_succeeded_with_resumes(run):
    _, rd, log = run
    st = rd.read_state()["stages"]
    # the four stages this run has; regenerate (off by default) and evaluate
    # (off here) are recorded as skipped, with the reason
    want = {**dict.fromkeys(st, "succeeded"), "regenerate": "skipped", "evaluate": "skipped"}
    assert {s: st[s]["status"] for s in st} == want
    assert "enabled = false" in st["evaluate"]["reason"]
    # train: SIGKILLed, cancelled, finished
    assert st["extract"]["attempt"] == 2 and st["train"]["attempt"] == 3
    # which checkpoint, and why (evaluate measures the one train chose, by default)
    assert re.search(r"trained draft \((highest acceptance estimate, epoch \d+( \(the latest "
                     r"within min_delta [\d.e-]+ of epoch \d+'s\))?|lowest validation loss|"
                     r"last epoch)\): \S+/checkpoints/\d+",
                     log["final_output"]), log["final_output"]
    assert "estimated acceptance length" in log["final_output"]


def test_extract_resume_kept_files_and_left_no_debris(run):
    _, rd, log = run
    hs = rd.out_dir("extract") / "hidden_states"
    files = sorted(hs.iterdir())
    names = {p.name for p in files}
    assert names == {f"hs_{i}.safetensors" for i in range(400)}  # none missing, none extra
    before = log["extract_files_before_kill"]
    # Files finished before the kill were validated, not recomputed.
    unchanged = [n for n, t in before.items() if (hs / n).stat().st_mtime_ns == t]
    assert len(unchanged) >= len(before) - 3  # the few being written at the kill may differ
    summary = [e for e in read_events(rd.events_path("extract")) if e["type"] == "stage_finished"]
    assert summary[-1]["summary"]["reused"] >= len(before) - 3
    assert summary[-1]["summary"]["computed"] == 400 - summary[-1]["summary"]["reused"]


def test_hidden_states_equal_a_fresh_forward(run):
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.builtin.tiny_model import ensure_built
    _, rd, _ = run
    model = AutoModelForCausalLM.from_pretrained(str(ensure_built())).eval()
    ds = load_from_disk(str(rd.out_dir("prepare") / "data"))
    for i in (0, 17, 399):
        data = load_file(str(rd.out_dir("extract") / "hidden_states" / f"hs_{i}.safetensors"))
        ids = ds[i]["input_ids"]
        assert torch.equal(data["token_ids"], ids)
        with torch.no_grad():
            out = model(input_ids=ids[None], output_hidden_states=True)
        hs = data["hidden_states"]
        assert hs.shape == (len(ids), 4, 128) and hs.dtype == torch.float32
        for j, k in enumerate([1, 2, 3]):  # HF entry k = after k layers = vLLM id k
            torch.testing.assert_close(hs[:, j], out.hidden_states[k][0], atol=2e-5, rtol=1e-4)
        # id 4 (the last layer) is before the final norm; HF's last entry is after it.
        torch.testing.assert_close(model.model.norm(hs[:, 3][None])[0], out.hidden_states[4][0],
                                   atol=2e-5, rtol=1e-4)


def test_checkpoint_loads_in_speculators_with_the_vocab_stage_mapping(run):
    from speculators.model import SpeculatorModel
    _, rd, _ = run
    fin = [e for e in read_events(rd.events_path("train")) if e["type"] == "stage_finished"][-1]
    ckpt = Path(fin["summary"]["checkpoint"])
    assert ckpt.is_dir() and (ckpt / "model.safetensors").exists()
    model = SpeculatorModel.from_pretrained(str(ckpt))
    d2t = np.load(rd.out_dir("vocab") / "d2t-256.npy")
    t2d = np.load(rd.out_dir("vocab") / "t2d-256.npy")
    assert np.array_equal(model.d2t.cpu().numpy(), d2t)
    assert np.array_equal(model.t2d.cpu().numpy(), t2d)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    art = [e for e in read_events(rd.events_path("train")) if e["type"] == "artifact"]
    assert art and art[-1]["kind"] == "checkpoint"
    assert fin["summary"]["acceptance_length"] >= 1.0


def test_training_loss_decreases_and_steps_continue_across_resumes(run):
    _, rd, log = run
    attempts = train_attempts(rd)
    assert len(attempts) == 3
    first_loss = attempts[0][0]["values"]["loss"]
    last_loss = attempts[-1][-1]["values"]["loss"]
    assert last_loss < first_loss * 0.9
    # After the SIGKILL, training resumed at the checkpoint's global step, not 0.
    killed = log["killed_at_state"]
    resumed_from = attempts[1][0]["step"]
    assert resumed_from > 0
    assert resumed_from <= killed["global_step"] + 40
    # The graceful cancel saved its step: attempt 3 starts where attempt 2 stopped.
    assert attempts[2][0]["step"] == attempts[1][-1]["step"] + 1
    assert "sent SIGINT)" in log["cancel_output"]
    assert log["after_cancel"]["status"] == "cancelled" and log["after_cancel"]["exit_code"] == 130
    # ...and said where it resumes: the cancelled attempt's summary names the step and
    # the checkpoint folder that exists (not speculators' `interrupted`)
    ended = [e for e in read_events(rd.events_path("train")) if e["type"] == "stage_finished"]
    cancelled = next(e["summary"] for e in ended if e["status"] == "cancelled")
    assert cancelled["checkpoint_step"] in (attempts[1][-1]["step"], attempts[1][-1]["step"] + 1)
    resume_from = cancelled["resume_checkpoint"]
    assert Path(resume_from).is_dir() and "interrupted" not in resume_from
    assert "checkpoint" not in cancelled   # (that key names a trained draft)


def test_events_follow_the_protocol(run):
    _, rd, _ = run
    for stage in ("prepare", "extract", "vocab", "train"):
        evs = read_events(rd.events_path(stage))
        types = {e["type"] for e in evs}
        assert {"stage_started", "stage_finished", "progress"} <= types or stage == "vocab"
        assert all(isinstance(e["t"], float) for e in evs)
    prog = [e for e in read_events(rd.events_path("extract")) if e["type"] == "progress"][-1]
    assert prog["done"] == prog["total"] == 400
    for key in ("tokens_per_s", "bytes_written", "bytes_per_token", "disk_free_bytes"):
        assert key in prog
    phases = {e.get("phase") for e in read_events(rd.events_path("train"))
              if e["type"] == "progress"}
    assert {"validating", "saving checkpoint"} <= phases   # an epoch's end, named
    val = [e for e in read_events(rd.events_path("train"))
           if e["type"] == "metric" and e["split"] == "val"]
    assert val and {"loss", "full_acc_0", "full_acc_2"} <= set(val[-1]["values"])
