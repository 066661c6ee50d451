"""What every doctor check returns and how doctor says it: the levels, a
`Finding`, the registry the checks join where they are defined (`check`,
`checks`, `launch_checks`), the text and JSON renderings, and the size
formatters the area modules' messages share. Imports nothing of doctor's
at run time, so that every area module can import it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.doctor.inputs import Inputs

OK, WARN, BLOCK = "ok", "warning", "blocking"
GIB = 1 << 30


@dataclass
class Finding:
    area: str
    level: str
    message: str
    fix: str = ""
    key: str = ""     # for compat findings: the adaptation's key


# -- the registry -----------------------------------------------------------------
# doctor's output reads top to bottom, from the environment to the cluster (a
# later check reads what an earlier one found: check_layers' layer ids), but
# the checks live in one module per area and register as their modules are
# imported. A check's position, not the import order, puts it in its place;
# they go in tens, so that a new check can go between two.

Check = Callable[["Inputs"], list[Finding]]
_REGISTRY: list[tuple[int, Check]] = []  # (position, check)
_LAUNCH: list[tuple[int, Check]] = []


def check(position: int | None, launch: int | None = None) -> Callable[[Check], Check]:
    """Register a doctor check at `position` in doctor's output (and at
    `launch` in the launch checks, when given); None: not in that list."""
    def register(fn: Check) -> Check:
        if position is not None:
            _REGISTRY.append((position, fn))
        if launch is not None:
            _LAUNCH.append((launch, fn))
        return fn
    return register


def checks() -> list[Check]:
    """doctor's checks, in the order of its output."""
    return [fn for _, fn in sorted(_REGISTRY, key=lambda entry: entry[0])]


def launch_checks() -> list[Check]:
    """What `run`, `resume` and the panel's `r` check before anything is
    created or started, in order: the checks that need no probe of an
    environment (but one `python -c` of an interpreter the config names), no
    vLLM source and no network — from the config and the target's
    config.json, in well under a second. (The stages still check the rest
    themselves, with the same words.)"""
    return [fn for _, fn in sorted(_LAUNCH, key=lambda entry: entry[0])]


def sizes_text(sizes: list) -> str:
    """[("multiple", 32), 16] -> "multiples of 32, 16"."""
    return ", ".join(f"multiples of {x[1]}" if isinstance(x, tuple) else str(x) for x in sizes)


def size_text(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:,.1f} GiB"
    return f"{n / (1 << 20):,.1f} MiB" if n >= 1 << 20 else f"{n / 1024:,.1f} KiB"


def blocking(findings: list[Finding]) -> bool:
    return any(x.level == BLOCK for x in findings)


def as_json(findings: list[Finding], plans=None) -> str:
    """`doctor --json`: the findings, and the plans as figures (`plans`: a
    pipeline.run.plans.Plans; None: none made)."""
    out = {"ok": not blocking(findings), "findings": [asdict(x) for x in findings]}
    if plans is not None:
        out["plans"] = plans.to_json()
    return json.dumps(out, indent=1)


def as_text(findings: list[Finding]) -> str:
    tag = {OK: "  ok   ", WARN: " WARN  ", BLOCK: " BLOCK "}
    lines = []
    for x in findings:
        lines.append(f"[{tag[x.level]}] {x.area:11} {x.message}")
        if x.fix:
            lines.append(f"{'':22}fix: {x.fix}")
    n = sum(x.level == BLOCK for x in findings)
    w = sum(x.level == WARN for x in findings)
    lines.append(f"{n} blocking, {w} warning(s)" + ("" if n else ": ready to launch"))
    return "\n".join(lines)
