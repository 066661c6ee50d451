"""The shape the code promises (README "Layout"): no import cycles between
our modules, counting imports inside functions too, and vLLM never imported
at module level outside the modules vLLM itself loads."""

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("app", "pipeline", "widgets")
# Loaded by vLLM into its own processes; they may import vLLM at the top.
INSIDE_VLLM = {"pipeline.vllm.connector"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def imports(path: Path, known: dict) -> list[tuple[str, bool]]:
    """(our module it imports, at module level?) for every import statement."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        for name in names:
            while name and name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known or name.split(".")[0] == "vllm":
                found.append((name, id(node) in top))
    return found


def test_no_import_cycles():
    known = modules()
    graph = {m: {n for n, _ in imports(p, known) if n in known and n != m}
             for m, p in known.items()}
    # A package's __init__ is imported by its submodules: not a cycle unless
    # the __init__ imports them back (it must not).
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if m.startswith(n + ".") and m not in graph[n]:
                continue
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_vllm_is_imported_only_where_vllm_runs():
    known = modules()
    top_level = sorted(m for m, p in known.items() for n, at_top in imports(p, known)
                       if n.split(".")[0] == "vllm" and at_top and m not in INSIDE_VLLM)
    assert top_level == [], f"modules importing vLLM at module level: {top_level}"
