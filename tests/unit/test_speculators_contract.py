"""The declared contract with speculators (pipeline/train/speculators_contract.py)
covers every use the code makes: the project's source is walked with ast for
speculators imports, names taken from the modules the patch code holds
(`tr_mod.X`, ...), and the members our stand-in classes use of speculators'
(`self.X` in PanelHooks is the Trainer's); one the table lacks fails here,
and the walker is shown to catch one. The table against speculators 0.9.0
(installed) and 0.8.1 and 0.9.0 read from their wheels; a release that lacks a
name is a precise line, a blocking doctor finding and a StageError at train's
start, before any training."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline.paths import cache_dir
from pipeline.train import speculators_contract as sc
from pipeline.vllm.source import VllmSource
from tests.helpers import ROOT

CODE = sorted(p for d in ("pipeline", "app") for p in (ROOT / d).rglob("*.py"))
WHEELS = ("0.8.1", "0.9.0")


def installed_source():
    where, version = sc.installed()
    if where is None:
        pytest.skip("speculators is not installed here (scripts/install.sh installs it)")
    return sc.source(where, version)


def uses(tree: ast.AST, src) -> set[tuple[str, str]]:
    """(module under speculators., name) for each speculators use in a tree."""
    alias = {k: m for k, m in sc.MODULES.items()}    # the patch code's module names
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "speculators":
            mod = node.module.removeprefix("speculators").lstrip(".")
            for a in node.names:
                if src.has_module(f"{mod}.{a.name}".lstrip(".")):
                    alias[a.asname or a.name] = f"{mod}.{a.name}".lstrip(".")
                    out.add((f"{mod}.{a.name}".lstrip("."), ""))
                else:
                    out.add((mod, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in sc.STAND_INS:
            out |= stand_in_uses(node)
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        if isinstance(inner, ast.Name) and inner.id in alias:            # tr_mod.X
            out.add((alias[inner.id], node.attr))
        elif isinstance(inner, ast.Attribute) and inner.attr in sc.MODULES:   # m.tr_mod.X
            out.add((sc.MODULES[inner.attr], node.attr))
        elif isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and \
                inner.value.id in alias:                                   # tr_mod.X.Y
            out.add((alias[inner.value.id], f"{inner.attr}.{node.attr}"))
    return out


def stand_in_uses(cls: ast.ClassDef) -> set[tuple[str, str]]:
    """What a stand-in class uses of the speculators class it stands in for:
    `self.X` it does not define itself, and `self.config.Y` (TrainerConfig's)."""
    module, base = sc.STAND_INS[cls.name]
    own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.Assign,
                                                     ast.AnnAssign)) and hasattr(n, "name")}
    own |= {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)}
    own |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and
            isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    out = set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                n.value.id == "self" and n.attr not in own:
            out.add((module, f"{base}.{n.attr}"))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and \
                isinstance(n.value.value, ast.Name) and n.value.value.id == "self" and \
                n.value.attr == "config" and not n.attr.startswith("_"):
            out.add((module, f"TrainerConfig.{n.attr}"))
    # the methods it overrides (speculators calls them): declared as overridden
    out |= {(module, f"{base}.{f.name}") for f in cls.body
            if isinstance(f, ast.FunctionDef) and not f.name.startswith("_hook")
            and (f.name == "__init__" or not f.name.startswith("__"))}
    return out


def undeclared(tree: ast.AST, src) -> list[str]:
    declared = {(u.module, u.name) for u in sc.USES}
    modules = {u.module for u in sc.USES} | set(sc.MODULES.values())
    return sorted(f"speculators.{m}" + (f".{n}" if n else "") for m, n in uses(tree, src)
                  if (m, n) not in declared and not (n == "" and m in modules))


def test_every_speculators_use_in_the_code_is_declared():
    src = installed_source()
    found = {str(p.relative_to(ROOT)): bad for p in CODE
             if (bad := undeclared(ast.parse(p.read_text()), src))}
    assert found == {}, f"declare these in pipeline/train/speculators_contract.py: {found}"


def test_the_walker_catches_an_undeclared_use():
    src = installed_source()
    snippet = ast.parse("from speculators.train.trainer import _all_reduce_metrics\n"
                        "from speculators.train import recovery\n"
                        "tr_mod.Trainer.setup_optimizer = None\n"
                        "class PanelHooks:\n"
                        "    def f(self):\n        return self.optimizer, self.config.lr\n")
    assert undeclared(snippet, src) == [
        "speculators.train.recovery", "speculators.train.trainer.Trainer.f",
        "speculators.train.trainer.Trainer.optimizer",
        "speculators.train.trainer.Trainer.setup_optimizer",
        "speculators.train.trainer.TrainerConfig.lr",
        "speculators.train.trainer._all_reduce_metrics"]
    # and the declared ones pass, however the module is held
    ok = ast.parse("from speculators.train import trainer as tr_mod\nx = tr_mod._StepTimer\n"
                   "m.cli_mod.Trainer = None\nclass PanelHooks:\n    def run_training(self):\n"
                   "        return self.global_step, self.config.max_steps\n")
    assert undeclared(ok, src) == []


def test_the_installed_speculators_has_every_declared_name():
    assert sc.missing(installed_source()) == []


