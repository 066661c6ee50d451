"""Hostile CLI arguments and damaged run directories (issue 31, items 2-4).

Every case asserts: the documented exit (2 for bad input), a message that
names the option, file or key, no traceback, nothing created or changed
outside what the command is for, and, for `cancel`, that a process whose
identity cannot be verified is never signalled. Most cases call the CLI's
`main` in this process (it returns the exit status the process would exit
with); a few run the real CLI where the process's own exit matters (argv
parsing, a driver started and waited for, a fake scancel on PATH).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app import cli as cli_mod
from pipeline import config as config_mod
from pipeline.drive import driver
from pipeline.run.events import EventWriter
from pipeline.run.proctree import SUPERVISOR_VAR, environ
from pipeline.run.reconcile import reconcile
from pipeline.run.rundir import RunDir, pid_running, proc_start_ticks
from pipeline.stage_graph import STAGE_NAMES
from tests.helpers import ROOT, cli, stagekit_config, wait_for


def tree(root) -> dict:
    """Every path under `root` (links not followed): kind, size, mtime, content hash."""
    out = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(here, name)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), st.st_size,
                                             st.st_mtime_ns, digest)
    return out


@pytest.fixture
def finished(tmp_path):
    """A finished run `t` (every stage succeeded, fingerprints current),
    made in-process in well under a second: no stage runs."""
    cfg_path = stagekit_config(tmp_path)
    cfg = config_mod.load(cfg_path)
    rd = RunDir(tmp_path / "runs" / "t")
    rd.create(cfg_path.read_text(), tmp_path)
    fps = driver.fingerprints(cfg)
    now = time.time()
    with rd.mutate_state() as state:
        for s in STAGE_NAMES:
            state["stages"][s].update(status="succeeded", attempt=1, fingerprint=fps[s],
                                      out_fingerprint=fps[s], started_at=now - 5,
                                      ended_at=now - 4, exit_code=0, token=f"t/{s}/1/ab")
    for s in STAGE_NAMES:
        rd.log_path(s).write_text(f"{s} log line\n")
        with EventWriter(rd.events_path(s)) as ev:
            ev.emit("stage_started", stage=s, attempt=1, argv=["x"], devices=[])
            ev.emit("progress", done=1, total=1, unit="steps")
            ev.emit("stage_finished", status="succeeded", duration_s=1.0, summary={})
    return rd, cfg_path


def run_main(capsys, *argv) -> tuple[int, str, str]:
    code = cli_mod.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# -- CLI arguments --------------------------------------------------------------

BAD_RUN_IDS = ["../../elsewhere/x", "/abs/path/x", "..", ".", ".hidden", "", "a/b",
               "a\\b", "tab\there", "x" * 300]


@pytest.mark.parametrize("bad", BAD_RUN_IDS)
def test_a_run_id_is_checked_like_run_name_before_anything_is_created(tmp_path, capsys, bad):
    cfg = stagekit_config(tmp_path)
    before, around = tree(tmp_path), sorted(os.listdir(tmp_path.parent))
    code, _, err = run_main(capsys, "run", "--config", cfg, "--run", bad)
    assert code == 2 and "--run" in err and "plain folder name" in err
    assert tree(tmp_path) == before, "a refused run id created or changed something"
    assert sorted(os.listdir(tmp_path.parent)) == around
    assert not os.path.lexists("/abs/path")


def test_a_bad_run_id_through_the_real_cli(tmp_path):
    stagekit_config(tmp_path)
    before = tree(tmp_path)
    for bad in ("../../elsewhere/x", ".."):
        p = cli("run", "--run", bad, cwd=tmp_path, check=2)
        assert "--run" in p.stderr and "Traceback" not in p.stderr
    assert tree(tmp_path) == before
    assert not (tmp_path.parent / "elsewhere").exists()


@pytest.mark.parametrize("bad", ["../x", "/nonexistent/run", ".hidden", "t/../../x"])
def test_a_run_argument_that_names_no_run(finished, capsys, bad):
    rd, cfg = finished
    before = tree(rd.path.parent.parent)
    for cmd in ("status", "resume", "cancel"):
        code, _, err = run_main(capsys, cmd, bad, "--config", cfg)
        assert code == 2 and ("no such run" in err or "plain folder name" in err), err
    assert tree(rd.path.parent.parent) == before


def test_runs_dir_that_is_not_a_folder(finished, capsys, tmp_path):
    rd, cfg = finished
    afile = tmp_path / "afile"
    afile.write_text("x")
    for where in (afile, tmp_path / "missing", ""):
        # (accepted: `run --runs-dir NEW` makes the folder, as [run] runs_dir does)
        for cmd in ("runs", "status") + (("run",) if where != tmp_path / "missing" else ()):
            code, _, err = run_main(capsys, cmd, "--config", cfg, "--runs-dir", where)
            assert code == 2 and "--runs-dir" in err and "not a folder" in err, err
    assert not (tmp_path / "missing").exists()
    # [run] runs_dir naming a file: `runs` and `run` say so (no FileExistsError)
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace('runs_dir = "runs"', 'runs_dir = "afile"'))
    before = tree(tmp_path)
    for cmd in (("runs",), ("run", "--skip-checks")):
        code, _, err = run_main(capsys, *cmd, "--config", bad)
        assert code == 2 and "runs_dir" in err and "not a folder" in err, err
    assert tree(tmp_path) == before


def test_logs_of_a_stage_that_has_no_log(finished, capsys):
    rd, cfg = finished
    rd.log_path("train").unlink()
    code, out, err = run_main(capsys, "logs", "t", "train", "--config", cfg)
    assert code == 2 and "no log" in err and "removed" in err and out == ""


# -- damaged state.json ---------------------------------------------------------

def _set(path: list, value):
    def apply(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return state
    return apply


STATE_DAMAGE = {
    "created_at": (_set(["created_at"], "yesterday"), "created_at"),
    "created_at-bool": (_set(["created_at"], True), "created_at"),
    "stage-entry": (_set(["stages", "train"], 5), "stages.train"),
    "started_at": (_set(["stages", "train", "started_at"], "yesterday"), "stages.train.started_at"),
    "ended_at-inf": (_set(["stages", "train", "ended_at"], [1]), "stages.train.ended_at"),
    "attempt": (_set(["stages", "train", "attempt"], "1"), "stages.train.attempt"),
    "attempt-negative": (_set(["stages", "train", "attempt"], -1), "stages.train.attempt"),
    "status": (_set(["stages", "train", "status"], "done"), "stages.train.status"),
    "status-null": (_set(["stages", "train", "status"], None), "stages.train.status"),
    "pid": (_set(["stages", "train", "pid"], "123"), "stages.train.pid"),
    "pid-negative": (_set(["stages", "train", "pid"], -1), "stages.train.pid"),
    "create_time": (_set(["stages", "train", "create_time"], 1.5), "stages.train.create_time"),
    "devices": (_set(["stages", "train", "devices"], "0"), "stages.train.devices"),
    "token": (_set(["stages", "train", "token"], 7), "stages.train.token"),
    "cancel_requested": (_set(["stages", "train", "cancel_requested"], "yes"),
                         "stages.train.cancel_requested"),
    "slurm_job": (_set(["stages", "train", "slurm_job"], "--all"), "stages.train.slurm_job"),
    "exit_code": (_set(["stages", "train", "exit_code"], "0"), "stages.train.exit_code"),
    "driver": (_set(["driver"], 3), "driver"),
    "driver-pid": (_set(["driver"], {"pid": "x"}), "driver.pid"),
    "stages-list": (_set(["stages"], []), "stages"),
    "unknown-stage": (_set(["stages", "later"], "x"), "stages.later"),
    "target": (_set(["target"], "main"), "target"),
    "top-list": (lambda state: [state], "(top level)"),
}


@pytest.mark.parametrize("case", sorted(STATE_DAMAGE))
def test_a_damaged_state_field_is_named_and_left_untouched(finished, capsys, case):
    rd, cfg = finished
    damage, key = STATE_DAMAGE[case]
    rd.state_path.write_text(json.dumps(damage(json.loads(rd.state_path.read_text()))))
    before = tree(rd.path.parent.parent)
    for cmd in (("status", "t"), ("status", "t", "--json"), ("runs",), ("resume", "t"),
                ("cancel", "t")):
        code, out, err = run_main(capsys, *cmd, "--config", cfg)
        said = err if cmd[0] != "runs" else out   # `runs` lists it among the others
        assert code == 2, (cmd, code, err)
        assert "corrupt state file" in said and f"`{key}`" in said, (cmd, said)
    # accepted: `logs` reads only the log, which is what one wants from a damaged run
    code, out, _ = run_main(capsys, "logs", "t", "train", "--config", cfg)
    assert code == 0 and "train log line" in out
    assert tree(rd.path.parent.parent) == before, "a reader or launcher changed the run"


def test_a_state_file_nested_too_deep_is_corrupt_not_a_recursion_error(finished, capsys):
    rd, cfg = finished
    rd.state_path.write_text("[" * 200_000)
    code, _, err = run_main(capsys, "status", "t", "--config", cfg)
    assert code == 2 and "corrupt state file" in err


def test_run_on_a_damaged_state_does_not_rewrite_the_frozen_config(finished):
    rd, cfg = finished
    state = json.loads(rd.state_path.read_text())
    state["created_at"] = "yesterday"
    rd.state_path.write_text(json.dumps(state))
    before = tree(rd.path)
    p = cli("run", cwd=cfg.parent, check=2)
    assert "`created_at`" in p.stderr and "Traceback" not in p.stderr
    assert tree(rd.path) == before


# -- damaged files and links in the run folder ----------------------------------

def _dir_for(path):
    path.unlink()
    path.mkdir()


FILE_DAMAGE = {
    "events-a-folder": (lambda rd: _dir_for(rd.events_path("train")), "events.jsonl"),
    "log-a-folder": (lambda rd: _dir_for(rd.log_path("train")), "stage.log"),
    "provenance-a-folder": (lambda rd: (rd.stage_dir("train") / "provenance.json").mkdir(),
                            "provenance.json"),
    "stage-folder-a-file": (lambda rd: (_rmtree(rd.stage_dir("train")),
                                        rd.stage_dir("train").write_text("x")), "train"),
    "events-a-fifo": (lambda rd: (rd.events_path("train").unlink(),
                                  os.mkfifo(rd.events_path("train"))), "events.jsonl"),
    "out-a-file": (lambda rd: (_rmtree(rd.out_dir("train")), rd.out_dir("train").write_text("x")),
                   "train/out"),
    "lock-a-folder": (lambda rd: rd.lock_path.mkdir(), "lock"),
    "state-lock-a-folder": (lambda rd: ((rd.path / ".state.lock").unlink(),
                                        (rd.path / ".state.lock").mkdir()), ".state.lock"),
    "driver-log-a-folder": (lambda rd: (rd.path / "driver.log").mkdir(), "driver.log"),
}


def _rmtree(path):
    import shutil
    shutil.rmtree(path)


@pytest.mark.parametrize("case", sorted(FILE_DAMAGE))
def test_a_damaged_file_is_named_not_a_traceback(finished, capsys, case):
    rd, cfg = finished
    damage, name = FILE_DAMAGE[case]
    damage(rd)
    before = tree(rd.path.parent.parent)
    for cmd in (("status", "t"), ("status", "t", "--json"), ("resume", "t"), ("run",)):
        code, out, err = run_main(capsys, *cmd, "--config", cfg)
        assert code == 2 and "corrupt run directory" in err and name in err, (cmd, err)
    # `logs` reads the log only: refused when it is what is damaged
    code, _, err = run_main(capsys, "logs", "t", "train", "--config", cfg)
    assert code == (2 if name in ("stage.log", "train") else 0), err
    assert tree(rd.path.parent.parent) == before


def _links_out(rd, tmp_path):
    secret = tmp_path / "someone-elses.txt"
    secret.write_text("SECRET CONTENT\n")
    return secret


@pytest.mark.parametrize("which", ["stage.log", "vllm-0.log", "events.jsonl",
                                   "provenance.json", "state.json", "config.toml"])
def test_a_link_that_leaves_the_run_is_never_read(finished, capsys, tmp_path, which):
    rd, cfg = finished
    secret = _links_out(rd, tmp_path)
    link = rd.path / which if which in ("state.json", "config.toml") else \
        rd.stage_dir("train") / which
    if which == "state.json":   # the real one moved out of the run: still outside
        os.replace(rd.state_path, secret)
    elif link.exists():
        link.unlink()
    os.symlink(secret, link)
    for cmd in (("status", "t"), ("logs", "t", "train"), ("logs", "t", "train", "--server", "0")):
        code, out, err = run_main(capsys, *cmd, "--config", cfg)
        assert "SECRET" not in out + err
        if cmd[0] == "status" or \
                (which == "stage.log" and len(cmd) == 3) or (which == "vllm-0.log" and len(cmd) > 3):
            assert code == 2 and "outside" in err, (cmd, err)


@pytest.mark.parametrize("which", ["config.toml", "state.json"])
def test_a_launcher_refuses_a_link_out_of_the_run(finished, capsys, tmp_path, which):
    rd, cfg = finished
    outside = tmp_path / f"outside-{which}"
    os.replace(rd.path / which, outside)
    os.symlink(outside, rd.path / which)
    before = tree(tmp_path)
    for cmd in (("resume", "t"), ("run",)):
        code, _, err = run_main(capsys, *cmd, "--config", cfg)
        assert code == 2 and "outside" in err, (cmd, err)
    assert tree(tmp_path) == before


def test_the_panel_does_not_read_an_events_file_linked_out_of_the_run(finished, tmp_path):
    from pipeline.run.snapshot import read_run
    rd, _ = finished
    secret = tmp_path / "their-events.jsonl"
    secret.write_text(json.dumps({"t": 1, "type": "error", "message": "THEIR SECRET"}) + "\n")
    rd.events_path("train").unlink()
    os.symlink(secret, rd.events_path("train"))
    view = read_run(rd)
    assert view.stages["train"].last_error is None
    assert "outside" in (view.state_error or "")
    assert view.stages["prepare"].finished is not None   # the others are read


def test_a_link_inside_the_run_is_followed(finished, capsys):
    """Accepted: a link that stays inside the run (a user's own shortcut)."""
    rd, cfg = finished
    real = rd.stage_dir("train") / "old.log"
    os.replace(rd.log_path("train"), real)
    os.symlink(real, rd.log_path("train"))
    code, out, _ = run_main(capsys, "logs", "t", "train", "--config", cfg)
    assert code == 0 and "train log line" in out


def test_damaged_event_lines_are_skipped_not_fatal(finished, capsys):
    """Accepted (exit 0): a damaged events line is skipped like a half-written
    one; the rest of the file still tells the stage's story."""
    rd, cfg = finished
    with open(rd.events_path("train"), "a") as f:
        for line in ('{"t": "now", "type": "progress", "done": 1, "total": 2, "unit": "x"}',
                     '{"t": 1, "type": "progress", "done": "lots", "total": 2, "unit": "x"}',
                     '[{"type":"progress"}]', '{"t": 1, "type": "server", "server": 0, '
                     '"phase": 5, "elapsed_s": "x", "phase_s": 0, "last_line": ""}',
                     '{"t": 1, "type": "stage_finished", "status": 1, "summary": 3}',
                     '{"t": 1, "type": "stage_finished", "status": "succeeded", "duration_s": 1,'
                     ' "summary": {"acceptance_length": "high", "samples": "many"}}', "nul\0l"):
            f.write(line + "\n")
    before = tree(rd.path)
    for cmd in (("status", "t"), ("status", "t", "--json")):
        code, out, _ = run_main(capsys, *cmd, "--config", cfg)
        assert code == 0 and "succeeded" in out
    assert tree(rd.path) == before


# -- outputs deleted behind the run's back -----------------------------------------

def test_deleted_outputs_are_not_shown_as_succeeded_and_resume_reruns_them(finished, capsys):
    rd, cfg = finished
    _rmtree(rd.out_dir("vocab"))
    _rmtree(rd.stage_dir("train"))
    before = tree(rd.path)
    code, out, _ = run_main(capsys, "status", "t", "--config", cfg)
    assert code == 0
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0]
             in STAGE_NAMES}
    assert "outputs missing" in lines["train"] and "outputs missing" in lines["vocab"]
    assert "succeeded" in lines["prepare"] and "train/out is missing" in out
    code, out, _ = run_main(capsys, "status", "t", "--json", "--config", cfg)
    rows = {r["stage"]: r for r in json.loads(out)["stages"]}
    assert rows["train"]["status"] == "outputs missing"
    code, _, err = run_main(capsys, "logs", "t", "train", "--config", cfg)
    assert code == 2 and "no log" in err
    assert tree(rd.path) == before, "a reader wrote"
    # what resume plans: those two again (and evaluate, which reads train), nothing else
    steps = driver.plan(driver.load_run_config(rd), reconcile(rd))
    assert {s.stage for s in steps if s.action == "run"} == {"vocab", "train", "evaluate"}
    # ...and does (the real CLI: stagekit stages, a second each)
    cli("resume", "t", "--wait", cwd=cfg.parent, check=0)
    state = rd.read_state()
    assert [state["stages"][s]["attempt"] for s in STAGE_NAMES] == [1, 1, 1, 2, 2, 2]
    assert rd.out_dir("train").is_dir()


