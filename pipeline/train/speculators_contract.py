"""eagle-panel's contract with speculators: every speculators module, class,
function, member and private name the train stage imports, replaces,
subclasses or patches, declared once — as pipeline/vllm/contract.py does for
vLLM. We patch speculators' internals in this process (never on disk:
pipeline/train/trainer.py, cpu_patches.py, in_process.py), so a speculators
release that renames `_StepTimer` or drops `Trainer._resume_local_step`
breaks us, not it; this table is how that is found before train starts.

`MODULES` names the speculators modules the code holds as objects (the
patch functions take them as `tr_mod`, `ck_mod`, ...), and `modules()`
imports them from this table, so the patch and the check use one list.
`missing(src)` compares each declaration with a speculators source (a
package folder read with ast: the installed one for doctor, a released
wheel for the tests); tests/unit/test_speculators_contract.py walks the code
and fails on a speculators use the table lacks.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

# the speculators modules the patch code holds, by the name it holds them under
MODULES = {
    "tr_mod": "train.trainer", "ck_mod": "train.checkpointer", "cli_mod": "train.cli",
    "dist_mod": "train.distributed", "gs_mod": "train.graceful_shutdown",
    "dl_mod": "train.dataloader",
}


# our classes that stand in for speculators' (their `self.X` is speculators' X
# unless they define it themselves): what tests/unit/test_speculators_contract.py walks
TR, CK, CLI, DIST = "train.trainer", "train.checkpointer", "train.cli", "train.distributed"
GS = "train.graceful_shutdown"
STAND_INS = {"PanelHooks": (TR, "Trainer"), "RecordingShutdownHandler": (GS, "GracefulShutdownHandler")}


@dataclass(frozen=True)
class Use:
    """One speculators name eagle-panel relies on."""
    module: str      # under speculators.: "train.trainer"
    name: str        # "Trainer", "Trainer.train_epoch" (a method or self.X), "_local_rank"
    how: str         # imported | replaced | subclassed | overridden | read | called
    why: str = ""
    cpu_only: bool = False   # patched only for training on the CPU (cpu_patches)
    params: tuple[str, ...] = ()   # keyword parameters we pass it (a method or function)
    adapted: str = ""        # where a release lacks `params`: what the code does instead


def _all(module: str, how: str, *names: str, why: str = "", cpu_only: bool = False
         ) -> tuple[Use, ...]:
    return tuple(Use(module, n, how, why, cpu_only) for n in names)


USES: tuple[Use, ...] = (
    # -- the Trainer, subclassed for progress, stops and the plateau (trainer.PanelHooks)
    Use(TR, "Trainer", "subclassed", "PanelHooks: progress, stop between steps, plateau stop"),
    *_all(TR, "overridden", "Trainer.__init__", "Trainer.run_training",
          "Trainer.val_epoch", "Trainer.maybe_update_best", "Trainer.maybe_save_checkpoint",
          why="PanelHooks overrides them and calls speculators' own"),
    # (0.8.1's takes no step_callback: its name is there, its parameter is not)
    Use(TR, "Trainer.train_epoch", "overridden", "PanelHooks: a stop honoured after each step",
        params=("step_callback",), adapted="the stop is checked as each next batch is drawn "
        "(trainer.CheckedLoader)"),
    *_all(TR, "read", "Trainer.checkpointer", "Trainer.train_loader", "Trainer.config",
          "Trainer.current_epoch", "Trainer.global_step", "Trainer._resume_local_step",
          why="the step count and the epoch a resume starts in"),
    *_all(TR, "read", "TrainerConfig.num_epochs", "TrainerConfig.max_steps",
          "TrainerConfig.checkpoint_freq", "TrainerConfig.save_best",
          why="the steps planned; an interrupt's save forces checkpoint_freq and save_best"),
    Use(TR, "SingleGPUCheckpointer", "replaced", "safe_checkpointer: atomic saves"),
    Use(TR, "_StepTimer", "subclassed", "cpu_patches: no CUDA events on the CPU", cpu_only=True),
    Use(TR, "get_local_rank", "replaced", "cpu_patches: the CPU device", cpu_only=True),
    Use(TR, "torch", "replaced", "cpu_patches: autocast on the CPU", cpu_only=True),
    Use(CK, "SingleGPUCheckpointer", "subclassed", "safe_checkpointer"),
    Use(CK, "SingleGPUCheckpointer.save_checkpoint", "overridden",
        "announce_saves: the panel's 'saving checkpoint' phase"),
    Use(CK, "get_current_device", "replaced", "cpu_patches: the CPU device", cpu_only=True),
    # -- the CLI the stage runs in process (in_process.run_in_process)
    *_all(CLI, "replaced", "Trainer", "maybe_setup_distributed", "setup_metric_logger",
          why="our Trainer, our distributed setup on the CPU, our metric handler"),
    Use(CLI, "main", "called", "the training itself"),
    Use("train.config", "TrainConfig", "called", "TrainConfig.resolve(argv): the flags"),
    Use("train.config", "TrainConfig.resolve", "called", "the stage's flags to a config"),
    # -- doctor's config-only stand-in of the draft (pipeline/train/draft_shape.py)
    *_all(CLI, "called", "build_draft_model", "parse_vocab_mappings",
          why="the draft's config as the trainer builds it, before training"),
    Use("model", "SpeculatorModel", "read", "its registry: the speculator class per type"),
    Use(CK, "patch_config_dtype", "called", "the stand-in's config.json in the saved dtype"),
    Use("train.dataloader", "ArrowDataset", "replaced", "online mode's dataset (our servers)"),
    Use("train.data", "ArrowDataset", "subclassed", "online mode's keyed dataset"),
    # -- torchrun on the CPU (cpu_patches.patch_distributed)
    *_all(DIST, "replaced", "maybe_setup_distributed", "dist",
          why="the collective timeout (and gloo on the CPU)"),
    *_all(DIST, "replaced", "_local_rank", "_is_distributed", "_rank", "_world_size",
          why="gloo on the CPU: speculators' own state, set as its setup sets it", cpu_only=True),
    Use(DIST, "_init_sp_process_groups", "called", "the sequence-parallel groups, as it makes "
        "them (on the CPU)", cpu_only=True),
    # -- a stop that must stop (trainer.recording_shutdown_handler)
    Use(GS, "GracefulShutdownHandler", "subclassed", "a stop swallowed on its way is raised again"),
    *_all(GS, "read", "GracefulShutdownHandler._handler", "GracefulShutdownHandler._owner_pid",
          "GracefulShutdownHandler._interrupted", why="the handler's own state"),
    Use(GS, "TrainingInterruptedError", "called", "raised between steps once a stop was asked"),
    # -- the rest
    Use("train.distributed_batch_sampler", "MultipackDistributedBatchSamplerV2", "called",
        "budget: the steps an epoch packs into"),
    Use("train.logger", "setup_metric_logger", "called", "the trackers' handlers"),
    Use("train.vocab_mapping", "build_vocab_mappings_from_distribution", "called",
        "vocab: speculators' own mapping (loaded alone, without the model registry)"),
    Use("models.base_components", "ModelComponents", "called", "the MLA layer's registration"),
    Use("models.eagle3.model_definitions", "model_classes", "replaced",
        "the MLA layer in the Eagle-3 registry"),
    Use("models.eagle3.model_definitions", "Eagle3FirstLayerMixin", "subclassed",
        "the MLA draft's first layer"),
)


def modules() -> SimpleNamespace:
    """MODULES imported, under the names the patch code uses."""
    return SimpleNamespace(**{k: importlib.import_module(f"speculators.{m}")
                              for k, m in MODULES.items()})


def defined(src, module: str, name: str) -> bool:
    """Whether `name` is defined at the top of `module` (a def, a class, an
    assignment or an import), or `Class.member` in that class (a method, a
    field, or a `self.X` its methods assign)."""
    tree = src.tree(module)
    if tree is None:
        return False
    if "." in name:
        cls, member = name.split(".", 1)
        module = origin(src, module, cls)   # a class its package re-exports
        members = src.class_members(module, cls)
        fields = src.dataclass_fields(module, cls) or {}
        return members is not None and (member in members or member in fields)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    return False


def origin(src, module: str, name: str, depth: int = 0) -> str:
    """The module that defines `name`, following `from .x import name` (a
    package's __init__ re-exporting it) a few levels."""
    tree = src.tree(module)
    for node in tree.body if tree is not None and depth < 4 else ():
        if isinstance(node, ast.ImportFrom) and any(
                (a.asname or a.name) == name for a in node.names):
            found = src.absolute(module, node) if node.level else (
                (node.module or "").removeprefix("speculators.")
                if (node.module or "").startswith("speculators.") else None)
            return origin(src, found, name, depth + 1) if found else module
    return module


def lacked_params(src, use: Use) -> list[str]:
    """The keyword parameters of `use.params` its function in `src` does not
    take (none where it takes **kwargs or is not defined: `missing` says that)."""
    if not use.params:
        return []
    sig = src.signature(origin(src, use.module, use.name.split(".")[0]), use.name)
    if sig is None or sig["var_kw"]:
        return []
    names = {name for name, _ in sig["params"]}
    return [p for p in use.params if p not in names]


def missing(src, cpu: bool = True) -> list[str]:
    """Each declared use the speculators in `src` lacks, as a line naming it
    and what eagle-panel does with it (`cpu`: the CPU patches' too); a
    parameter the code adapts to the lack of is `adaptations`', not here."""
    out = []
    for use in USES:
        if use.cpu_only and not cpu:
            continue
        if not src.has_module(use.module):
            out.append(f"speculators.{use.module} is gone ({use.how}: {use.name})")
        elif not defined(src, use.module, use.name):
            out.append(f"speculators.{use.module}.{use.name} is gone ({use.how}"
                       + (f": {use.why}" if use.why else "") + ")")
        elif (lacks := lacked_params(src, use)) and not use.adapted:
            out.append(f"speculators.{use.module}.{use.name} takes no "
                       f"{', '.join(lacks)} ({use.why})")
    return out


def adaptations(src) -> list[str]:
    """What the train stage does differently for the speculators in `src`:
    each declared parameter it lacks that the code adapts to, in a line."""
    return [f"{use.name} takes no {', '.join(lacks)}: {use.adapted}"
            for use in USES if use.adapted and (lacks := lacked_params(src, use))]


def source(package_dir: str | Path, version: str = "?"):
    """A speculators package folder read with ast (no import): the reader
    doctor uses for vLLM's source, which asks nothing vLLM-specific."""
    from pipeline.vllm.source import VllmSource
    return VllmSource.from_dir(Path(package_dir), version)


def installed() -> tuple[str | None, str]:
    """(this interpreter's speculators package folder or None, its version),
    found without importing it."""
    from importlib.metadata import PackageNotFoundError, version
    spec = importlib.util.find_spec("speculators")
    where = list(spec.submodule_search_locations or []) if spec else []
    try:
        v = version("speculators")
    except PackageNotFoundError:
        v = "?"
    return (where[0] if where else None), v


def refusal(package_dir: str | None, version: str, cpu: bool = True) -> str | None:
    """One sentence naming what this speculators lacks of what the train
    stage patches (None: nothing, no speculators to read, or source this
    interpreter cannot parse: a newer Python's syntax)."""
    if not package_dir:
        return None
    try:
        gone = missing(source(package_dir, version), cpu)
    except (SyntaxError, ValueError):
        return None   # unchecked, not refused: doctor says so (check_speculators)
    if not gone:
        return None
    more = f" (and {len(gone) - 3} more)" if len(gone) > 3 else ""
    return (f"speculators {version} lacks what eagle-panel's train stage patches or imports "
            f"(pipeline/train/speculators_contract.py): {'; '.join(gone[:3])}{more}")
