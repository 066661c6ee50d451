"""Load and validate config.toml: the one file that describes a pipeline run.

Every check lives here, so a bad config fails before anything is launched,
with an error that names the file, the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from pipeline import __version__, builtin
from pipeline.builtin import conversations_path
from pipeline.data.prompt_sets import MT_BENCH
from pipeline.paths import PROJECT_ROOT, VLLM_VENV
from pipeline.run.executor import SCHEDULERS  # `[cluster] scheduler`: what runs the attempts
from pipeline.stage_graph import STAGE_INPUTS
from pipeline.tracking import TRACKERS
from pipeline.vllm import contract_strings as vs

GPU_STAGES = ("regenerate", "extract", "train", "evaluate")
BUILTIN_MODEL = "builtin:tiny-llama"
BUILTIN_DATA = "builtin:conversations"


class ConfigError(Exception):
    """A config problem a user must fix; the message says where and how."""


@dataclass
class PipelineSection:
    # offline: extract writes every sample's hidden states, train reads them.
    # online: no extract pass; train asks vLLM server(s) on [gpus] extract for
    # the hidden states of each sample as it needs them (no multi-TB disk).
    # hybrid: no extract pass either; train reads what an earlier extract left
    # on disk and asks the servers for the rest (an extraction that ran out of
    # disk or time, continued without redoing it).
    mode: str = "offline"


@dataclass
class RunSection:
    name: str = "run"
    runs_dir: str = "runs"
    # The run directory holds your data (datasets, hidden states, the draft):
    # readable by you only, unless shared = true (then by your group too).
    shared: bool = False


@dataclass
class ModelSection:
    # a local model folder, a built-in, or a Hugging Face id "ORG/NAME" found in
    # the local hub cache (HF_HOME / HF_HUB_CACHE); a path that exists wins
    target: str = BUILTIN_MODEL
    # a hub id's branch, tag or commit ("" = the cached `main`)
    revision: str = ""
    # a hub id not (all) in the cache: the first stage downloads it (false:
    # nothing is ever downloaded; `hf download` it first)
    download: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    # not a config key: the snapshot a run froze when it was launched
    # (state.json `target`), given to the run's config when it is loaded
    pinned: typing.ClassVar[dict | None] = None


@dataclass
class DataSection:
    path: str = BUILTIN_DATA
    format: str = "auto"
    max_samples: int = 0


@dataclass
class GpusSection:
    devices: list[int] = field(default_factory=list)
    # Which of them each GPU stage gets (default: all of `devices`).
    regenerate: list[int] | None = None
    extract: list[int] | None = None
    train: list[int] | None = None
    evaluate: list[int] | None = None
    # Memory of one GPU in GB, for doctor's plans on a machine that does not
    # have the GPUs (a Slurm login node): 0 = as NVML reports here.
    memory_gb: float = 0.0


@dataclass
class RuntimeSection:
    python: str = ""
    # The interpreter vLLM runs with: "" = the .venv-vllm that
    # scripts/install.sh makes on a CPU machine, else `python`.
    vllm_python: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cancel_grace_s: float = 30.0
    term_grace_s: float = 10.0


@dataclass
class ClusterSection:
    # local: stages are processes on this machine. slurm: each stage is a
    # Slurm job (sbatch) with its supervisor inside; the run directory must
    # be on a filesystem every node sees; [gpus] numbers a node's GPUs.
    scheduler: str = "local"
    partition: str = ""
    account: str = ""
    nodes: int = 1              # for extract (data parallel over nodes) and train (torchrun)
    # the fewest nodes a multi-node job may start on (0 = exactly `nodes`): below `nodes`,
    # a job asks for as many as are up (an exact count), so a resume after a lost node
    # runs on the nodes left
    min_nodes: int = 0
    lost_after_s: float = 120.0   # a node worker silent this long is lost: its samples are redone
    # train over nodes: torchrun's agents wait this long for every node to join, and a
    # rank this long on one collective (a peer's node lost) ends the training, failed
    rendezvous_timeout_s: float = 600.0
    collective_timeout_s: float = 1800.0
    gpus_per_node: int = 0      # --gpus-per-node for the GPU stages (0: none asked)
    time_limit: str = ""        # --time, e.g. "24:00:00" ("" = the partition's default)
    sbatch_args: list[str] = field(default_factory=list)   # any other sbatch flags


@dataclass
class TrackingSection:
    # speculators' metric loggers for train, and evaluate's measured acceptance
    # in the same run (pipeline.tracking): any of "tensorboard", "mlflow",
    # "wandb", "trackio"; local, under <run>/tracking/, unless the stage's
    # environment names a server (MLFLOW_TRACKING_URI, WANDB_MODE).
    loggers: list[str] = field(default_factory=list)


@dataclass
class StageCommon:
    # The module run as `python -m ENTRY`: the real stage by default; tests
    # and users can substitute their own.
    entry: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ServerCommon(StageCommon):
    """What a stage that starts its own vLLM server takes."""
    serve_command: str = ""
    server_args: list[str] = field(default_factory=list)
    # server_args may not set what eagle-panel owns (--host, --port,
    # --api-key, --uds) unless this is true: then doctor warns about it
    override_server_flags: bool = False
    startup_timeout_s: float = 1200.0
    # a starting server with no new log line and no GPU memory change for
    # this long is called stalled (the panel, status and run --wait say so)
    stall_after_s: float = 300.0
    request_timeout_s: float = 600.0


@dataclass
class RegenerateSection(ServerCommon):
    # Off by default for your data: the target answering its own prompts is
    # what a draft should learn, but it costs a full generation pass.
    enabled: bool = False
    max_tokens: int = 256       # per assistant turn
    temperature: float = 0.0    # 0 = greedy
    seed: int = 0
    concurrency: int = 8        # conversations in flight
    # conversations saved together: what a kill can cost (one chunk's answers)
    chunk_size: int = 50
    # one vLLM server for regenerate and extract (extract's, which captures hidden
    # states): one target load fewer, generation slower on it (1.4-1.5x measured on
    # the CPU build): pipeline.extract.shared_server
    share_server: bool = False


@dataclass
class PrepareSection(StageCommon):
    seq_length: int = 512
    render_endpoint: str = ""
    render_timeout_s: float = 30.0


@dataclass
class ExtractSection(StageCommon):
    backend: str = "hf"
    layer_ids: list[int] = field(default_factory=list)
    # auto: the dtype the target runs in (bf16 on GPUs, fp32 on the CPU); fp8:
    # float8_e4m3fn with a scale per token, speculators' layout: half of bf16
    hidden_states_dtype: str = "auto"
    batch_tokens: int = 8192
    min_free_gb: float = 2.0
    workers: int = 0
    # vLLM backends: one server / engine per group of tensor_parallel GPUs
    tensor_parallel: int = 1
    # vllm-server backend
    serve_command: str = ""
    server_args: list[str] = field(default_factory=list)
    # server_args may not set what eagle-panel owns (--host, --port,
    # --api-key, --uds) unless this is true: then doctor warns about it
    override_server_flags: bool = False
    startup_timeout_s: float = 1200.0
    # a starting server with no new log line and no GPU memory change for
    # this long is called stalled (the panel, status and run --wait say so)
    stall_after_s: float = 300.0
    request_timeout_s: float = 600.0
    max_inflight: int = 16
    # vllm-engine backend
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 32


@dataclass
class VocabSection(StageCommon):
    draft_vocab_size: int = 32000


# [stages.train] keys that only the training budget rule reads (epochs = 0 or
# total_seq_len = 0: pipeline/train/budget.py).
BUDGET_KEYS = ("target_steps", "min_steps", "max_epochs", "patience", "min_delta")


@dataclass
class TrainSection(StageCommon):
    # 0 = the budget rule chooses from the data (pipeline.train.budget):
    # epochs to reach target_steps (at most max_epochs, never under
    # min_steps), a plateau stop after `patience` epochs whose estimate
    # gained less than min_delta; total_seq_len so small data gets its steps.
    # N = exactly N (no plateau stop for an explicit epochs).
    epochs: int = 0
    lr: float = 1e-4
    # the draft's decoder layers: 0 = speculators' own for the algorithm (1 for the
    # EAGLE-3 family and P-EAGLE, 5 for the DFlash family)
    num_layers: int = 0
    total_seq_len: int = 0
    target_steps: int = 2400
    min_steps: int = 300
    max_epochs: int = 20
    patience: int = 2
    min_delta: float = 0.005
    ttt_steps: int = 3
    train_ratio: float = 0.9
    checkpoint_freq: float = 1.0
    max_steps: int = 0
    # online mode: requests in flight per server, and how often a vLLM
    # server that dies mid-training is restarted before the stage fails
    online_max_inflight: int = 16
    server_restarts: int = 2
    # online and hybrid: keep the hidden states the servers generate, up to this
    # many GB, beside extract's files, so later epochs read them from disk
    # (0: speculators' way, each deleted once loaded; min_free_gb applies too)
    keep_generated_gb: float = 0.0
    # speculators' dataloader processes: -1 = auto (4 on GPUs; on the CPU 0,
    # and 2 online so that requests to vLLM overlap)
    dataloader_workers: int = -1
    loss: str = "auto"
    attention: str = "auto"
    # the draft's decoder layer: "auto" = MLA for an MLA target where the vLLM in
    # use needs it (its CPU build), else speculators' Llama layer
    draft_layer: str = "auto"
    # the draft algorithm (pipeline.train.algorithms): "eagle3", "eagle3.1", "peagle",
    # "dflash", "dspark", "dflash2"; block_size: a block drafter's block (DFlash, DSpark,
    # DFlash2; 0 = speculators' default, 16 / 8 / 8)
    algorithm: str = "eagle3"
    block_size: int = 0
    # speculators' --loss-fn as weights of its losses ({ kl_div = 1.0 }; { ce = 0.1,
    # tv = 0.9 }); empty = the algorithm's own (kl_div; ce for DFlash)
    loss_weights: dict[str, float] = field(default_factory=dict)
    # the per-position loss weight: EAGLE-3's TTT-step decay (step k weighs decay^k),
    # the DFlash family's decay gamma (position p weighs exp(-(p-1)/gamma)); 0 = speculators'
    position_decay: float = 0.0
    # training processes per node: 0 = one per GPU the stage is given (one on a
    # CPU-only node); on a CPU-only node more train data parallel over gloo
    ranks_per_node: int = 0
    seed: int = 0
    log_freq: int = 1


@dataclass
class EvaluateSection(ServerCommon):
    enabled: bool = True
    # chosen (train's: the draft its summary names) | last | best | all | best-K (K: a count)
    checkpoints: str = "chosen"
    num_speculative_tokens: int = 3
    prompts: str = ""           # "" = the validation split's prompts; or a JSONL file
    max_prompts: int = 64
    max_tokens: int = 64
    temperature: float = 0.0    # 0 = greedy; > 0 samples (seeded)
    seed: int = 0
    concurrency: int = 1        # requests in flight: the decode speed is measured at this load
    baseline: bool = True       # also serve without the draft: the speedup
    # every checkpoint on one server: the next drafts loaded into it (draft_swap);
    # false: a server per checkpoint (a restart is also the fallback where a swap cannot work)
    one_server: bool = True
    # below this measured acceptance length the stage fails (0 = no gate)
    min_acceptance: float = 0.0


@dataclass
class StagesSection:
    regenerate: RegenerateSection = field(default_factory=RegenerateSection)
    prepare: PrepareSection = field(default_factory=PrepareSection)
    extract: ExtractSection = field(default_factory=ExtractSection)
    vocab: VocabSection = field(default_factory=VocabSection)
    train: TrainSection = field(default_factory=TrainSection)
    evaluate: EvaluateSection = field(default_factory=EvaluateSection)


@dataclass
class Config:
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    gpus: GpusSection = field(default_factory=GpusSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    stages: StagesSection = field(default_factory=StagesSection)
    source: Path | None = None
    base_dir: Path = PROJECT_ROOT

    # -- derived values -------------------------------------------------
    def stage(self, name: str) -> StageCommon:
        return getattr(self.stages, name)

    def stage_entry(self, name: str) -> str:
        return self.stage(name).entry or f"pipeline.stages.{name}"

    def stage_devices(self, name: str) -> list[int]:
        """The GPUs a stage is given ([] = the CPU); only GPU stages get any."""
        if name not in GPU_STAGES:
            return []
        own = getattr(self.gpus, name)
        return list(self.gpus.devices if own is None else own)

    def held_devices(self, name: str) -> list[int]:
        """The GPUs a stage holds while it runs: its own, and in online mode
        train's vLLM servers run on extract's."""
        held = self.stage_devices(name)
        if name == "train" and self.online:
            held += [d for d in self.stage_devices("extract") if d not in held]
        return held

    def enabled(self, name: str) -> bool:
        """Whether a stage runs: optional stages can be turned off, and online
        mode folds extract into train."""
        return self.off_reason(name) is None

    def off_reason(self, name: str) -> str | None:
        if name == "extract" and self.pipeline.mode == "hybrid":
            return ('off ([pipeline] mode = "hybrid": train reads the hidden states extract '
                    "left on disk and asks vLLM for the rest)")
        if name == "extract" and self.online:
            return 'off ([pipeline] mode = "online": train asks vLLM for the hidden states)'
        if not getattr(self.stage(name), "enabled", True):
            return f"off ([stages.{name}] enabled = false)"
        if name == "vocab":
            from pipeline.train.algorithms import get
            algo = get(self.stages.train.algorithm)
            if algo.full_vocab:
                return (f"off ([stages.train] algorithm = {algo.name!r}: {algo.display} trains "
                        "on the target's whole vocabulary, no draft vocabulary to map)")
        return None

    @property
    def online(self) -> bool:
        """Train runs vLLM servers for the hidden states (online and hybrid)."""
        return self.pipeline.mode in ("online", "hybrid")

    def python(self) -> str:
        return self.runtime.python or sys.executable

    def vllm_python(self) -> str:
        if self.runtime.vllm_python:
            return self.runtime.vllm_python
        own = VLLM_VENV / "bin" / "python"
        return str(own) if own.exists() else self.python()

    def resolve(self, path: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        p = Path(os.path.expanduser(path))
        return p if p.is_absolute() else (self.base_dir / p)

    def runs_dir(self) -> Path:
        return self.resolve(self.run.runs_dir)

    def target_path(self) -> Path:
        """The target model's folder: a built-in (built on first use), a local
        folder, or a hub id's snapshot in the local cache (a run's: the one it
        froze; pipeline.model.hub)."""
        if self.model.target in builtin.TARGETS:
            return builtin.target(self.model.target).ensure_built()
        local = self.resolve(self.model.target)
        from pipeline.model import hub
        if not hub.is_hub_target(self):
            return local
        try:
            return hub.target_path(self)
        except hub.HubError as e:
            raise ConfigError(str(e)) from None

    def data_path(self) -> Path:
        if self.data.path == BUILTIN_DATA:
            return conversations_path()
        return self.resolve(self.data.path)

    def dtype_name(self, on_gpu: bool) -> str:
        """The hidden-state dtype: [model] dtype, or for "auto" bf16 where a
        GPU (or vLLM) runs the model and fp32 on the CPU."""
        if self.model.dtype != "auto":
            return self.model.dtype
        return "bfloat16" if on_gpu else "float32"

    def section_dict(self, name: str) -> dict:
        d = dataclasses.asdict(self.stage(name))
        if not d.get("override_server_flags", True):
            del d["override_server_flags"]   # decides no output: a run's fingerprints stay
        if name == "regenerate":
            # how, not what: the same answers at temperature 0; sampled ones equally the
            # target's (another random path on the verify step). Toggling it reruns nothing.
            d.pop("share_server", None)
            # how the work is saved, not what: each size keeps its chunks in a folder
            # of its own (pipeline.stages.regenerate.split_chunks)
            d.pop("chunk_size", None)
        if name == "train":
            from pipeline.train.algorithms import num_layers
            # what decides the draft, not how it is spelled: 0 is the algorithm's own count,
            # and keys at their defaults are left out (runs made before them stay up to date)
            d["num_layers"] = num_layers(self.stages.train)
            for key, default in (("ranks_per_node", 0), ("loss_weights", {}),
                                 ("position_decay", 0.0)):
                if d.get(key) == default:
                    del d[key]
        if name == "train" and d.get("algorithm") == "eagle3" and not d.get("block_size"):
            del d["algorithm"], d["block_size"]   # their defaults: runs made before them stay
        if name == "train" and d.get("epochs") and d.get("total_seq_len"):
            for key in BUDGET_KEYS:   # the budget rule is off: they decide nothing, and a
                d.pop(key, None)      # run made before they existed stays up to date
        return d

    def fingerprint(self, name: str, upstream: dict[str, str]) -> str:
        """Hash of what decides the stage's output: its section, the shared
        sections it reads, the fingerprints of its inputs and our version."""
        from pipeline.model import hub
        payload = {
            "stage": name,
            "section": self.section_dict(name),
            "model": hub.model_identity(self),   # a hub id: by its resolved commit
            "data": dataclasses.asdict(self.data) if name in ("regenerate", "prepare") else None,
            # the mode changes only what extract and train do: prepare, vocab and
            # evaluate stay done when an offline run continues as "hybrid"
            "pipeline": dataclasses.asdict(self.pipeline) if name in ("extract", "train")
            else None,
            "devices": self.stage_devices(name),
            "inputs": {k: upstream.get(k, "") for k in STAGE_INPUTS[name]},
            "version": __version__,
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# -- validation ------------------------------------------------------------

def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}s"
    if origin is dict:
        return f"a table of {_type_name(typing.get_args(tp)[1]).split(' ', 1)[1]}s"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _check_value(value, tp, where: str, src: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _check_value(value, args[0], where, src)
    bad = ConfigError(
        f"{src}: `{where}` must be {_type_name(tp)}, got {type(value).__name__} {value!r}. "
        f"Fix the value of `{where}` in {src}."
    )
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        _check_number(value, where, src)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        _check_number(value, where, src)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item,) = typing.get_args(tp)
        return [_check_value(v, item, f"{where}[{i}]", src) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        item = typing.get_args(tp)[1]
        if item is str and not all(isinstance(v, str) for v in value.values()):
            raise bad
        return {k: _check_value(v, item, f"{where}.{k}", src) for k, v in value.items()}
    raise AssertionError(f"unsupported config type {tp}")


# Numbers that may be negative (-1 = auto); every other one may not.
MAY_BE_NEGATIVE = {"stages.train.dataloader_workers": -1}
HUGE = 10 ** 12   # no count, size or time in a config comes near this


def _check_number(value, where: str, src: str) -> None:
    bare = where.split("[")[0]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{src}: `{where}` = {value} is not a finite number. "
                          f"Give `{where}` a real value.")
    floor = MAY_BE_NEGATIVE.get(bare, 0)
    if value < floor:
        allowed = "-1 (auto) or a count" if floor == -1 else "a count, size or time: never negative"
        raise ConfigError(f"{src}: `{where}` = {value} is out of range ({allowed}). "
                          f"Fix `{where}`.")
    if value > HUGE:
        raise ConfigError(f"{src}: `{where}` = {value} is far too large. Check `{where}`.")


def _fill(cls, table: dict, prefix: str, src: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in ("source", "base_dir")]
    kwargs = {}
    for key, value in table.items():
        where = f"{prefix}{key}"
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f" Did you mean `{prefix}{near[0]}`?" if near else ""
            valid = ", ".join(names)
            raise ConfigError(
                f"{src}: unknown key `{where}`.{hint} Valid keys here: {valid}."
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{src}: `{where}` must be a table ([{where}]), got {value!r}.")
            kwargs[key] = _fill(tp, value, f"{where}.", src)
        else:
            kwargs[key] = _check_value(value, tp, where, src)
    return cls(**kwargs)


def _choice(value: str, allowed, where: str, src: str):
    if value not in allowed:
        near = difflib.get_close_matches(value, allowed, n=1, cutoff=0.6)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ConfigError(
            f"{src}: `{where}` = {value!r} is not one of {', '.join(map(repr, allowed))}.{hint} "
            f"Set `{where}` to one of them."
        )


def _semantic_checks(cfg: Config, src: str, gpu_count):
    """What types alone cannot say: names, choices, ranges, paths, GPUs."""
    name = cfg.run.name
    # (the same rule as a --run id's: pipeline.run.rundir.check_run_id)
    if not name or "/" in name or "\\" in name or name.startswith(".") or \
            any(ord(c) < 32 for c in name) or len(name.encode(errors="surrogateescape")) > 255:
        raise ConfigError(f"{src}: `run.name` = {name!r} must be a plain folder name (no "
                          "slashes, not starting with a dot, at most 255 bytes). Fix `run.name`.")
    _check_choices(cfg, src)
    _check_texts(cfg, src)
    _check_ranges(cfg, src)
    _check_meanings(cfg, src)
    _check_server_args(cfg, src)
    _check_paths(cfg, src)
    _check_gpus(cfg, src, gpu_count)


def _check_choices(cfg: Config, src: str) -> None:
    """Values from a fixed set, and the combinations allowed."""
    _choice(cfg.model.dtype, ("auto", "float32", "bfloat16", "float16"), "model.dtype", src)
    _choice(cfg.data.format, ("auto", "messages", "sharegpt", "tokenized"), "data.format", src)
    _choice(cfg.stages.extract.backend, ("auto", "hf", "vllm-server", "vllm-engine"),
            "stages.extract.backend", src)
    _choice(cfg.stages.extract.hidden_states_dtype, ("auto", "fp8"),
            "stages.extract.hidden_states_dtype", src)
    _choice(cfg.stages.train.loss, ("auto", "eager", "fused"), "stages.train.loss", src)
    _choice(cfg.stages.train.attention, ("auto", "sdpa", "eager", "flex"),
            "stages.train.attention", src)
    _choice(cfg.stages.train.draft_layer, ("auto", "llama", "mla"),
            "stages.train.draft_layer", src)
    _check_algorithm(cfg, src)
    _choice(cfg.pipeline.mode, ("offline", "online", "hybrid"), "pipeline.mode", src)
    _choice(cfg.cluster.scheduler, SCHEDULERS, "cluster.scheduler", src)
    for i, name in enumerate(cfg.tracking.loggers):
        _choice(name, TRACKERS, f"tracking.loggers[{i}]", src)
        if name in cfg.tracking.loggers[:i]:
            raise ConfigError(f"{src}: `tracking.loggers` names {name!r} twice. Name each "
                              "tracker once.")
    if cfg.cluster.nodes > 1 and cfg.online:
        raise ConfigError(f"{src}: `cluster.nodes` = {cfg.cluster.nodes} with `pipeline.mode = "
                          '"online"`: online training runs its vLLM servers beside the trainer '
                          "on one node. Set `cluster.nodes = 1`, or mode = \"offline\".")
    if cfg.cluster.nodes > 1 and cfg.cluster.scheduler != "slurm":
        raise ConfigError(f'{src}: `cluster.nodes` = {cfg.cluster.nodes} needs `cluster.scheduler '
                          '= "slurm"` (the nodes come from the scheduler\'s allocation). Set '
                          "`cluster.nodes = 1`, or scheduler = \"slurm\".")
    if cfg.cluster.min_nodes > cfg.cluster.nodes:
        raise ConfigError(f"{src}: `cluster.min_nodes` = {cfg.cluster.min_nodes} is more than "
                          f"`cluster.nodes` = {cfg.cluster.nodes}. Set `cluster.min_nodes` to at "
                          "most `nodes` (0: exactly `nodes`).")
    which = cfg.stages.evaluate.checkpoints
    if not (which.startswith("best-") and which[5:].isdigit() and int(which[5:]) > 0):
        # best-K: the K checkpoints train estimates best, the draft named by vLLM's measure
        _choice(which, ("chosen", "last", "best", "all", "best-3"),
                "stages.evaluate.checkpoints", src)


def _check_algorithm(cfg: Config, src: str) -> None:
    """`[stages.train] algorithm` and what it combines with: one speculators
    trains but the pipeline does not run yet is refused with why; a draft
    layer only EAGLE-3's draft has; a block drafter's block (DFlash,
    DSpark) against the tokens evaluate asks vLLM to draft."""
    from pipeline.train import algorithms
    from pipeline.train.algorithms import ALGORITHMS, NOT_YET
    train, where = cfg.stages.train, "stages.train.algorithm"
    if train.algorithm in NOT_YET:
        raise ConfigError(f"{src}: `{where}` = {train.algorithm!r}: speculators trains it, but "
                          f"eagle-panel does not run it yet: {NOT_YET[train.algorithm]}. Set "
                          f"`{where}` to one of {', '.join(map(repr, ALGORITHMS))}.")
    _choice(train.algorithm, tuple(ALGORITHMS), where, src)
    algo = ALGORITHMS[train.algorithm]
    if not algo.eagle3_layers and train.draft_layer != "auto":
        raise ConfigError(f"{src}: `stages.train.draft_layer` = {train.draft_layer!r} with "
                          f"`{where}` = {train.algorithm!r}: the llama and MLA draft layers are "
                          f"EAGLE-3's; {train.algorithm} trains its own layers (speculators' "
                          'qwen3). Remove `draft_layer` (or set it to "auto"), or set algorithm '
                          '= "eagle3" / "eagle3.1".')
    if train.block_size < 0 or train.block_size == 1:
        raise ConfigError(f"{src}: `stages.train.block_size` = {train.block_size}: 0 (speculators' "
                          f"default, {algo.block or 16}) or a block of 2 or more tokens.")
    blocked = [a.name for a in ALGORITHMS.values() if a.block]
    if train.block_size and not algo.block:
        raise ConfigError(f"{src}: `stages.train.block_size` is for the block drafters "
                          f"({', '.join(blocked)}); `{where}` is {train.algorithm!r}. Remove "
                          f"`block_size`, or set algorithm to one of them.")
    k = cfg.stages.evaluate.num_speculative_tokens
    if train.algorithm == "peagle" and k > algorithms.PEAGLE_DEPTHS:
        raise ConfigError(f"{src}: `stages.evaluate.num_speculative_tokens` = {k} with P-EAGLE: "
                          f"speculators trains {algorithms.PEAGLE_DEPTHS} depths, so positions "
                          "past them have no metrics and no estimate. Set num_speculative_tokens "
                          f"<= {algorithms.PEAGLE_DEPTHS}.")
    _check_loss(cfg, algo, src)
    if algo.block and cfg.enabled("evaluate"):
        block, most = train.block_size or algo.block, algo.most_drafted(train.block_size)
        if k > most:
            raise ConfigError(
                f"{src}: `stages.evaluate.num_speculative_tokens` = {k} with {algo.display}'s "
                f"block of {block}: vLLM drafts at most "
                f"{'block_size' if algo.from_anchor else 'block_size - 1'} = {most} tokens from "
                "it. Lower num_speculative_tokens, or raise `stages.train.block_size`.")


def _check_loss(cfg: Config, algo, src: str) -> None:
    """`loss_weights` names speculators' losses with positive weights;
    DFlash's default per-position weight (DPACE) takes the cross-entropy loss
    alone ("--per-position-loss-weight=dpace requires --loss-fn=ce");
    `position_decay` is for an algorithm that has one."""
    from pipeline.train.algorithms import LOSSES
    train = cfg.stages.train
    for name, weight in train.loss_weights.items():
        if name not in LOSSES:
            raise ConfigError(f"{src}: `stages.train.loss_weights` names {name!r}, which is not "
                              f"one of speculators' losses ({', '.join(LOSSES)}). Fix the name.")
        if not weight > 0:
            raise ConfigError(f"{src}: `stages.train.loss_weights.{name}` = {weight}: a weight "
                              "must be positive. Remove the loss, or give it a weight above 0.")
    if algo.name == "dflash" and train.loss_weights not in ({}, {"ce": 1.0}):
        raise ConfigError(f"{src}: `stages.train.loss_weights` = {train.loss_weights} with DFlash:"
                          " its per-position weight (DPACE, speculators' default for DFlash) "
                          "takes the cross-entropy loss alone. Set loss_weights = { ce = 1.0 } "
                          "(or remove it).")
    if train.position_decay and not algo.decay_flag:
        raise ConfigError(f"{src}: `stages.train.position_decay` = {train.position_decay} with "
                          f"{algo.display}, which weighs every position alike. Remove "
                          "`position_decay`.")
    if algo.name == "dflash" and train.position_decay:
        raise ConfigError(f"{src}: `stages.train.position_decay` with DFlash: its per-position "
                          "weight is DPACE (speculators' default for DFlash), which has no decay. "
                          "Remove `position_decay`, or train dspark or dflash2, which decay.")


MAX_WORKERS = 1024   # extractor processes on one machine: well past 8 GPUs x a few each


def _check_texts(cfg: Config, src: str) -> None:
    """Text that must say something: an empty runs folder or data path is
    taken as the config file's own folder, and a render endpoint that is not
    a URL fails only later, in prepare."""
    from urllib.parse import urlparse
    for where, value, fix in (
            ("run.runs_dir", cfg.run.runs_dir, 'name the folder the runs go in, e.g. "runs"'),
            ("data.path", cfg.data.path, 'name a dataset (JSONL or a datasets folder), or '
             '"builtin:conversations"')):
        if not value.strip():
            raise ConfigError(f"{src}: `{where}` = {value!r} is empty: {fix}.")
    url = cfg.stages.prepare.render_endpoint
    if url:
        parts = urlparse(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{src}: `stages.prepare.render_endpoint` = {url!r} is not an "
                              "http(s) URL. Give a running vLLM server's base URL, e.g. "
                              '"http://127.0.0.1:8000", or "" to render with the local '
                              "tokenizer.")


def _check_ranges(cfg: Config, src: str) -> None:
    """Counts that must be positive, shares in (0, 1], layer numbers."""
    for where, value in (
        ("stages.prepare.seq_length", cfg.stages.prepare.seq_length),
        ("stages.extract.batch_tokens", cfg.stages.extract.batch_tokens),
        ("stages.vocab.draft_vocab_size", cfg.stages.vocab.draft_vocab_size),
        ("stages.train.target_steps", cfg.stages.train.target_steps),
        ("stages.train.max_epochs", cfg.stages.train.max_epochs),
        ("stages.train.ttt_steps", cfg.stages.train.ttt_steps),
        ("stages.train.log_freq", cfg.stages.train.log_freq),
        ("stages.extract.tensor_parallel", cfg.stages.extract.tensor_parallel),
        ("stages.extract.max_inflight", cfg.stages.extract.max_inflight),
        ("stages.extract.stall_after_s", cfg.stages.extract.stall_after_s),
        ("stages.regenerate.stall_after_s", cfg.stages.regenerate.stall_after_s),
        ("stages.evaluate.stall_after_s", cfg.stages.evaluate.stall_after_s),
        ("stages.extract.max_num_seqs", cfg.stages.extract.max_num_seqs),
        ("stages.regenerate.max_tokens", cfg.stages.regenerate.max_tokens),
        ("stages.regenerate.concurrency", cfg.stages.regenerate.concurrency),
        ("stages.regenerate.chunk_size", cfg.stages.regenerate.chunk_size),
        ("stages.evaluate.num_speculative_tokens", cfg.stages.evaluate.num_speculative_tokens),
        ("stages.evaluate.max_prompts", cfg.stages.evaluate.max_prompts),
        ("stages.evaluate.max_tokens", cfg.stages.evaluate.max_tokens),
        ("stages.evaluate.concurrency", cfg.stages.evaluate.concurrency),
        ("cluster.nodes", cfg.cluster.nodes),
        ("cluster.lost_after_s", cfg.cluster.lost_after_s),
        ("cluster.rendezvous_timeout_s", cfg.cluster.rendezvous_timeout_s),
        ("cluster.collective_timeout_s", cfg.cluster.collective_timeout_s),
    ):
        if value <= 0:
            raise ConfigError(f"{src}: `{where}` must be positive, got {value}. "
                              f"Set `{where}` to 1 or more.")
    if not 0 < cfg.stages.extract.gpu_memory_utilization <= 1:
        raise ConfigError(f"{src}: `stages.extract.gpu_memory_utilization` must be in (0, 1], "
                          f"got {cfg.stages.extract.gpu_memory_utilization}.")
    if not 0 < cfg.stages.train.train_ratio < 1:
        raise ConfigError(f"{src}: `stages.train.train_ratio` must be in (0, 1), got "
                          f"{cfg.stages.train.train_ratio}: at 1 no sample is left for "
                          "validation, so train has no estimate and no plateau stop. "
                          "Set it below 1, e.g. 0.9.")
    if cfg.stages.extract.workers > MAX_WORKERS:
        raise ConfigError(f"{src}: `stages.extract.workers` = {cfg.stages.extract.workers} "
                          f"is past any machine's processes (at most {MAX_WORKERS}). Set it "
                          "to the extractor processes wanted, or 0 for one per GPU.")
    if cfg.runtime.cancel_grace_s < 0 or cfg.runtime.term_grace_s < 0:
        raise ConfigError(f"{src}: `runtime.cancel_grace_s` and `runtime.term_grace_s` "
                          "must not be negative.")
    for where, value in (("stages.regenerate.temperature", cfg.stages.regenerate.temperature),
                         ("stages.evaluate.temperature", cfg.stages.evaluate.temperature)):
        if value < 0:
            raise ConfigError(f"{src}: `{where}` must be 0 (greedy) or positive, got {value}.")
    if cfg.stages.train.keep_generated_gb < 0:
        raise ConfigError(f"{src}: `stages.train.keep_generated_gb` must be 0 (keep nothing) "
                          f"or a size in GB, got {cfg.stages.train.keep_generated_gb}.")
    if cfg.gpus.memory_gb < 0:
        raise ConfigError(f"{src}: `gpus.memory_gb` must be 0 (as NVML reports) or a GPU's "
                          f"memory in GB, got {cfg.gpus.memory_gb}.")
    if any(i < 0 for i in cfg.stages.extract.layer_ids):
        raise ConfigError(f"{src}: `stages.extract.layer_ids` must be layer numbers >= 0.")


SERVER_SECTIONS = ("regenerate", "extract", "evaluate")


def _check_meanings(cfg: Config, src: str) -> None:
    """Numbers whose zero means nothing (a timeout, a rate, a frequency), and
    numbers that must agree with each other."""
    st = cfg.stages
    positive = [("stages.train.lr", st.train.lr),
                ("stages.train.checkpoint_freq", st.train.checkpoint_freq),
                ("stages.train.online_max_inflight", st.train.online_max_inflight),
                ("stages.prepare.render_timeout_s", st.prepare.render_timeout_s)]
    for name in SERVER_SECTIONS:
        for key in ("startup_timeout_s", "request_timeout_s"):
            positive.append((f"stages.{name}.{key}", getattr(getattr(st, name), key)))
    for where, value in positive:
        if value <= 0:
            raise ConfigError(f"{src}: `{where}` must be above 0 (a time, a rate or a "
                              f"frequency: 0 would never happen or never end), got {value}. "
                              f"Set `{where}` to a positive value, or remove it for the "
                              "default.")
    k, gate = st.evaluate.num_speculative_tokens, st.evaluate.min_acceptance
    if gate > k + 1:
        raise ConfigError(
            f"{src}: `stages.evaluate.min_acceptance` = {gate} can never be met: with "
            f"`stages.evaluate.num_speculative_tokens` = {k} a step accepts at most {k + 1} "
            f"tokens (the {k} drafted and the target's own). Set `min_acceptance` to at "
            f"most {k + 1}, or 0 for no gate.")
    if 0 < st.train.total_seq_len < st.prepare.seq_length:   # (0: the budget chooses)
        raise ConfigError(
            f"{src}: `stages.train.total_seq_len` = {st.train.total_seq_len} is shorter than "
            f"`stages.prepare.seq_length` = {st.prepare.seq_length}: a training step packs "
            "whole samples, and one sample would not fit. Raise `total_seq_len` (or lower "
            "`seq_length`).")
    # (extract's batch_tokens may be below seq_length: the hf backend then
    # runs one sample per batch, the vllm-engine one prefills in chunks)


# vLLM flags eagle-panel sets itself: loopback only, its own port and key.
OWNED_SERVER_FLAGS = (vs.FLAG_HOST, vs.FLAG_PORT, vs.FLAG_API_KEY, vs.FLAG_UDS)
# environment variables that open vLLM's development endpoints (/collective_rpc, /sleep, ...)
OWNED_SERVER_ENV = ("VLLM_SERVER_DEV_MODE",)


def owned_flag(arg: str) -> str | None:
    """The owned flag `arg` sets (also as --flag=value, with underscores, or
    abbreviated as argparse allows), or None."""
    if not arg.startswith("--"):
        return None
    name = "--" + arg[2:].split("=", 1)[0].replace("_", "-").lower()
    if len(name) < 4:
        return None
    return next((f for f in OWNED_SERVER_FLAGS if f.startswith(name)), None)


def _check_server_args(cfg: Config, src: str) -> None:
    """server_args and env must not undo what keeps a server private."""
    for name in SERVER_SECTIONS:
        sec = cfg.stage(name)
        if sec.override_server_flags:
            continue
        for arg in sec.server_args:
            flag = owned_flag(arg)
            if flag:
                raise ConfigError(
                    f"{src}: `stages.{name}.server_args` sets {arg!r}, which eagle-panel owns "
                    f"({flag}: every server listens on 127.0.0.1 on a free port with a "
                    "random API key). Remove it; if you mean it, also set "
                    f"`stages.{name}.override_server_flags = true` (doctor will warn).")
        for where, env in (("runtime.env", cfg.runtime.env), (f"stages.{name}.env", sec.env)):
            bad = [v for v in OWNED_SERVER_ENV if env.get(v, "0") not in ("", "0")]
            if bad:
                raise ConfigError(
                    f"{src}: `{where}` sets {bad[0]}, which opens vLLM's development "
                    "endpoints (they run any call in the server) on the servers of "
                    f"`stages.{name}`. Remove it; if you mean it, also set "
                    f"`stages.{name}.override_server_flags = true` (doctor will warn).")


def overridden_server_flags(cfg: Config) -> list[str]:
    """For doctor's warning: the owned flags and variables a config sets on purpose."""
    out = []
    for name in SERVER_SECTIONS:
        sec = cfg.stage(name)
        if sec.override_server_flags:
            env = {**cfg.runtime.env, **sec.env}
            out += [f"stages.{name}: {a}" for a in sec.server_args if owned_flag(a)]
            out += [f"stages.{name}: {v}={env[v]}" for v in OWNED_SERVER_ENV
                    if env.get(v, "0") not in ("", "0")]
    return out


