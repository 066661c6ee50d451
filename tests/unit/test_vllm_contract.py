"""The declared contract with vLLM (pipeline/vllm/contract.py) covers every
use the code makes: the project's source is walked with ast for vLLM
imports, the engine route's `api.X`, the vLLM module paths given to a
VllmSource question, and the vLLM environment variables it sets; one the
table lacks fails here (and the walker is shown to catch one). Also: the
test cache keeps every declared module, and a declared use a release breaks
is a precise doctor line that blocks only the route using it.

The strings (pipeline/vllm/contract_strings.py: `vllm serve` flags, HTTP
routes, metric names, log patterns) the same way: a vLLM string spelled out
in the code instead of taken from the table fails, as does one the table
lacks (the rule: `undeclared_strings`), and the declared flags and metrics
are compared with each read release's source."""

import ast
import re
from pathlib import Path

import pytest

from pipeline.vllm import compat, contract
from pipeline.vllm import contract_strings as vs
from pipeline.vllm import metrics as vllm_metrics

ROOT = Path(__file__).resolve().parents[2]
CODE = sorted(p for d in ("pipeline", "app", "scripts") for p in (ROOT / d).rglob("*.py"))
SOURCE_QUESTIONS = {"text", "tree", "has_module", "function_params", "signature",
                    "returned_list", "dataclass_fields", "field_default", "class_members",
                    "has_function", "class_bases", "implements", "string_constants",
                    "definitions", "imported_names", "is_package", "function"}


def declared_modules() -> set[str]:
    return {m for u in contract.USES for m in u.modules} | set(contract.READ_MODULES)


def declared_names() -> set[str]:
    return {u.name.split(".")[0] for u in contract.USES}