def wheel_source(version: str):
    """speculators `version` read from its wheel (downloaded once into the cache)."""
    folder = cache_dir() / "speculators-wheels"
    found = sorted(folder.glob(f"speculators-{version}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"speculators=={version}",
                            "--no-deps", "-d", str(folder), "-q"], capture_output=True, text=True,
                           timeout=300, check=False)
        found = sorted(folder.glob(f"speculators-{version}-*.whl"))
        if not found:
            pytest.skip(f"speculators {version}'s wheel cannot be downloaded here: "
                        f"{r.stderr.strip()[-300:]}")
    wheel = zipfile.ZipFile(found[0])

    def read(rel: str):
        try:
            return wheel.read(f"speculators/{rel}").decode("utf-8", errors="replace")
        except KeyError:
            return None
    return VllmSource(version, read)


@pytest.mark.parametrize("version", WHEELS)
def test_each_release_has_every_declared_name(version):
    """0.8.1 and 0.9.0 from their wheels: what the train stage patches is in
    both; 0.8.1's Trainer.train_epoch takes no step_callback, which the code
    adapts to (tests/integration/test_speculators_releases.py trains with it)."""
    src = wheel_source(version)
    assert sc.missing(src) == []
    assert sc.adaptations(src) == ([] if version == "0.9.0" else [
        "Trainer.train_epoch takes no step_callback: the stop is checked as each next batch "
        "is drawn (trainer.CheckedLoader)"])


def test_a_parameter_gone_blocks_unless_the_code_adapts(monkeypatch):
    """A declared keyword parameter a release lacks is a missing name unless
    the use says what the code does instead; one taken through **kwargs counts."""
    src = wheel_source("0.8.1")
    use = sc.Use(sc.TR, "Trainer.train_epoch", "overridden", "the stop", params=("step_callback",))
    monkeypatch.setattr(sc, "USES", (use,))
    assert sc.missing(src) == ["speculators.train.trainer.Trainer.train_epoch takes no "
                               "step_callback (the stop)"]
    assert sc.adaptations(src) == []
    kw = sc.Use(sc.TR, "Trainer.__init__", "called", "", params=("no_such",))
    assert sc.lacked_params(src, kw) == ([] if src.signature(sc.TR, "Trainer.__init__")["var_kw"]
                                         else ["no_such"])


def test_the_stop_is_checked_after_each_step_without_a_step_callback():
    """CheckedLoader (speculators 0.8): the check after every batch's step,
    the last included, and the loader's own length and attributes."""
    from pipeline.train.trainer import CheckedLoader, takes_step_callback

    class Loader(list):
        batch_sampler = "the sampler"
    seen = []
    loader = CheckedLoader(Loader(["a", "b", "c"]), lambda: seen.append("check"))
    for batch in loader:
        seen.append(batch)
    assert seen == ["a", "check", "b", "check", "c", "check"]
    assert len(loader) == 3 and loader.batch_sampler == "the sampler"
    assert list(CheckedLoader(Loader(), lambda: seen.append("never"))) == [] and \
        "never" not in seen
    assert takes_step_callback(lambda epoch, *, step_callback=None: None)
    assert not takes_step_callback(lambda epoch: None)


def renamed(tmp_path: Path) -> Path:
    """A copy of the installed speculators whose trainer calls its step timer
    something else (what a release may do)."""
    where, _ = sc.installed()
    copy = tmp_path / "speculators"
    for f in Path(where).rglob("*.py"):
        dest = copy / f.relative_to(where)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f.read_text())
    trainer = copy / "train" / "trainer.py"
    trainer.write_text(trainer.read_text().replace("class _StepTimer", "class StepTimer"))
    return copy


def test_a_name_gone_blocks_doctor_and_train_before_training(tmp_path, monkeypatch):
    installed_source()
    copy = renamed(tmp_path)
    gone = sc.missing(sc.source(copy, "0.10.0"))
    assert gone == ["speculators.train.trainer._StepTimer is gone (subclassed: cpu_patches: no "
                    "CUDA events on the CPU)"]
    # a name only the CPU patches use does not stop training on GPUs
    assert sc.refusal(str(copy), "0.10.0", cpu=False) is None
    # doctor, from the stages' envprobe report
    from pipeline import doctor
    from pipeline.config import load as load_config
    from tests.configs import write
    write(tmp_path / "config.toml", {"stages": {"extract": {"layer_ids": [1, 2, 3]}}})
    cfg = load_config(tmp_path / "config.toml")
    # (no [gpus] devices: train runs on the CPU, where the CPU patches' names count)
    env = {"python": "3.11", "executable": sys.executable, "speculators_dir": str(copy),
           "packages": {"torch": "2.13.0", "transformers": "5.19.0", "speculators": "0.10.0"}}
    (f,) = doctor.check_speculators(doctor.Inputs(cfg, env, None, None))
    assert f.level == doctor.BLOCK and "speculators 0.10.0 lacks" in f.message and \
        "_StepTimer is gone" in f.message, f
    # the train stage: a StageError naming it, before any patch or training
    from pipeline.stage_error import StageError
    from pipeline.train import trainer
    monkeypatch.setattr(sc, "installed", lambda: (str(copy), "0.10.0"))
    with pytest.raises(StageError, match="_StepTimer is gone") as e:
        trainer.install(cpu=True, hooks=None)
    assert "0.9.0" in e.value.hint