def _check_paths(cfg: Config, src: str) -> None:
    """Files and folders the config names must be there."""
    prompts = cfg.stages.evaluate.prompts
    if prompts and prompts != MT_BENCH and not cfg.resolve(prompts).is_file():
        raise ConfigError(
            f"{src}: `stages.evaluate.prompts` = {prompts!r}: {cfg.resolve(prompts)} is not a "
            f'file. Give "{MT_BENCH}", a JSONL file (`turns` with a `category`, `messages` or '
            '`prompt`), or "" for the validation split.')
    known = {"model.target": tuple(builtin.TARGETS), "data.path": (BUILTIN_DATA,)}
    for kind, value in (("model.target", cfg.model.target), ("data.path", cfg.data.path)):
        if value.startswith("builtin:"):
            if value not in known[kind]:
                raise ConfigError(
                    f"{src}: `{kind}` = {value!r} is not a built-in; the built-ins are "
                    f"{', '.join(map(repr, known[kind]))}."
                )
            continue
        if not cfg.resolve(value).exists():
            if kind == "model.target":
                from pipeline.model import hub
                if hub.is_hub_id(value):   # found in the hub cache (or to be downloaded)
                    try:
                        hub.check_config(cfg, src)
                    except hub.HubError as e:
                        raise ConfigError(str(e)) from None
                    continue
            raise ConfigError(
                f"{src}: `{kind}` = {value!r}: {cfg.resolve(value)} does not exist. "
                "Give a local path (relative paths are relative to the config file)"
                + (", a Hugging Face id (ORG/NAME)" if kind == "model.target" else "")
                + ", or use the built-in default."
            )
    if cfg.model.revision and (cfg.model.target.startswith("builtin:")
                               or cfg.resolve(cfg.model.target).exists()):
        raise ConfigError(
            f"{src}: `model.revision` = {cfg.model.revision!r} applies to a Hugging Face id "
            f"only, and `model.target` = {cfg.model.target!r} is "
            + ("a built-in" if cfg.model.target.startswith("builtin:") else "a local folder")
            + ". Remove `model.revision`, or name the model by its id (ORG/NAME).")
    for key in ("python", "vllm_python"):
        value = getattr(cfg.runtime, key)
        py = Path(value)
        if value and not (py.is_file() and os.access(py, os.X_OK)):
            raise ConfigError(
                f"{src}: `runtime.{key}` = {value!r} is not an executable file. Point it at "
                "the interpreter of your ML environment (e.g. /opt/venv/bin/python), or "
                "leave it empty for the default.")