def constant(node, namespace: dict):
    """A string the code passes: a literal, or a module-level constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return getattr(namespace.get(node.value.id), node.attr, None)
    if isinstance(node, ast.Name):
        return namespace.get(node.id) if isinstance(namespace.get(node.id), str) else None
    return None


# The modules that hold the engine route's `api` namespace (elsewhere `api`
# is another library's, e.g. huggingface_hub's in pipeline/model/hub.py).
API_MODULES = ("pipeline/extract/vllm_engine.py", "pipeline/vllm/compat.py", "<snippet>")


def undeclared(tree: ast.AST, namespace: dict, where: str = "<snippet>") -> list[str]:
    """The vLLM uses in one module's tree that the contract lacks."""
    modules, names, out = declared_modules(), declared_names(), []
    exports = {u.export for u in contract.USES if u.export}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            mod = node.module.removeprefix("vllm").lstrip(".")
            for a in node.names:
                full = f"{mod}.{a.name}".lstrip(".")
                if not ((mod in modules and a.name in names) or full in modules):
                    out.append(f"from vllm.{mod} import {a.name}")
        elif isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "vllm"
                    and a.name.removeprefix("vllm.") not in modules]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "api" and node.attr not in exports and where in API_MODULES:
            out.append(f"api.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in SOURCE_QUESTIONS and node.args and \
                isinstance(node.func.value, ast.Name) and node.func.value.id in (
                    "src", "source", "vllm_source", "s"):
            m = constant(node.args[0], namespace)
            if isinstance(m, str) and m not in modules:
                out.append(f"{node.func.value.id}.{node.func.attr}({m!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("VLLM_") and node.value.isupper() and \
                node.value not in contract.ENV_VARS:
            out.append(f"environment variable {node.value}")
    return out



def module_namespace(tree: ast.Module) -> dict:
    """What a module's names stand for, without importing it: compat and
    contract, the names it imports from them, its own string constants."""
    out = {"compat": compat, "contract": contract, "vllm_compat": compat}
    for st in tree.body:
        if isinstance(st, ast.ImportFrom) and st.module in ("pipeline.vllm.compat",
                                                            "pipeline.vllm.contract"):
            mod = compat if st.module.endswith("compat") else contract
            out.update({a.asname or a.name: getattr(mod, a.name, None) for a in st.names})
        elif isinstance(st, ast.Assign) and isinstance(st.value, ast.Constant):
            out.update({t.id: st.value.value for t in st.targets if isinstance(t, ast.Name)})
    return out


def test_every_vllm_use_in_the_code_is_declared():
    found = {}
    for path in CODE:
        tree = ast.parse(path.read_text(), str(path))
        bad = undeclared(tree, module_namespace(tree), str(path.relative_to(ROOT)))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert found == {}, f"declare these in pipeline/vllm/contract.py: {found}"


def test_the_walker_catches_an_undeclared_use():
    snippet = ast.parse("from vllm.v1.core.kv_cache_utils import estimate_max_model_len\n"
                        "import vllm.v1.worker.gpu_worker_v2\n"
                        "x = api.get_kv_cache_config_from_groups\n"
                        "src.has_function('v1.spec_decode.eagle', 'propose')\n"
                        "env['VLLM_USE_FLASHINFER_SAMPLER'] = '0'\n")
    got = undeclared(snippet, {})
    assert got == ["from vllm.v1.core.kv_cache_utils import estimate_max_model_len",
                   "import vllm.v1.worker.gpu_worker_v2", "api.get_kv_cache_config_from_groups",
                   "src.has_function('v1.spec_decode.eagle')",
                   "environment variable VLLM_USE_FLASHINFER_SAMPLER"]
    # and the declared ones pass
    ok = ast.parse("from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config\n"
                   "x = api.get_kv_cache_configs\nsrc.text('envs')\n")
    assert undeclared(ok, {}) == []


def test_the_release_cache_keeps_every_declared_module():
    from tests.fakes.vllm_releases import KEEP
    rel = {m.replace(".", "/") for m in declared_modules()}
    assert [m for m in rel if not (m + ".py").startswith(KEEP) and not m.startswith(KEEP)] == []
    assert {"model_executor/models/", "models/"} <= set(KEEP)   # the registry's model code


def test_the_declared_uses_count():
    """The table the report quotes: uses per route."""
    per = {r: sum(r in u.routes for u in contract.USES) for r in ("engine", "server", "doctor")}
    assert per["engine"] >= 35 and per["server"] >= 2 and per["doctor"] >= 1
    print(f"\n{len(contract.USES)} declared uses {per} + {len(contract.READ_MODULES)} modules read")


class Shifted:
    """A release's source with one function's signature changed (what the
    next vLLM might do): every other answer is the release's own."""

    def __init__(self, src, module, qualname, params):
        self._src, self._key, self._params = src, (module, qualname), params

    def __getattr__(self, name):
        return getattr(self._src, name)

    def signature(self, module, qualname):
        if (module, qualname) == self._key:
            return {"params": [(p, True) for p in self._params], "var_kw": False}
        return self._src.signature(module, qualname)


def test_a_broken_declaration_blocks_only_its_route(tmp_path):
    """A Scheduler(...) that requires a new argument: doctor's compat line
    names it (where it is, what changed, that nothing adapts it) and blocks
    the vllm-engine backend; the vllm-server backend is not blocked by it."""
    from pipeline import doctor
    from tests.fakes import vllm_releases
    from tests.unit.test_doctor import ENV_0_17, cfg_for, model_dir
    src = Shifted(vllm_releases.source("0.33.0"), "v1.core.sched.scheduler", "Scheduler.__init__",
                  ["vllm_config", "kv_cache_config", "structured_output_manager", "block_size",
                   "kv_connector", "log_stats"])
    target = model_dir(tmp_path, "llama-3.1-8b")
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm="0.33.0"))
    gpus = [{"index": 0, "name": "NVIDIA H200", "memory_total": 143_771 << 20}]
    lines = {}
    for backend in ("vllm-engine", "vllm-server"):
        d = tmp_path / backend
        d.mkdir()
        cfg = cfg_for(d, target, f'[gpus]\ndevices = [0]\n[stages.extract]\nbackend = "{backend}"')
        found = doctor.diagnose(cfg, env=env, gpus=gpus, vllm_env=doctor.vllm_env_from(env),
                                vllm_source=src)
        lines[backend] = [f for f in found if f.key == "contract:Scheduler.__init__"]
    (block,) = lines["vllm-engine"]
    assert block.level == doctor.BLOCK
    assert block.message.startswith("Scheduler.__init__ in vLLM 0.33.0: now requires kv_connector")
    assert "vllm.v1.core.sched.scheduler" in block.message and "no adaptation covers it" in block.message
    assert lines["vllm-server"] == []


