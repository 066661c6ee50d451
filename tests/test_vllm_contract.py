"""The declared contract with vLLM (pipeline/vllm/contract.py) covers every
use the code makes: the project's source is walked with ast for vLLM
imports, the engine route's `api.X`, the vLLM module paths given to a
VllmSource question, and the vLLM environment variables it sets; one the
table lacks fails here (and the walker is shown to catch one). Also: the
test cache keeps every declared module, and a declared use a release breaks
is a precise doctor line that blocks only the route using it."""

import ast
from pathlib import Path

import pytest

from pipeline.vllm import compat, contract

ROOT = Path(__file__).resolve().parent.parent
CODE = sorted(p for d in ("pipeline", "app", "scripts") for p in (ROOT / d).rglob("*.py"))
SOURCE_QUESTIONS = {"text", "tree", "has_module", "function_params", "signature",
                    "returned_list", "dataclass_fields", "field_default", "class_members",
                    "has_function", "class_bases", "implements", "string_constants",
                    "definitions", "imported_names", "is_package"}


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
    from tests.test_doctor import ENV_0_17, cfg_for, model_dir
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
