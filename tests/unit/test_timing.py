"""The suite's own time table (tests/timing.py): each test counted once, in
its folder's tier, the heaviest files and the slowest tests first."""

from types import SimpleNamespace

import pytest

from tests.timing import Timing, tier_of


def test_tiers_by_folder_the_heaviest_files_and_the_slowest_first():
    assert tier_of("tests/bench/test_bench.py::test_x[a.py]") == "bench"
    assert tier_of("tests/cluster/test_slurm.py::test_y") == "cluster"
    assert tier_of("tests/vllm/test_vllm_real.py::test_z") == "vllm"
    assert tier_of("tests/unit/test_fmt.py::test_w") == "unit"
    with pytest.raises(ValueError, match="lives in one of tests/"):
        tier_of("tests/test_fmt.py::test_w")   # a file outside the tiers' folders
    t = Timing()
    for nodeid, when, s in [("tests/integration/test_a.py::t1", "setup", 40.0),
                            ("tests/integration/test_a.py::t1", "call", 2.0),
                            ("tests/integration/test_a.py::t1", "teardown", 0.5),
                            ("tests/unit/test_b.py::t2", "call", 1.5),
                            ("tests/unit/test_b.py::t3", "call", 0.5)]:
        t.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when=when, duration=s))
    lines = t.table()
    assert any(line.split()[:4] == ["integration", "1", "tests", "42"] for line in lines), lines
    assert any(line.split()[:4] == ["unit", "2", "tests", "2"] for line in lines), lines
    files = lines[lines.index("the 2 heaviest files:") + 1:lines.index("the 20 slowest tests:")]
    assert [line.split() for line in files] == [["42.5", "s", "tests/integration/test_a.py"],
                                                ["2.0", "s", "tests/unit/test_b.py"]]
    slow = lines[lines.index("the 20 slowest tests:") + 1:]
    assert [line.split()[-1] for line in slow] == ["tests/integration/test_a.py::t1",
                                                   "tests/unit/test_b.py::t2",
                                                   "tests/unit/test_b.py::t3"]