# -- process safety -----------------------------------------------------------------

@pytest.fixture
def bystander():
    """An unrelated live process, leader of its own process group."""
    p = subprocess.Popen(["sleep", "120"], start_new_session=True)
    # exec'd: while execve runs its environment reads empty, and is taken on trust
    wait_for(lambda: any(b"=" in e for e in environ(p.pid)), what="the bystander exec'd")
    yield p
    p.kill()
    p.wait()


def _running_row(rd, **fields):
    with rd.mutate_state() as state:
        state["stages"]["train"].update(status="running", attempt=2, ended_at=None,
                                        exit_code=None, token="t/train/2/deadbeef", **fields)
        for s in ("evaluate",):
            state["stages"][s].update(status="pending", attempt=0)
    with EventWriter(rd.events_path("train")) as ev:   # the attempt has begun
        ev.emit("stage_started", stage="train", attempt=2, argv=["x"], devices=[])


@pytest.mark.parametrize("fields", [
    lambda pid: {"pid": pid, "pgid": pid, "create_time": None},
    lambda pid: {"supervisor_pid": pid, "supervisor_create_time": None},
    lambda pid: {"pid": pid, "pgid": pid, "create_time": None, "supervisor_pid": pid,
                 "supervisor_create_time": None},
], ids=["stage-pid", "supervisor-pid", "both"])
def test_cancel_never_signals_a_process_it_cannot_verify(finished, capsys, bystander, fields):
    rd, cfg = finished
    _running_row(rd, **fields(bystander.pid))
    code, out, _ = run_main(capsys, "status", "t", "--config", cfg)
    row = next(ln for ln in out.splitlines() if ln.startswith("train"))
    assert code == 0 and "unknown" in row, out
    assert "without a start time" in out and "eagle-panel resume t" in out
    p = cli("cancel", "t", "--config", cfg, cwd=cfg.parent, check=0)
    assert "sent nothing" in p.stdout, p.stdout
    time.sleep(0.2)
    assert bystander.poll() is None and pid_running(bystander.pid), "cancel signalled it"
    assert rd.read_state()["stages"]["train"]["status"] == "cancelled"


