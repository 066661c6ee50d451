"""Every reference to the project's own modules resolves, wherever it is: the
`from pipeline... import x` / `import pipeline...` statements of every file in
the tree (inside functions too, in bench/ and tests/), and the module names
passed around as strings (`python -m pipeline.stages.train`, a connector's
module path, a config's `entry`). A moved module leaves no caller behind that
only fails when that code path runs (a benchmark, a stage on a GPU server).

Statements: the module is imported and each imported name exists in it (an
attribute or a submodule). Strings: found with importlib.util.find_spec,
which does not run the module (the vLLM connector loads only inside vLLM);
"module.Name" strings (a class path) import the module and look the name up.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGES = ("pipeline", "app", "widgets", "tests")
SKIP_DIRS = {".git", ".cache", "runs", "__pycache__", ".ruff_cache", ".pytest_cache",
             "node_modules", "eagle_panel.egg-info"}


def _dotted(packages) -> str:
    return r"(?:%s)(?:\.[A-Za-z_]\w*)+" % "|".join(packages)


DOTTED = _dotted(PACKAGES)
# `-m` and a dotted name on a command line (code, shell scripts, docs), or the two as
# items of an argv list: a module, always.
DASH_M = re.compile(r"""-m(?:["']\s*,\s*["']|\s+)(%s)""" % DOTTED)
# Any quoted dotted name under the project's packages: a module, module.Name, or
# module:name (an entry point). Not "app.x" alone: Textual names the App's actions
# so ("app.run" in a key binding); `-m app.cli` and "app.cli:main" are still seen.
QUOTED = re.compile(r"""["'](%s|%s:\w+)["']""" % (_dotted(p for p in PACKAGES if p != "app"),
                                                    DOTTED))


def _find(name: str):
    """find_spec, None also when a parent is a module, not a package."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _config_keys() -> set[str]:
    """`[pipeline] mode` is written "pipeline.mode" in messages: a config key
    that looks like a module name."""
    from pipeline.config import PipelineSection
    return {f"pipeline.{f.name}" for f in dataclasses.fields(PipelineSection)}


def tree_files(suffixes: tuple[str, ...]) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith((".venv", "bench_hs_")))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes)]
    return out


def _package_of(path: Path) -> list[str]:
    """The package a file's relative imports start from (pkg/__init__.py: pkg)."""
    return list(path.relative_to(ROOT).with_suffix("").parts[:-1])


def import_statements() -> dict[str, dict[str, list[str]]]:
    """module -> {imported name ("" for a plain `import`) -> [where, ...]}."""
    found: dict[str, dict[str, list[str]]] = {}
    for path in tree_files((".py",)):
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:   # relative: from this file's package, level - 1 up
                    base = _package_of(path)
                    base = base[:len(base) - (node.level - 1)]
                    module = ".".join(base + ([module] if module else []))
                if module.split(".")[0] not in PACKAGES:
                    continue
                names = found.setdefault(module, {})
                for alias in node.names:
                    if alias.name != "*":
                        names.setdefault(alias.name, []).append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        found.setdefault(alias.name, {}).setdefault("", []).append(
                            f"{rel}:{node.lineno}")
    return found


def _placeholder(name: str) -> bool:
    """`pipeline.stages.NAME` in a docstring stands for any stage."""
    return any(part.isupper() for part in name.replace(":", ".").split("."))


def string_references() -> dict[str, list[str]]:
    """dotted name -> [where, ...]: every `-m` module in the code, scripts and
    docs, and every quoted project name in the code."""
    keys = _config_keys()
    found: dict[str, list[str]] = {}
    files = tree_files((".py", ".sh", ".toml", ".md")) + [ROOT / ".ci" / "run"]
    for path in files:
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        patterns = [DASH_M, QUOTED] if path.suffix in (".py", ".toml") else [DASH_M]
        for pattern in patterns:
            for m in pattern.finditer(text):
                name = m.group(1).rstrip(".")
                if name in keys or _placeholder(name):
                    continue
                line = text.count("\n", 0, m.start()) + 1
                where = found.setdefault(name, [])
                if f"{path.relative_to(ROOT)}:{line}" not in where:
                    where.append(f"{path.relative_to(ROOT)}:{line}")
    return found


def test_the_scan_sees_the_tree():
    """A scan that found nothing would pass whatever the tree holds."""
    stmts, strings = import_statements(), string_references()
    assert "pipeline.extract.hf" in stmts and "pipeline.run.rundir" in stmts
    assert "pipeline.stages.train" in strings and "pipeline.run.supervise" in strings
    assert "app.cli:main" in strings   # pyproject's entry point
    assert not any(name in strings for name in _config_keys())


def test_every_import_statement_resolves():
    problems = []
    for module, names in sorted(import_statements().items()):
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding
            where = sorted({w for ws in names.values() for w in ws})
            problems.append(f"{module}: cannot import ({type(e).__name__}: {e}); "
                            f"imported at {', '.join(where)}")
            continue
        for name, where in sorted(names.items()):
            if not name or hasattr(mod, name):
                continue
            if _find(f"{module}.{name}") is None:
                problems.append(f"from {module} import {name}: no such name or submodule; "
                                f"at {', '.join(where)}")
    assert not problems, "\n".join(problems)


def _resolves(name: str) -> str | None:
    """None if `name` is a module, module.Name or module:name; else why not."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return None if hasattr(importlib.import_module(module), attr) else \
                f"{module} has no {attr}"
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding
            return f"{module}: {type(e).__name__}: {e}"
    if _find(name) is not None:
        return None
    module, _, attr = name.rpartition(".")   # maybe module.Name
    try:
        if module and _find(module) is not None:
            mod = importlib.import_module(module)
            return None if hasattr(mod, attr) else f"{module} has no {attr}"
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        return f"{module}: {type(e).__name__}: {e}"
    return "no such module"


def test_every_module_named_in_a_string_resolves():
    problems = []
    for name, where in sorted(string_references().items()):
        why = _resolves(name)
        if why:
            problems.append(f"{name!r}: {why}; at {', '.join(where)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, found", [
    ('subprocess.run([sys.executable, "-m", "pipeline.stages.train", "--run-dir"])',
     ["pipeline.stages.train"]),
    ("python -m pipeline.extract.nodes --rank 0", ["pipeline.extract.nodes"]),
    ('argv = ["-m", f"pipeline.stages.{name}"]', []),
    ("see pipeline.drive.driver.", []),
])
def test_dash_m_pattern(text, found):
    assert [m.group(1) for m in DASH_M.finditer(text)] == found
