"""The shape the code promises (README "Layout"): no import cycles between
our modules, counting imports inside functions too; vLLM never imported
at module level outside the modules vLLM itself loads; and the import
directions (RULES): pipeline below app and widgets, widgets below app, the
stage entry modules imported by nothing, run/ below cluster/, the read model
(pipeline.run.snapshot) importing nothing that acts, the app reading through it;
and no function longer than MAX_FUNCTION_LINES."""

import ast
from pathlib import Path

import pytest

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


# -- import directions ---------------------------------------------------------
# Who may import whom, beyond "no cycles". Each rule: (importer prefix, imported
# prefix, why). A prefix matches the module itself and everything below it.
RULES = (
    ("pipeline", "app", "pipeline/ runs without a screen: it never imports the app"),
    ("pipeline", "widgets", "pipeline/ runs without a screen: it never imports widgets"),
    ("widgets", "app", "widgets take values, never the app they are shown in"),
    ("", "pipeline.stages", "stage modules are entry points only (python -m "
     "pipeline.stages.NAME): what others need of them lives below them"),
    # The floors: run/ (the run directory, state, events, processes, supervision) knows
    # nothing of configs, vLLM, models or stages; what drives stages from a config is
    # drive/, above config; a program's log shape reaches run/ as data (exit_reasons).
    *(("pipeline.run", upper, "run/ is the floor: it imports nothing above it (configs, "
       "vLLM, models, the driver): what it needs is handed down as data") for upper in
      ("pipeline.config", "pipeline.vllm", "pipeline.model", "pipeline.doctor",
       "pipeline.drive", "pipeline.control", "pipeline.train", "pipeline.extract",
       "pipeline.data", "pipeline.builtin", "pipeline.export", "pipeline.compare",
       "pipeline.evaluate")),
    # evaluate's choice of checkpoints is pure: testable on a recorded run folder
    *(("pipeline.evaluate.choice", served, "the choice of checkpoints is pure: no vLLM, "
       "no server, no load") for served in
      ("pipeline.vllm", "pipeline.evaluate.servers", "pipeline.evaluate.load")),
    *((lower, "pipeline.cluster", "run/ and drive/ are below cluster/: they ask a "
       "scheduler only through pipeline.run.executor, which cluster/ implements")
      for lower in ("pipeline.run", "pipeline.drive")),
    *(("pipeline.run.snapshot", acting, "the read model reads: launching, stopping and "
       "removing live elsewhere") for acting in
      ("pipeline.drive.driver", "pipeline.run.supervise", "pipeline.run.proctree",
       "pipeline.run.leftovers", "pipeline.control")),
    ("app", "pipeline.run.reconcile", "the app reads a run through pipeline.run.snapshot"),
    ("widgets", "pipeline.run.reconcile", "widgets take the snapshot's values"),
)


def under(module: str, prefix: str) -> bool:
    return prefix == "" or module == prefix or module.startswith(prefix + ".")


