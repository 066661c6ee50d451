"""Where the suite's time goes, printed at the end of every run (the CI log
keeps it): seconds by tier, summed over the pytest-xdist workers (worker-
seconds: what a change to the suite saves or costs, compared between runs
with the same worker count, since workers sharing 2 cores slow each other),
and the 20 slowest tests (setup included: a module fixture's whole pipeline
lands on its first test). docs/testing.md keeps a copy of a fresh clone's
table."""

from __future__ import annotations

from collections import defaultdict

# Files that are a tier of their own, whatever their markers say: the benchmarks at
# their smallest size, and the two-node Slurm cluster with its shared queue.
FILE_TIERS = {"test_bench.py": "bench", "test_slurm.py": "cluster",
              "test_workqueue.py": "cluster"}
TIERS = ("fast", "integration", "vllm", "cluster", "bench", "gpu")


def tier_of(nodeid: str, keywords) -> str:
    """The tier a test's seconds count towards: its file's, else its marker's."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if name in FILE_TIERS:
        return FILE_TIERS[name]
    for marker in ("gpu", "vllm", "integration"):
        if marker in keywords:
            return marker
    return "fast"


class Timing:
    """Collects each test's setup + call + teardown seconds from the reports
    (on the xdist controller they arrive from every worker)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tier: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration
        if report.when == "call" or report.nodeid not in self.tier:
            self.tier[report.nodeid] = tier_of(report.nodeid, report.keywords)

    def table(self) -> list[str]:
        """The lines printed: tiers with their tests and seconds, then the slowest."""
        by_tier: dict[str, list[float]] = defaultdict(list)
        for nodeid, s in self.seconds.items():
            by_tier[self.tier[nodeid]].append(s)
        total = sum(self.seconds.values())
        lines = ["worker-seconds by tier (setup + call + teardown, summed over workers):"]
        for tier in (t for t in TIERS if t in by_tier):
            s = sum(by_tier[tier])
            lines.append(f"  {tier:12} {len(by_tier[tier]):5} tests {s:8.0f} s  "
                         f"{s / total:6.1%}" if total else f"  {tier:12} 0 s")
        lines.append(f"  {'all':12} {len(self.seconds):5} tests {total:8.0f} s")
        lines.append("the 20 slowest tests:")
        slow = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:20]
        lines += [f"  {s:7.1f} s  {self.tier[n]:11} {n}" for n, s in slow]
        return lines

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.seconds:
            terminalreporter.section("time by tier")
            for line in self.table():
                terminalreporter.write_line(line)
