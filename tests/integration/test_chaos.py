"""A small chaos run in the suite (bench/chaos.py has the full one): a few
random SIGKILLs of any process of a running pipeline (the real vLLM route
where installed), resumed to the end, then compared with a run left alone."""

import json
import subprocess
import sys

from tests.helpers import ROOT


def test_a_few_random_kills_change_nothing(tmp_path):
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--kills", "4",
                        "--seed", "3", "--samples", "32", "--epochs", "2", "--no-evaluate",
                        "--max-gap", "4", "--work", str(tmp_path / "w"), "--json", str(out)],
                       capture_output=True, text=True, timeout=1500, check=False)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert p.returncode == 0 and r["ok"], p.stdout
    assert r["kills_made"] == r["kills_survived"] >= 4
    assert not r["leftover_processes"] and r["corrupt_found_on_resume"] == 0
    for rnd in r["rounds"]:   # each run against the undisturbed one
        c = rnd["comparison"]
        assert c["dataset_identical"] and c["vocab_identical"] and c["within_tolerance"]
        assert c["hidden_state_files_missing"] == 0
        if c["exact"]:   # the hf backend: bit for bit
            assert c["final_checkpoint_equal"] and c["loss_curve_equal"]