def imported_names(source: str, module: str) -> list[tuple[int, list[str]]]:
    """(line, the dotted names it names) for every import statement in
    `source`, inside functions too: `import a.b` names a.b, `from a import b`
    names a and a.b (whether or not a.b is a module); relative imports are
    resolved from `module`'s package."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.append((node.lineno, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")[:-node.level]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((node.lineno, [base, *(f"{base}.{a.name}" for a in node.names)]))
    return sorted(out)


def broken_rules(module: str, source: str) -> list[str]:
    """`module:line imports NAME (why)`, once per import statement and rule it breaks."""
    found = []
    for line, names in imported_names(source, module):
        for who, what, why in RULES:
            bad = [n for n in names if under(n, what) and n != module]
            if under(module, who) and bad:
                found.append(f"{module}:{line} imports {bad[0]} ({why})")
    return found


def test_import_directions():
    """pipeline never imports app or widgets; widgets never import app;
    nothing imports pipeline.stages (tests/ and bench/ may: they are not
    walked; a stage module's name as a `python -m` string is no import);
    pipeline/run, the floor, imports nothing above it; run/ and drive/ never
    import pipeline/cluster."""
    broken = [line for m, p in sorted(modules().items())
              for line in broken_rules(m, p.read_text())]
    assert broken == [], "imports against the layering:\n" + "\n".join(broken)


@pytest.mark.parametrize("module, source, rule", [
    ("pipeline.fmt", "from app.cli import main", "never imports the app"),
    ("pipeline.run.events", "def f():\n    import app.panel", "never imports the app"),
    ("pipeline.control", "from widgets import stage_table", "never imports widgets"),
    ("widgets.stage_table", "from app.panel import PanelApp", "never the app"),
    ("pipeline.run.snapshot", "from pipeline.run.proctree import kill_tree", "the read model reads"),
    ("app.cli", "from pipeline.run.reconcile import observe", "through pipeline.run.snapshot"),
    ("pipeline.train.worker", "from pipeline.stages.train import run_in_process",
     "entry points only"),
    ("app.cli", "from pipeline.stages import train", "entry points only"),
    ("widgets.loss_chart", "import pipeline.stages.evaluate", "entry points only"),
    ("pipeline.stages.evaluate", "from pipeline.stages.train import acceptance_length",
     "entry points only"),
    ("pipeline.drive.driver", "from pipeline.cluster import slurm", "are below cluster/"),
    ("pipeline.run.reconcile", "def f():\n    from pipeline.cluster.slurm import job_state",
     "are below cluster/"),
    ("pipeline.drive.driver", "from ..cluster import slurm", "are below cluster/"),
    ("pipeline.run.exit_reasons", "from pipeline.vllm import contract_strings", "the floor"),
    ("pipeline.run.executor", "from pipeline.config import SCHEDULERS", "the floor"),
    ("pipeline.run.supervise", "def f():\n    from pipeline.drive import driver", "the floor"),
    ("pipeline.run.snapshot", "from pipeline.evaluate.results import gate", "the floor"),
    ("pipeline.evaluate.choice", "from pipeline.vllm.server import make_server", "is pure"),
    ("pipeline.evaluate.choice", "from pipeline.evaluate.servers import ServerPool", "is pure"),
])
def test_each_direction_rule_can_fail(module, source, rule):
    broken = broken_rules(module, source)
    assert len(broken) == 1 and rule in broken[0], broken


@pytest.mark.parametrize("module, source", [
    ("app.cli", "from pipeline.run.snapshot import read_run\nfrom widgets import gpu_table"),
    ("pipeline.drive.driver", "from pipeline.run.snapshot import read_run"),
    ("pipeline.cluster.slurm", "from pipeline.run.executor import Scheduler"),
    ("pipeline.control", "from pipeline.cluster import slurm\nfrom pipeline.drive import driver"),
    ("pipeline.drive.driver", 'argv = ["-m", "pipeline.stages.train"]'),
    ("pipeline.drive.driver", "from pipeline.config import Config\nfrom pipeline.vllm import x"),
    ("pipeline.run.rundir", "from pipeline.stage_graph import STAGE_NAMES"),
    ("widgets.loss_chart", "from pipeline import fmt"),
])
def test_the_allowed_directions_pass(module, source):
    assert broken_rules(module, source) == []


def attribute_uses(source: str, base: str) -> list[tuple[int, str]]:
    """(line, attribute) for every `self.<base>.<attribute>` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == base and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"):
            found.append((node.lineno, node.attr))
    return sorted(found)


def test_the_panel_and_its_screens_talk_in_messages():
    """app/messages.py's contract: no screen reads the app's attributes or
    calls its methods (`self.app.x`), and the app only posts messages to its
    main screen (`self.main.post_message`); the screen module never imports
    the app's."""
    from textual.app import App

    from app.panel import PanelApp
    panel = ast.parse((ROOT / "app" / "panel.py").read_text())
    ours = set(vars(PanelApp)) | {t.attr for node in ast.walk(panel) if isinstance(node, ast.Assign)
                                  for t in node.targets for t in ast.walk(t)
                                  if isinstance(t, ast.Attribute)}   # what it sets on self

    def textual_own(attr: str) -> bool:   # Textual's App API (call_from_thread, ...)
        return hasattr(App, attr) and attr not in ours

    assert not any(textual_own(a) for a in ("lock", "view", "rundir", "extract_backend"))
    screens = sorted((ROOT / "app" / "screens").glob("*.py"))
    reached = [f"{p.name}:{line} self.app.{attr}" for p in screens
               for line, attr in attribute_uses(p.read_text(), "app") if not textual_own(attr)]
    assert reached == [], "screens reaching into the app:\n" + "\n".join(reached)
    calls = [f"panel.py:{line} self.main.{attr}" for line, attr in
             attribute_uses((ROOT / "app" / "panel.py").read_text(), "main")
             if attr != "post_message"]
    assert calls == [], "the app calling the screen:\n" + "\n".join(calls)
    for p in screens:
        assert not any(under(n, "app.panel") for _, names in
                       imported_names(p.read_text(), f"app.screens.{p.stem}") for n in names), p


def test_the_message_check_can_fail():
    assert attribute_uses("def f(self):\n    self.app.lock\n", "app") == [(2, "lock")]
    assert attribute_uses("def f(self):\n    self.main.draw_run(1)\n", "main") == \
        [(2, "draw_run")]
    assert attribute_uses("def f(self):\n    app.lock\n", "app") == []


MAX_FUNCTION_LINES = 60   # issue 50: a function a newcomer reads in one screen


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function or method longer than `limit` lines,
    its decorators, docstring and nested functions included."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_is_longer_than_a_screen():
    found = [f"{path.relative_to(ROOT)}:{name} ({n} lines)" for path in modules().values()
             for name, n in long_functions(path.read_text())]
    assert not found, f"split these (at most {MAX_FUNCTION_LINES} lines each): {found}"


def test_the_function_length_check_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def long():\n{body}\n") == [("long", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"def fits():\n{body[:body.rindex(chr(10))]}\n") == []