@pytest.mark.parametrize("name", ["get_kv_cache_configs", "Scheduler.__init__"])
def test_declarations_drive_the_call(name):
    """The engine route's adapters take their parameters from the same
    declaration doctor checks."""
    use = contract.by_name(name)
    assert use.adapted and "engine" in use.routes
    from tests.fakes import vllm_releases
    keys = {a.key for a in compat.plan(vllm_releases.source("0.33.0"))}
    assert {k for _, k in use.adapted if k != "kv_cache_layout_interleave"} <= keys


# -- the strings: flags, routes, metrics, log patterns (contract_strings.py) ----

STRING_CODE = CODE + sorted((ROOT / "bench").rglob("*.py"))
# What a literal must look like to be one of vLLM's (a flag: before any `=value`).
FLAG_SHAPE = re.compile(r"--[a-z][a-z0-9-]*")
ROUTE_SHAPE = re.compile(r"/(v1(/[\w./-]*)?|health|metrics|ping|version|tokenize|detokenize|"
                         r"load|invocations|pooling|classify|score|rerank|sleep|wake_up|"
                         r"collective_rpc|reset_prefix_cache)")
METRIC_SHAPE = re.compile(r"vllm:\w+")
RE_CALLS = {"compile", "search", "match", "fullmatch", "findall", "finditer", "sub", "split"}
# The modules that read a vLLM server's log: a regex from a literal there is a log
# pattern (pipeline/run/exit_reasons.py quotes any process's errors: not one of them).
LOG_READERS = ("pipeline/vllm/", "pipeline/extract/vllm_", "<snippet>")
OTHER_FORMATS = {   # regexes there that read no vLLM output
    r"vllm-(.+)\.tar\.gz$": "source.py: a source release's file name",
    vllm_metrics._SAMPLE.pattern: "metrics.py: Prometheus' text format, not vLLM's",
    vllm_metrics._LABEL.pattern: "metrics.py: Prometheus' text format, not vLLM's",
}
# The modules that build a `vllm serve` command line: every `--x` literal there is
# a vLLM flag (the frontend's, --host and such, are in no module the cache keeps).
ARGV_BUILDERS = ("pipeline/vllm/server.py", "pipeline/vllm/target_flags.py",
                 "pipeline/extract/vllm_server.py", "<snippet>")
# Other programs' flags that vLLM's parser spells the same.
OTHER_PROGRAMS = {
    "pipeline/stages/train.py": {"--seed", "--nnodes"},              # speculators, torchrun
    "pipeline/train/flags.py": {"--trust-remote-code", "--block-size"},  # speculators (DFlash's block)
    "bench/vs_speculators.py": {"--model", "--seed", "--trust-remote-code"},     # speculators' CLI
}


def parser_flags() -> set[str]:
    """The flags vLLM's engine argument parser declares in any read release
    (and each boolean's --no- form); a release the cache cannot give is left out."""
    from tests.fakes import vllm_releases
    out = set()
    for version in compat.READ_RELEASES:
        try:
            src = vllm_releases.source(version)
        except pytest.skip.Exception:
            continue
        out |= {f for f in src.string_constants(vs.ARGS, "--") if FLAG_SHAPE.fullmatch(f)}
    return out | {"--no-" + f[2:] for f in out}


def _argparse_literals(tree: ast.AST) -> set[int]:
    """The literals given to add_argument: a program's own command line."""
    return {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"
            for a in call.args for n in ast.walk(a)}


