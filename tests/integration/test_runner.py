"""The runner with real processes: tests.stagekit stands in for the stages."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pipeline.run.events import read_events
from pipeline.run.proctree import stage_processes
from pipeline.run.rundir import RunDir, pid_running
from pipeline.stage_graph import STAGE_NAMES
from tests.helpers import ROOT, cli, wait_for

ALL = list(STAGE_NAMES)


def starts(tmp_path):
    f = tmp_path / "starts.txt"
    return [line.split()[0] for line in f.read_text().splitlines()] if f.exists() else []


def state_of(tmp_path, run="t"):
    return RunDir(tmp_path / "runs" / run).read_state()


def test_full_run_then_skip_by_fingerprint(tmp_path, stagekit):
    stagekit()
    p = cli("run", "--wait", cwd=tmp_path, check=0)
    assert "[train] succeeded" in p.stdout
    st = state_of(tmp_path)
    assert [st["stages"][s]["status"] for s in ALL] == ["succeeded"] * 6
    assert all(st["stages"][s]["exit_code"] == 0 for s in st["stages"])
    assert starts(tmp_path) == ALL

    p = cli("run", "--wait", cwd=tmp_path, check=0)
    assert "up to date" in p.stdout and "nothing to run" in p.stdout
    assert len(starts(tmp_path)) == 6

    status = json.loads(cli("status", "--json", cwd=tmp_path, check=0).stdout)
    assert [r["status"] for r in status["stages"]] == ["succeeded"] * 6
    assert status["stages"][0]["attempt"] == 1


def test_changed_section_invalidates_downstream_only(tmp_path, stagekit):
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    # vocab's section changes: vocab and train (which reads it) re-run.
    vocab = {"vocab": {"draft_vocab_size": 77}}
    stagekit(extra={"stages": vocab})
    p = cli("run", "--wait", cwd=tmp_path, check=0)
    assert starts(tmp_path)[6:] == ["vocab", "train", "evaluate"], p.stdout
    assert "config changed" in p.stdout
    st = state_of(tmp_path)["stages"]
    assert st["prepare"]["attempt"] == 1 and st["vocab"]["attempt"] == 2
    # prepare changes: everything after it re-runs.
    stagekit(extra={"stages": {**vocab, "prepare": {"seq_length": 99}}})
    cli("run", "--wait", cwd=tmp_path, check=0)
    assert starts(tmp_path)[9:] == ["prepare", "extract", "vocab", "train", "evaluate"]
    assert state_of(tmp_path)["stages"]["regenerate"]["attempt"] == 1   # upstream: untouched


def test_a_stage_turned_off_is_skipped_and_its_reader_goes_on(tmp_path, stagekit):
    """regenerate off (its default): recorded as skipped with the reason,
    never started; prepare runs; turning it on later runs it and what reads it."""
    cfg = stagekit()
    cfg.write_text(cfg.read_text().replace("enabled = true\n", "", 1))
    p = cli("run", "--wait", cwd=tmp_path, check=0)
    assert "regenerate off     off ([stages.regenerate] enabled = false)" in p.stdout
    st = state_of(tmp_path)["stages"]
    assert st["regenerate"]["status"] == "skipped" and st["regenerate"]["attempt"] == 0
    assert "enabled = false" in st["regenerate"]["reason"]
    assert starts(tmp_path) == ALL[1:]
    p = cli("run", "--wait", cwd=tmp_path, check=0)
    assert "nothing to run" in p.stdout
    stagekit()   # as it was: enabled = true
    cli("run", "--wait", cwd=tmp_path, check=0)
    assert starts(tmp_path)[5:] == ALL   # on: it runs, and so does everything after it


def test_failure_stops_pipeline_and_resume_continues(tmp_path, stagekit):
    stagekit({"extract": "fail_once"})
    p = cli("run", "--wait", cwd=tmp_path, check=1)
    assert "first attempt fails on purpose" in p.stdout
    st = state_of(tmp_path)["stages"]
    assert st["extract"]["status"] == "failed" and st["extract"]["exit_code"] == 1
    assert st["vocab"]["status"] == "pending"
    p = cli("resume", "--wait", cwd=tmp_path, check=0)
    assert starts(tmp_path) == ["regenerate", "prepare", "extract", "extract", "vocab", "train",
                                "evaluate"]
    st = state_of(tmp_path)["stages"]
    assert st["extract"]["attempt"] == 2 and st["extract"]["status"] == "succeeded"


def test_stage_killed_by_sigkill_is_failed_with_signal(tmp_path, stagekit):
    stagekit({"prepare": "sigkill"})
    p = cli("run", "--wait", cwd=tmp_path, check=1)
    st = state_of(tmp_path)["stages"]["prepare"]
    assert st["status"] == "failed" and st["signal"] == "SIGKILL" and st["exit_code"] is None
    assert "killed by SIGKILL" in p.stdout
    assert "SIGKILL" in cli("status", cwd=tmp_path, check=0).stdout


def test_a_stage_dying_in_vllms_words_is_quoted_in_them(tmp_path, stagekit):
    """A stage that runs vLLM in its own process and dies without an error of
    its own: its supervisor quotes the cause from the log, behind vLLM's
    prefix, with the shape the driver handed down (run/ knows no vLLM)."""
    stagekit({"prepare": "vllm_crash"})
    cli("run", "--wait", cwd=tmp_path, check=1)
    rd = RunDir(tmp_path / "runs" / "t")
    err = [e for e in read_events(rd.events_path("prepare")) if e["type"] == "error"][-1]
    assert err["message"].endswith("from its log:\n(EngineCore_DP0 pid=12) ERROR 11-29 "
                                   "10:00:01 [core.py:2] KV cache too small"), err["message"]


def test_launcher_killed_stage_still_records_exit(tmp_path, stagekit):
    stagekit({"prepare": "gate"})   # held until the driver is dead (not a time budget)
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for(lambda: rd.read_state()["stages"]["prepare"].get("pid"), what="prepare pid")
    driver = rd.read_state()["driver"]["pid"]
    os.kill(driver, signal.SIGKILL)
    wait_for(lambda: not pid_running(driver), what="the driver gone")
    (rd.stage_dir("prepare") / "gate").write_text("go")
    st = wait_for(lambda: (s := rd.read_state()["stages"]["prepare"])["status"] != "running" and s,
                  timeout=20, what="prepare to end")
    assert st["status"] == "succeeded" and st["exit_code"] == 0
    # The next stage was not started: the driver is gone; resume picks up.
    assert rd.read_state()["stages"]["extract"]["status"] == "pending"
    cli("resume", "--wait", cwd=tmp_path, check=0)
    assert starts(tmp_path) == ALL


def test_relaunch_adopts_a_running_stage_instead_of_starting_it_twice(tmp_path, stagekit):
    stagekit({"prepare": "sleep:2"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for(lambda: rd.read_state()["stages"]["prepare"].get("pid"), what="prepare pid")
    os.kill(rd.read_state()["driver"]["pid"], signal.SIGKILL)
    wait_for(lambda: rd.lock_holder() is None, what="lock release")
    cli("resume", "--wait", cwd=tmp_path, check=0)
    assert starts(tmp_path).count("prepare") == 1


def test_cancel_escalates_and_kills_the_whole_tree(tmp_path, stagekit):
    stagekit({"prepare": "grandchild:60"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    marker = rd.stage_dir("prepare") / "grandchild.pid"
    wait_for(marker.exists, what="grandchild start")
    grandchild = int(marker.read_text())
    st = rd.read_state()["stages"]["prepare"]
    assert len(stage_processes(st["token"], st["pgid"])) >= 3
    t0 = time.monotonic()
    p = cli("cancel", "--grace", "1", cwd=tmp_path, check=0)
    took = time.monotonic() - t0
    assert "SIGKILL" in p.stdout, p.stdout  # the session-leader grandchild ignores TERM
    assert not pid_running(grandchild)
    assert stage_processes(st["token"], st["pgid"]) == []
    st = rd.read_state()["stages"]["prepare"]
    assert st["status"] == "cancelled"
    assert took < 15
    wait_for(lambda: not rd.read_state()["driver"], what="driver exit")
    assert rd.read_state()["stages"]["extract"]["status"] == "pending"


def test_cancel_of_a_stage_ignoring_sigterm(tmp_path, stagekit):
    stagekit({"extract": "ignore_term:60"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for(lambda: rd.read_state()["stages"]["extract"].get("pid"), what="extract pid")
    # the pid is recorded at spawn: a SIGINT before the stage ignores it would end it
    wait_for((rd.stage_dir("extract") / "ignore_term.ready").exists, what="signals ignored")
    pid = rd.read_state()["stages"]["extract"]["pid"]
    p = cli("cancel", "--stage", "extract", "--grace", "0.5", cwd=tmp_path, check=0)
    assert "SIGINT, SIGTERM, SIGKILL" in p.stdout
    st = rd.read_state()["stages"]["extract"]
    assert st["status"] == "cancelled" and st["signal"] == "SIGKILL"
    assert not pid_running(pid)


def test_graceful_cancel_lets_the_stage_save(tmp_path, stagekit):
    stagekit({"prepare": "graceful:60"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for((rd.stage_dir("prepare") / "graceful.ready").exists, what="the SIGINT handler")
    p = cli("cancel", cwd=tmp_path, check=0)
    assert "sent SIGINT)" in p.stdout
    assert (rd.stage_dir("prepare") / "graceful.marker").read_text() == "saved"
    st = rd.read_state()["stages"]["prepare"]
    assert st["status"] == "cancelled" and st["exit_code"] == 130


def test_concurrent_launchers_start_a_stage_once(tmp_path, stagekit):
    stagekit({"prepare": "sleep:1.5"})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--wait"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=60) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes.count(0) >= 1, outs
    assert set(codes) <= {0, 3}, outs
    assert starts(tmp_path) == ALL
    # exactly one was told it started the run (a later one finds it up to date); the
    # others were told who drives it, exit 3
    assert sum("started (driver pid" in out for out, _ in outs) == 1, outs
    assert all("already driving" in err for (_, err), p in zip(outs, procs, strict=True)
               if p.returncode == 3)


def test_a_cancel_during_a_launch_stops_what_the_launch_starts(tmp_path, stagekit):
    """The cancel comes after the launcher took the run and before its driver
    exists: recorded, the driver sees it before its first stage and ends (130),
    and the cancel says so. Then as a user does it: `run`, at once `cancel`:
    whichever comes first, nothing goes on running."""
    import threading

    from pipeline.drive import driver
    stagekit({"prepare": "sleep:60"})
    cli("run", "--stage", "regenerate", "--wait", cwd=tmp_path, check=0)   # the run exists
    rd = RunDir(tmp_path / "runs" / "t")
    lock, _ = driver.claim(rd, wait=0)
    results = []
    canceller = threading.Thread(target=lambda: results.extend(
        driver.cancel_run(rd, None, 1.0, 1.0)))
    canceller.start()
    wait_for(lambda: rd.read_state().get("cancel_requested"), what="the cancel recorded")
    p = driver.start_driver(rd, lock_fd=lock)
    os.close(lock)
    assert p.wait(timeout=60) == 130
    canceller.join(timeout=60)
    assert [(r.stage, r.was_running) for r in results] == [(None, True)], results
    assert starts(tmp_path) == ["regenerate"]
    assert rd.read_state()["stages"]["prepare"]["status"] == "pending"
    # the CLI, one after the other at once
    cli("run", cwd=tmp_path, check=0)
    c = cli("cancel", "--grace", "1", cwd=tmp_path, check=0)
    wait_for(lambda: rd.lock_holder() is None, timeout=60, what="the driver ended")
    said = "stopped before any stage started" in c.stdout or "prepare: cancelled" in c.stdout
    assert said, c.stdout
    assert all(st["status"] != "running" for st in rd.read_state()["stages"].values())


def test_a_cancel_before_the_stage_pid_is_recorded_still_stops_it(tmp_path, stagekit):
    """A cancel that lands after the driver marked the stage running and before
    the supervisor recorded the stage's pid finds nothing to signal (seen under
    load: `run` then `cancel` at once, the stage then ran its whole course). Its
    request is on the row: the supervisor reads it with its own record and
    stops the stage as the cancel would have."""
    from pipeline.config import load as load_config
    from pipeline.run.proctree import SUPERVISOR_VAR
    from pipeline.run.rundir import Status
    stagekit({"prepare": "sleep:60"})
    cli("run", "--stage", "regenerate", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    cfg = load_config(rd.config_path)
    token = "t/prepare/1/abcd"
    # the row as launch() writes it, and the cancel's request on it
    rd.update_stage("prepare", status=Status.RUNNING, attempt=1, token=token, devices=[],
                    cancel_requested=True, started_at=time.time())
    argv = [cfg.python(), "-m", cfg.stage_entry("prepare"), "--run-dir", str(rd.path),
            "--config", str(rd.config_path)]
    from pipeline.drive.driver import _stage_env
    sup = subprocess.run([sys.executable, "-m", "pipeline.run.supervise", "--run-dir",
                          str(rd.path), "--stage", "prepare", "--", *argv], cwd=rd.path,
                         env={**_stage_env(cfg, "prepare", 1), SUPERVISOR_VAR: token},
                         start_new_session=True, timeout=50, capture_output=True, text=True)
    st = rd.read_state()["stages"]["prepare"]
    assert st["status"] == Status.CANCELLED, (st, sup.stdout[-2000:], sup.stderr[-2000:])
    # stopped, not run to its end (without the supervisor's read: 60 s, past the timeout)
    done = [e["done"] for e in map(json.loads, open(rd.events_path("prepare")))
            if e["type"] == "progress"]
    assert not done or done[-1] < 600, done[-3:]


def test_supervisor_cleans_up_leftover_processes(tmp_path, stagekit):
    stagekit({"regenerate": "grandchild:0.2"})
    cli("run", "--stage", "regenerate", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    grandchild = int((rd.stage_dir("regenerate") / "grandchild.pid").read_text())
    assert not pid_running(grandchild)
    st = rd.read_state()["stages"]["regenerate"]
    assert stage_processes(st["token"], None) == []


def test_single_stage_needs_its_inputs(tmp_path, stagekit):
    stagekit()
    p = cli("run", "--stage", "train", cwd=tmp_path, check=2)
    assert "prepare" in p.stderr and "has not succeeded" in p.stderr
    assert starts(tmp_path) == []


def test_force_rerun_clears_outputs(tmp_path, stagekit):
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    (rd.out_dir("vocab") / "old.bin").write_text("stale")
    cli("run", "--stage", "vocab", "--force", "--wait", cwd=tmp_path, check=0)
    assert not (rd.out_dir("vocab") / "old.bin").exists()
    assert starts(tmp_path)[-1] == "vocab"


def test_logs_and_runs(tmp_path, stagekit):
    stagekit({"prepare": "fail:3"})
    p = cli("run", "--config", "config.toml", cwd=tmp_path, check=0)
    # the hints name the options that found the run (without them: the project's other run)
    assert "eagle-panel status t --config config.toml" in p.stdout
    assert "eagle-panel logs t STAGE -f --config config.toml" in p.stdout
    wait_for(lambda: RunDir(tmp_path / "runs/t").read_state()["stages"]["prepare"]["status"]
             == "failed", timeout=60, what="prepare to fail")
    p = cli("logs", "prepare", cwd=tmp_path, check=0)
    assert "failing on purpose" in p.stdout
    # options before or after the command and its arguments, without RUN too
    for argv in (("logs", "--config", "config.toml", "prepare"),
                 ("logs", "prepare", "--config", "config.toml", "-n", "3"),
                 ("--config", "config.toml", "logs", "-n", "3", "t", "prepare"),
                 ("logs", "-n", "3", "prepare")):
        assert "failing on purpose" in cli(*argv, cwd=tmp_path, check=0).stdout, argv
    p = cli("logs", "--config", "config.toml", "prepare", "--server", "0", cwd=tmp_path, check=2)
    assert "prepare has no log of server '0'" in p.stderr
    p = cli("runs", cwd=tmp_path, check=0)
    assert p.stdout.startswith("t ") and "prepare:failed" in p.stdout
    assert "3" in cli("status", cwd=tmp_path, check=0).stdout
    diary = (tmp_path / "runs/t/driver.log").read_text().splitlines()
    said = [ln for ln in diary if "[prepare]" in ln]
    assert said and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[prepare\]", ln)
                        for ln in said), said   # every line of the driver's diary has its time


def test_state_survives_writers_killed_mid_write(tmp_path):
    rd = RunDir(tmp_path / "r")
    rd.create("", tmp_path)
    code = ("import sys; from pipeline.run.rundir import RunDir\n"
            "rd = RunDir(sys.argv[1]); i = 0\n"
            "while True:\n"
            "    i += 1; rd.update_stage('train', attempt=i, reason='x' * (i % 5000))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for i in range(15):
        writers = [subprocess.Popen([sys.executable, "-c", code, str(rd.path)], env=env)
                   for _ in range(2)]
        time.sleep(0.25 + (i % 5) * 0.03)
        for w in writers:
            w.send_signal(signal.SIGKILL)
            w.wait()
        st = rd.read_state()["stages"]["train"]  # raises if the file were torn
        # the two fields of one write, together: no write was half applied
        # (attempt 0: the writers were killed before their first write)
        assert st["reason"] == ("x" * (st["attempt"] % 5000) if st["attempt"] else None)
    leftovers = [p for p in rd.path.iterdir() if p.name.endswith(".tmp")]
    # A killed writer may leave its temp file; it is never the state itself.
    assert all(p.name.startswith(".state.json.") for p in leftovers)


def test_stage_log_gets_stdout_and_stderr(tmp_path, stagekit):
    stagekit({"prepare": "fail:1"})
    cli("run", "--wait", cwd=tmp_path, check=1)
    log = (tmp_path / "runs/t/prepare/stage.log").read_text()
    assert "stagekit prepare: fail" in log and "failing on purpose" in log


@pytest.mark.parametrize("bad", ["not json", '{"stages": 5}', ""])
def test_corrupt_state_is_reported_not_reset(tmp_path, stagekit, bad):
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    state_path = tmp_path / "runs/t/state.json"
    state_path.write_text(bad)
    for args in (("status",), ("status", "t"), ("run",), ("resume", "t")):
        p = cli(*args, cwd=tmp_path, check=2)
        assert "corrupt state file" in p.stderr, (args, p.stderr)
    assert state_path.read_text() == bad
    assert len(starts(tmp_path)) == 6


def test_run_directories_are_private_unless_shared(tmp_path, stagekit):
    """Hidden states and datasets are the user's data: a new run directory is
    0700, or 0750 with [run] shared = true; doctor warns about one others
    can read."""
    import stat

    from pipeline import config as config_mod
    from pipeline import doctor
    cfg = stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    run = tmp_path / "runs" / "t"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    stagekit(extra={"run": {"shared": True}}, name="g")
    cli("run", "--wait", cwd=tmp_path, check=0)
    assert stat.S_IMODE((tmp_path / "runs" / "g").stat().st_mode) == 0o750
    run.chmod(0o755)
    loaded = config_mod.load(cfg)
    loaded.run.name, loaded.run.shared = "t", False
    (finding,) = doctor.check_privacy(doctor.Inputs(loaded, {}, None, None))
    assert finding.level == doctor.WARN and "other users" in finding.message
    assert f"chmod 700 {run}" in finding.fix


def test_a_stage_outliving_its_killed_supervisor(tmp_path, stagekit):
    """Supervisor SIGKILLed: a stage that then finishes keeps its own recorded
    success (nothing redone); a stage then SIGKILLed too is failed, and what
    it left running in a session of its own (like a vLLM server) is stopped
    by its token as soon as anyone looks."""
    stagekit({"prepare": "gate", "extract": "grandchild:60"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for(lambda: rd.read_state()["stages"]["prepare"].get("pid"), what="prepare running")
    os.kill(rd.read_state()["stages"]["prepare"]["supervisor_pid"], signal.SIGKILL)
    # prepare finishes only now, its supervisor gone: however fast the machine
    (rd.stage_dir("prepare") / "gate").write_text("go")
    wait_for(lambda: rd.read_state()["stages"]["extract"].get("pid")
             and (rd.stage_dir("extract") / "grandchild.pid").exists(), timeout=60,
             what="extract running with its grandchild")
    st = rd.read_state()["stages"]["prepare"]
    assert st["status"] == "succeeded" and "own last event" in st["reason"], st
    ext = rd.read_state()["stages"]["extract"]
    grandchild = int((rd.stage_dir("extract") / "grandchild.pid").read_text())
    os.kill(ext["supervisor_pid"], signal.SIGKILL)
    os.killpg(ext["pgid"], signal.SIGKILL)
    assert pid_running(grandchild)   # its own session: the group kill missed it
    p = cli("status", cwd=tmp_path, check=0)
    assert "extract    failed" in p.stdout
    wait_for(lambda: not pid_running(grandchild), timeout=15, what="the orphan stopped")
    assert starts(tmp_path).count("prepare") == 1


def test_watch_hints_repeat_the_options_that_found_the_run(tmp_path):
    """`run --wait --config X` that ends before its stages ran hints a resume
    with --config X: without it, from another folder, resume reads another run."""
    import io

    from app.cli import EXIT_FAILED, watch
    rd = RunDir(tmp_path / "r")
    rd.create("", tmp_path)   # no driver: the launcher is gone, prepare never ran
    out = io.StringIO()
    where = f" --config {tmp_path / 'my.toml'}"
    assert watch(rd, out=out, expected=["prepare"], where=where) == EXIT_FAILED
    assert f"`eagle-panel resume {rd.id}{where}` continues" in out.getvalue(), out.getvalue()
