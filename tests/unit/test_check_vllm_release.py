"""scripts/check_vllm_release.py, which judges a vLLM release the day it
lands, on the releases the tests read: 0.34 (P-EAGLE refused in vLLM's
words, Model Runner V1 gone, the swap off for that reason, 100% of a CUDA
GPU by default) and 0.32 (everything served, the swap on, 92%)."""

import json
import subprocess
import sys

from tests.fakes import vllm_releases
from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "check_vllm_release.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, check=False, cwd=ROOT)


def test_vllm_0_34_judged_from_its_source(tmp_path):
    vllm_releases.source("0.34.0")   # fetched and cached, or this test is skipped
    p = run("--json", str(tmp_path / "r.json"), "0.34.0")
    assert p.returncode == 0, p.stdout + p.stderr   # the server route holds
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["version"] == "0.34.0" and r["read_by_the_tests"]
    assert "parallel_drafting is only supported by the dflash and dspark" in r["algorithms"]["peagle"]
    assert r["algorithms"]["eagle3"] is None and r["algorithms"]["dflash"] is None
    engine = [b["line"] for b in r["contract_breaks"] if b["route"] == "engine"]
    assert len(engine) == 1 and "removed Model Runner V1" in engine[0]
    assert not [b for b in r["contract_breaks"] if b["route"] == "server"]
    assert r["draft_swap"].startswith("vLLM 0.34.0 removed Model Runner V1")
    assert r["memory_fraction"]["cuda"][0] == 1.0 and r["memory_fraction"]["other"][0] == 0.92
    assert all(e["supported"] for e in r["eagle3"].values())
    assert "[ no    ] peagle: vLLM 0.34.0 refuses parallel_drafting" in p.stdout
    assert "[ BLOCK ] engine: vLLM 0.34.0 removed Model Runner V1" in p.stdout


def test_vllm_0_32_serves_every_algorithm_and_swaps():
    vllm_releases.source("0.32.0")
    p = run("0.32.0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[ no    ]" not in p.stdout.split("EAGLE-3 targets:")[0].split("algorithms")[1]
    assert "evaluate's draft swap: available" in p.stdout
    assert "92% on CUDA (vLLM 0.32.0's default)" in p.stdout
    assert "[ BLOCK ]" not in p.stdout


def test_usage_and_an_unknown_release(tmp_path):
    assert run("--bogus").returncode == 2
    vllm_releases.source("0.32.0")
    bad = run("--json", str(tmp_path / "no" / "such" / "r.json"), "0.32.0")
    assert bad.returncode == 2 and "--json" in bad.stderr and "Traceback" not in bad.stderr
    p = run("0.0.0.999")
    assert p.returncode == 3 and "0.0.0.999" in p.stderr, p.stdout + p.stderr