def _check_gpus(cfg: Config, src: str, gpu_count) -> None:
    """GPU ids: no repeats, stage subsets of [gpus] devices, on this machine."""
    devices = cfg.gpus.devices
    tp, ext = cfg.stages.extract.tensor_parallel, cfg.stage_devices("extract")
    if (cfg.stages.extract.backend.startswith("vllm") or cfg.online) and ext and len(ext) % tp:
        raise ConfigError(
            f"{src}: `stages.extract.tensor_parallel` = {tp} does not divide the {len(ext)} "
            f"GPUs extract is given ({ext}): each vLLM server / engine takes {tp}. "
            "Change one of them.")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{src}: `gpus.devices` lists a GPU twice: {devices}.")
    for stage in GPU_STAGES:
        own = getattr(cfg.gpus, stage)
        if own is not None and not set(own) <= set(devices):
            raise ConfigError(
                f"{src}: `gpus.{stage}` = {own} uses GPUs not in `gpus.devices` = {devices}. "
                f"Add them to `gpus.devices` or remove them from `gpus.{stage}`."
            )
    if devices and gpu_count is not None and cfg.cluster.scheduler == "local":
        # (with a scheduler the GPUs are the compute nodes', not this machine's)
        count = gpu_count()
        if count is None:
            raise ConfigError(
                f"{src}: `gpus.devices` = {devices}, but no NVIDIA driver was found on this "
                "machine. Set `devices = []` to run on the CPU."
            )
        missing = [d for d in devices if d >= count]
        if missing:
            raise ConfigError(
                f"{src}: `gpus.devices` names GPU {missing[0]}, but this machine has "
                f"{count} GPU(s) (0..{count - 1}). Fix `gpus.devices`."
            )