def test_a_row_naming_a_process_the_run_did_not_start_is_unknown_and_never_signalled(
        finished, capsys, bystander):
    """A row carrying an unrelated process's pid with its real start time (as
    stage and as supervisor, one process group and session of its own): pid
    and start time prove which process it is, not that the run started it.
    Shown unknown with why and the command that clears it; `resume` and
    `cancel` send it nothing."""
    rd, cfg = finished
    ticks = proc_start_ticks(bystander.pid)
    _running_row(rd, pid=bystander.pid, pgid=bystander.pid, create_time=ticks,
                 supervisor_pid=bystander.pid, supervisor_create_time=ticks)
    code, out, _ = run_main(capsys, "status", "t", "--config", cfg)
    assert code == 0 and "unknown" in next(ln for ln in out.splitlines()
                                           if ln.startswith("train")), out
    assert "was not started by this run" in out and "eagle-panel resume t" in out, out
    p = cli("cancel", "t", "--config", cfg, cwd=cfg.parent, check=0)
    assert "sent nothing" in p.stdout, p.stdout
    assert bystander.poll() is None and pid_running(bystander.pid), "cancel signalled it"
    assert rd.read_state()["stages"]["train"]["status"] == "cancelled"
    assert "was not started by this run" in rd.read_state()["stages"]["train"]["reason"]