def _vllm_string(text: str, parser: set[str], argv: bool) -> str | None:
    """The kind of vLLM string a literal is (None: not one); `argv`: in a
    module that builds the serve command."""
    flag = text.split("=", 1)[0] if text.startswith("--") else text
    if flag in vs.FLAGS or (FLAG_SHAPE.fullmatch(flag) and (argv or flag in parser)):
        return "flag"
    if ROUTE_SHAPE.fullmatch(text):
        return "endpoint"
    if METRIC_SHAPE.fullmatch(text):
        return "metric"
    return "log pattern" if text in vs.LOG_PATTERNS else None


def undeclared_strings(tree: ast.AST, parser: set[str], where: str = "<snippet>") -> list[str]:
    """The rule. A string literal (an f-string's text parts too; not the
    arguments of add_argument) is a vLLM string when it is spelled as one:
    a flag (`--x` or `--x=...`) the table declares or vLLM's argument parser
    declares in a read release (any `--x` in a module of ARGV_BUILDERS),
    unless `where` passes it to another program that spells it the same
    (OTHER_PROGRAMS); a route of vLLM's API server
    (/v1, under /v1/, or one of its unversioned routes); a `vllm:` metric
    name; a declared log pattern. Also, in a module that reads a server's
    log (LOG_READERS), the pattern of every `re.X(...)` given as a literal.
    A vLLM string the table declares is spelled out (the code must take the
    table's constant); one it lacks is undeclared. contract_strings.py, the
    table, is not walked."""
    out, skip, argv = [], _argparse_literals(tree), where in ARGV_BUILDERS
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            kind = _vllm_string(node.value, parser, argv)
            flag = node.value.split("=", 1)[0]
            if kind and flag not in OTHER_PROGRAMS.get(where, ()):
                declared = flag in vs.TABLES[kind] or node.value in vs.TABLES[kind]
                out.append((node.lineno, node.col_offset, f"{kind} {node.value!r} " + (
                    "spelled out: take contract_strings' constant" if declared
                    else "undeclared: add it to contract_strings")))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and \
                node.func.attr in RE_CALLS and node.args and where.startswith(LOG_READERS) and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            pattern = node.args[0].value
            if pattern not in vs.LOG_PATTERNS and pattern not in OTHER_FORMATS:
                out.append((node.lineno, node.col_offset,
                            f"log pattern {pattern!r} undeclared: add it to contract_strings"))
    return [m for *_, m in sorted(out)]


def test_every_vllm_string_in_the_code_comes_from_the_table():
    parser, found = parser_flags(), {}
    for path in STRING_CODE:
        where = str(path.relative_to(ROOT))
        if where == "pipeline/vllm/contract_strings.py":
            continue
        bad = undeclared_strings(ast.parse(path.read_text(), where), parser, where)
        if bad:
            found[where] = bad
    assert found == {}, f"pipeline/vllm/contract_strings.py: {found}"