def _nvml_gpu_count() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def parse(text: str, src: str = "config.toml", base_dir: Path | None = None,
          gpu_count=_nvml_gpu_count) -> Config:
    if not text.strip():
        raise ConfigError(f"{src}: the config is empty. Copy the bundled config.toml and "
                          "change what your run needs.")
    if "\x00" in text:
        raise ConfigError(f"{src}: not a text file (it holds NUL bytes). Give a TOML config.")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{src}: not valid TOML: {e}. Fix the syntax at that line.") from None
    cfg = _fill(Config, table, "", src)
    cfg.base_dir = (base_dir or PROJECT_ROOT).resolve()
    _semantic_checks(cfg, src, gpu_count)
    return cfg


def load(path: str | os.PathLike, gpu_count=_nvml_gpu_count,
         base_dir: Path | None = None) -> Config:
    """Load a config file; `base_dir` overrides the folder relative paths are
    resolved from (a run's frozen copy keeps its original folder's meaning).
    `gpu_count=None` skips the GPU-presence check (stages already launched)."""
    if not str(path).strip():
        raise ConfigError("--config is empty: name a config file (or leave --config out for "
                          "./config.toml).")
    p = Path(path)
    if p.exists() and not p.is_file():
        # a folder, /dev/zero, a FIFO: never read (one would never end)
        kind = "a folder" if p.is_dir() else "not a regular file"
        raise ConfigError(f"{p}: not a config file ({kind}). Pass --config PATH/config.toml.")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{p}: config file not found. Pass --config PATH, or copy the example "
            "config.toml from the eagle-panel folder."
        ) from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config: {e.strerror}.") from None
    try:
        text = raw.decode("utf-8-sig")   # a BOM (Windows editors) is not TOML
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}). Save it as UTF-8.") from None
    cfg = parse(text, str(p), base_dir or p.resolve().parent, gpu_count)
    cfg.source = p.resolve()
    return cfg


def default_config_path() -> Path:
    here = Path.cwd() / "config.toml"
    return here if here.exists() else PROJECT_ROOT / "config.toml"
