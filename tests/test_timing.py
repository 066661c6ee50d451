"""The suite's own time table (tests/timing.py): each test counted once, in
its file's tier or its marker's, the slowest first."""

from types import SimpleNamespace

from tests.timing import Timing, tier_of


def test_tiers_by_file_then_marker_and_the_slowest_first():
    assert tier_of("tests/test_bench.py::test_x[a.py]", {"vllm": 1}) == "bench"
    assert tier_of("tests/test_slurm.py::test_y", {"integration": 1}) == "cluster"
    assert tier_of("tests/test_vllm_real.py::test_z", {"vllm": 1, "integration": 1}) == "vllm"
    assert tier_of("tests/test_fmt.py::test_w", {"fast": 1}) == "fast"
    t = Timing()
    for nodeid, when, s, kw in [("tests/test_a.py::t1", "setup", 40.0, {"integration": 1}),
                                ("tests/test_a.py::t1", "call", 2.0, {"integration": 1}),
                                ("tests/test_a.py::t1", "teardown", 0.5, {"integration": 1}),
                                ("tests/test_b.py::t2", "call", 1.5, {})]:
        t.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when=when, duration=s,
                                                   keywords=kw))
    lines = t.table()
    assert any(line.split()[:4] == ["integration", "1", "tests", "42"] for line in lines), lines
    assert any(line.split()[:4] == ["fast", "1", "tests", "2"] for line in lines), lines
    slow = lines[lines.index("the 20 slowest tests:") + 1:]
    assert [line.split()[-1] for line in slow] == ["tests/test_a.py::t1", "tests/test_b.py::t2"]