def test_the_string_walker_catches_one():
    snippet = ast.parse(
        'argv = ["--tensor-parallel-size", "2", "--max-num-seqs", "8", f"--dtype={dtype}"]\n'
        'url = base + "/v1/embeddings"\n'
        'n = vals["vllm:num_preemptions_total"] + vals["vllm:num_requests_running"]\n'
        'ok = requests.get(url + "/health")\n'
        'TOOK = re.compile(r"Loading weights took ([0-9.]+)")\n'
        'ap.add_argument("--max-model-len", help="the speculative-config is ours")\n')
    got = undeclared_strings(snippet, {"--max-num-seqs", "--max-model-len", "--dtype"},
                             "pipeline/vllm/new.py")
    assert got == [
        "flag '--tensor-parallel-size' spelled out: take contract_strings' constant",
        "flag '--max-num-seqs' undeclared: add it to contract_strings",
        "flag '--dtype=' spelled out: take contract_strings' constant",
        "endpoint '/v1/embeddings' undeclared: add it to contract_strings",
        "metric 'vllm:num_preemptions_total' undeclared: add it to contract_strings",
        "metric 'vllm:num_requests_running' spelled out: take contract_strings' constant",
        "endpoint '/health' spelled out: take contract_strings' constant",
        "log pattern 'Loading weights took ([0-9.]+)' undeclared: add it to contract_strings"]
    # the table's constants pass, and so does another program's flag where it is declared so
    ok = ast.parse("argv = [vs.FLAG_TENSOR_PARALLEL, '2', vs.FLAG_DTYPE + '=float32']\n"
                   "TOOK = re.compile(vs.LOG_TOOK)\nurl = base + vs.ROUTE_HEALTH\n")
    assert undeclared_strings(ok, {"--dtype"}) == []
    train = ast.parse("argv = ['--seed', '0', '--nnodes', '2']\n")
    assert undeclared_strings(train, {"--seed"}, "pipeline/stages/train.py") == []
    flags = ast.parse("argv = ['--trust-remote-code', '--block-size', '8']\n")
    assert undeclared_strings(flags, {"--block-size"}, "pipeline/train/flags.py") == []
    # where the serve command is built, a flag the parser modules in the cache lack too
    frontend = ast.parse("argv += ['--enable-auto-tool-choice']\n")
    assert undeclared_strings(frontend, set(), "pipeline/vllm/server.py") == [
        "flag '--enable-auto-tool-choice' undeclared: add it to contract_strings"]
    assert undeclared_strings(frontend, set(), "pipeline/stages/train.py") == []


def test_the_declared_strings_count():
    """The table the report quotes: strings per kind, and how many are checked
    against the releases' source."""
    per = {k: len(t) for k, t in vs.TABLES.items()}
    checked = {k: sum(bool(d.declared_in) for d in t.values()) for k, t in vs.TABLES.items()}
    assert per["flag"] >= 20 and per["endpoint"] >= 6 and per["metric"] >= 12
    assert per["log pattern"] >= 10 and checked["flag"] >= 15 and checked["metric"] == per["metric"]
    assert all(d.why for t in vs.TABLES.values() for d in t.values())
    print(f"\ndeclared strings {per}, checked against the source {checked}")


@pytest.mark.parametrize("version", compat.READ_RELEASES)
def test_declared_flags_and_metrics_are_in_each_release(version):
    """Each checked flag in the release's engine.arg_utils and each metric in
    its metrics modules exactly where the table says (since..until)."""
    from tests.fakes import vllm_releases
    assert vs.missing(vllm_releases.source(version)) == []


class Without:
    """A release's source with one string gone from one module (what the
    next vLLM might do)."""

    def __init__(self, src, module, needle):
        self._src, self._module, self._needle = src, module, needle

    def __getattr__(self, name):
        return getattr(self._src, name)

    def text(self, module):
        t = self._src.text(module)
        return t.replace(self._needle, '"gone"') if module == self._module and t else t


def test_a_flag_gone_from_a_release_is_a_precise_line():
    from tests.fakes import vllm_releases
    src = Without(vllm_releases.source("0.33.0"), vs.ARGS, '"--kv-transfer-config"')
    (line,) = vs.missing(src)
    assert line.startswith("flag --kv-transfer-config in vLLM 0.33.0: not in vllm.engine.arg_utils")
    assert "hidden-state connector" in line
    # doctor says it as a warning (most flags are passed only for some targets)
    from types import SimpleNamespace

    from pipeline import doctor
    (f,) = doctor.string_mismatches(SimpleNamespace(source=src))
    assert f.level == doctor.WARN and f.message == line and f.key == "contract_string"
    old = vllm_releases.source("0.16.0")   # before --language-model-only: expected absent
    assert not vs.expected_in(vs.FLAGS[vs.FLAG_LANGUAGE_MODEL_ONLY], old.version)
    # a build's version is read by its leading digits; one that cannot be read is not judged
    lmo = vs.FLAGS[vs.FLAG_LANGUAGE_MODEL_ONLY]
    assert vs.expected_in(lmo, "0.17.1rc2.dev12+g1a2b") is True
    assert vs.expected_in(lmo, "0.16.9rc1") is False and vs.expected_in(lmo, "?") is None