def test_a_reused_pid_with_another_start_time_is_not_the_stage(finished, capsys, bystander):
    rd, cfg = finished
    ticks = proc_start_ticks(bystander.pid)
    _running_row(rd, pid=bystander.pid, pgid=bystander.pid, create_time=ticks + 1,
                 supervisor_pid=bystander.pid, supervisor_create_time=ticks + 1)
    code, out, _ = run_main(capsys, "status", "t", "--config", cfg)
    assert "failed" in next(ln for ln in out.splitlines() if ln.startswith("train"))
    code, out, _ = run_main(capsys, "cancel", "t", "--config", cfg)
    assert code == 0 and "nothing running" in out
    assert bystander.poll() is None


def test_slurm_fields_on_a_run_without_slurm_are_unknown_and_never_scancelled(
        finished, tmp_path, bystander):
    rd, cfg = finished
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("scancel", "squeue", "scontrol", "sbatch"):
        (bin_ / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {tmp_path}/slurm-calls\n")
        (bin_ / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}")
    _running_row(rd, slurm_job="4242")
    p = cli("status", "t", cwd=tmp_path, env=env, check=0)
    assert "unknown" in p.stdout and "does not use Slurm" in p.stdout
    p = cli("cancel", "t", cwd=tmp_path, env=env, check=0)
    assert not (tmp_path / "slurm-calls").exists(), (tmp_path / "slurm-calls").read_text()
    assert rd.read_state()["stages"]["train"]["status"] == "cancelled"


def test_cancel_on_a_finished_run_writes_nothing(finished, capsys):
    rd, cfg = finished
    before = tree(rd.path)
    code, out, _ = run_main(capsys, "cancel", "t", "--config", cfg)
    assert code == 0 and "nothing running" in out
    assert tree(rd.path) == before


def test_a_stage_without_its_pid_yet_is_anchored_on_its_supervisor(finished, tmp_path,
                                                                   bystander):
    """Just started: the supervisor (pid and start time recorded first) is
    verified, the stage's own pid not written yet. cancel stops the stage
    (found by the attempt's token in the supervisor's session), not the
    supervisor, and nothing else."""
    rd, cfg = finished
    token = "t/train/2/cafef00d"
    code = ("import os, subprocess, sys\n"
            "p = subprocess.Popen(['sleep', '120'], env={**os.environ, "
            f"'EAGLE_PANEL_TOKEN': {token!r}}})\n"
            "open(sys.argv[1], 'w').write(str(p.pid)); sys.exit(p.wait() and 0)\n")
    marker = tmp_path / "child.pid"
    sup = subprocess.Popen([sys.executable, "-c", code, str(marker)], start_new_session=True,
                           env={**os.environ, SUPERVISOR_VAR: token})
    try:
        wait_for(lambda: marker.exists() and marker.read_text(), what="the stage up")
        child = int(marker.read_text())
        wait_for(lambda: proc_start_ticks(child) is not None, what="the child")
        _running_row(rd, supervisor_pid=sup.pid,
                     supervisor_create_time=proc_start_ticks(sup.pid))
        with rd.mutate_state() as state:
            state["stages"]["train"]["token"] = token
        p = cli("cancel", "t", "--grace", "2", cwd=tmp_path, check=0)
        assert "SIGINT" in p.stdout, p.stdout
        wait_for(lambda: not pid_running(child), timeout=10, what="the stage stopped")
        assert bystander.poll() is None
    finally:
        sup.kill()
        sup.wait()


# -- shared runs ------------------------------------------------------------------

def test_a_shared_run_is_group_readable_never_group_writable_whatever_the_umask(tmp_path):
    stagekit_config(tmp_path, extra={"run": {"shared": True}})
    p = subprocess.run([sys.executable, "-m", "app.cli", "run", "--wait"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       preexec_fn=lambda: os.umask(0o002))
    assert p.returncode == 0, p.stderr
    run = tmp_path / "runs" / "t"
    modes = {}
    for here, dirs, files in os.walk(run):
        for name in dirs + files:
            path = os.path.join(here, name)
            modes[os.path.relpath(path, run)] = stat.S_IMODE(os.lstat(path).st_mode)
    assert stat.S_IMODE(run.stat().st_mode) == 0o750
    writable = {k: oct(m) for k, m in modes.items() if m & (stat.S_IWGRP | stat.S_IWOTH)}
    assert not writable, writable
    unreadable = {k: oct(m) for k, m in modes.items() if not m & stat.S_IRGRP}
    assert not unreadable, unreadable
    assert modes["train"] == 0o750 and modes["train/out"] == 0o750


def test_outputs_on_a_scratch_disk_through_a_link_are_read(finished, capsys, tmp_path):
    """Accepted: a stage's out/ linked to another disk (terabytes of hidden
    states on scratch) is a folder readers list, not a file they print."""
    rd, cfg = finished
    scratch = tmp_path / "scratch-out"
    os.replace(rd.out_dir("train"), scratch)
    os.symlink(scratch, rd.out_dir("train"))
    code, out, err = run_main(capsys, "status", "t", "--config", cfg)
    assert code == 0 and "outside" not in err, err
    assert "outputs missing" not in out


# -- where a run may be ----------------------------------------------------------

def test_a_run_directory_that_is_a_link_is_never_followed(finished, tmp_path, capsys):
    """runs/lnk -> a finished run kept outside runs_dir: not listed, and
    `status`, `resume` and `run --run lnk` refuse it (exit 2, the link named)
    without writing anything on either side of the link."""
    rd, cfg = finished
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    import shutil
    shutil.copytree(rd.path, outside / "kept")
    os.symlink(outside / "kept", tmp_path / "runs" / "lnk")
    before = tree(tmp_path / "runs"), tree(outside)
    code, out, _ = run_main(capsys, "runs", "--config", cfg)
    assert code == 0 and "lnk" not in out and "t" in out, out
    for argv in (["status", "lnk"], ["resume", "lnk"], ["run", "--run", "lnk"]):
        code, out, err = run_main(capsys, *argv, "--config", cfg)
        assert code == 2 and "a link" in err and "lnk" in err, (argv, out, err)
    assert (tree(tmp_path / "runs"), tree(outside)) == before


def test_a_runs_dir_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """A runs folder on a read-only filesystem (sysfs: read-only to root too)."""
    ro = Path("/sys/kernel/eagle-panel-runs")
    stagekit_config(tmp_path, extra={"run": {"runs_dir": str(ro)}})
    code, out, err = run_main(capsys, "run", "--config", tmp_path / "config.toml")
    assert code == 2 and "cannot create or lock the run" in err and str(ro) in err, err
    assert not ro.exists()
