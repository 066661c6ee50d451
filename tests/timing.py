"""Where the suite's time goes, printed at the end of every run (the CI log
keeps it): seconds by tier, summed over the pytest-xdist workers (worker-
seconds: what a change to the suite saves or costs, compared between runs
with the same worker count, since workers sharing 2 cores slow each other),
the 10 heaviest files and the 20 slowest tests (setup included: a module
fixture's whole pipeline lands on its first test). docs/testing.md keeps a
copy of a fresh clone's table."""

from __future__ import annotations

from collections import defaultdict

TIERS = ("unit", "integration", "vllm", "cluster", "bench")


def tier_of(nodeid: str) -> str:
    """A test's tier: its folder under tests/ (tests/vllm/test_x.py -> vllm)."""
    parts = nodeid.split("::", 1)[0].split("/")
    tier = parts[-2] if len(parts) >= 3 else ""
    if tier not in TIERS:
        raise ValueError(f"{nodeid}: a test file lives in one of tests/{{{','.join(TIERS)}}}/")
    return tier


class Timing:
    """Collects each test's setup + call + teardown seconds from the reports
    (on the xdist controller they arrive from every worker)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tier: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration
        self.tier.setdefault(report.nodeid, tier_of(report.nodeid))

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
        lines += self.files(10)
        lines.append("the 20 slowest tests:")
        slow = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:20]
        lines += [f"  {s:7.1f} s  {self.tier[n]:11} {n}" for n, s in slow]
        return lines

    def files(self, n: int) -> list[str]:
        """The n files with the most worker-seconds: where a module fixture's
        whole pipeline shows as one figure, and where sharing runs would pay."""
        by_file: dict[str, float] = defaultdict(float)
        for nodeid, s in self.seconds.items():
            by_file[nodeid.split("::", 1)[0]] += s
        top = sorted(by_file.items(), key=lambda kv: -kv[1])[:n]
        return [f"the {len(top)} heaviest files:"] + [f"  {s:7.1f} s  {f}" for f, s in top]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.seconds:
            terminalreporter.section("time by tier")
            for line in self.table():
                terminalreporter.write_line(line)
