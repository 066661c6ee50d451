"""Load and validate config.toml: the one file that describes a pipeline run.

Each key is a field below that declares its own type, rules and whether it
decides a stage's output (pipeline/config_fields.py, the one loader); what
one field cannot say — keys that must agree, paths, GPUs — is checked after
loading. A bad config fails before anything is launched, with an error that
names the file, the key and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from pipeline import __version__, builtin
from pipeline.builtin import conversations_path
from pipeline.config_fields import (
    NEVER,
    NOT_ZERO,
    POSITIVE,
    UNLESS_DEFAULT,
    ConfigError,
    choice,
    fill,
    fingerprinted,
    opt,
    rule,
)
from pipeline.data.prompt_sets import MT_BENCH
from pipeline.paths import PROJECT_ROOT, VLLM_VENV
from pipeline.run.executor import SCHEDULERS  # `[cluster] scheduler`: what runs the attempts
from pipeline.stage_graph import STAGE_INPUTS
from pipeline.tracking import TRACKERS
from pipeline.vllm import contract_strings as vs

GPU_STAGES = ("regenerate", "extract", "train", "evaluate")
BUILTIN_MODEL = "builtin:tiny-llama"
BUILTIN_DATA = "builtin:conversations"
TRACKER_NAMES = tuple(TRACKERS)
MAX_WORKERS = 1024   # extractor processes on one machine: well past 8 GPUs x a few each


def not_blank(fix: str):
    """Text that must say something: empty would mean the config's own folder."""
    return rule(lambda v: bool(v.strip()), "= {value!r} is empty: " + fix + ".")


def _http_url(value: str) -> bool:
    from urllib.parse import urlparse
    parts = urlparse(value)
    return not value or (parts.scheme in ("http", "https") and bool(parts.netloc))


def _checkpoints_choice(value: str, where: str, src: str) -> None:
    """chosen | last | best | all | best-K (K: a count)."""
    if not (value.startswith("best-") and value[5:].isdigit() and int(value[5:]) > 0):
        # best-K: the K checkpoints train estimates best, the draft named by vLLM's measure
        choice(value, ("chosen", "last", "best", "all", "best-3"), where, src)


def _each_tracker_once(value: list, where: str, src: str) -> None:
    for i, name in enumerate(value):
        if name in value[:i]:
            raise ConfigError(f"{src}: `{where}` names {name!r} twice. Name each tracker once.")


@dataclass
class PipelineSection:
    # offline: extract writes every sample's hidden states, train reads them.
    # online: no extract pass; train asks vLLM server(s) on [gpus] extract for
    # the hidden states of each sample as it needs them (no multi-TB disk).
    # hybrid: no extract pass either; train reads what an earlier extract left
    # on disk and asks the servers for the rest (an extraction that ran out of
    # disk or time, continued without redoing it).
    mode: Literal["offline", "online", "hybrid"] = "offline"


@dataclass
class RunSection:
    name: str = "run"
    runs_dir: str = opt("runs", not_blank('name the folder the runs go in, e.g. "runs"'))
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # not a config key: the snapshot a run froze when it was launched
    # (state.json `target`), given to the run's config when it is loaded
    pinned: typing.ClassVar[dict | None] = None


@dataclass
class DataSection:
    path: str = opt(BUILTIN_DATA, not_blank('name a dataset (JSONL or a datasets folder), or '
                                            '"builtin:conversations"'))
    format: Literal["auto", "messages", "sharegpt", "tokenized"] = "auto"
    max_samples: int = 0


@dataclass
class GpusSection:
    devices: list[int] = opt([])
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
    env: dict[str, str] = opt({})
    # (0: no wait before the next signal)
    cancel_grace_s: float = 30.0
    term_grace_s: float = 10.0


@dataclass
class ClusterSection:
    # local: stages are processes on this machine. slurm: each stage is a
    # Slurm job (sbatch) with its supervisor inside; the run directory must
    # be on a filesystem every node sees; [gpus] numbers a node's GPUs.
    scheduler: Literal[SCHEDULERS] = "local"
    partition: str = ""
    account: str = ""
    # for extract (data parallel over nodes) and train (torchrun)
    nodes: int = opt(1, POSITIVE)
    # the fewest nodes a multi-node job may start on (0 = exactly `nodes`): below `nodes`,
    # a job asks for as many as are up (an exact count), so a resume after a lost node
    # runs on the nodes left
    min_nodes: int = 0
    # a node worker silent this long is lost: its samples are redone
    lost_after_s: float = opt(120.0, POSITIVE)
    # train over nodes: torchrun's agents wait this long for every node to join, and a
    # rank this long on one collective (a peer's node lost) ends the training, failed
    rendezvous_timeout_s: float = opt(600.0, POSITIVE)
    collective_timeout_s: float = opt(1800.0, POSITIVE)
    gpus_per_node: int = 0      # --gpus-per-node for the GPU stages (0: none asked)
    time_limit: str = ""        # --time, e.g. "24:00:00" ("" = the partition's default)
    sbatch_args: list[str] = opt([])   # any other sbatch flags


@dataclass
class TrackingSection:
    # speculators' metric loggers for train, and evaluate's measured acceptance
    # in the same run (pipeline.tracking): any of "tensorboard", "mlflow",
    # "wandb", "trackio"; local, under <run>/tracking/, unless the stage's
    # environment names a server (MLFLOW_TRACKING_URI, WANDB_MODE).
    loggers: list[Literal[TRACKER_NAMES]] = opt([], _each_tracker_once)


@dataclass
class StageCommon:
    # The module run as `python -m ENTRY`: the real stage by default; tests
    # and users can substitute their own.
    entry: str = ""
    env: dict[str, str] = opt({})


@dataclass
class ServerCommon(StageCommon):
    """What a stage that starts its own vLLM server takes (regenerate,
    extract's vLLM backends and online train, evaluate)."""
    serve_command: str = ""
    server_args: list[str] = opt([])
    # server_args may not set what eagle-panel owns (--host, --port,
    # --api-key, --uds) unless this is true: then doctor warns about it.
    # It decides no output: a run's fingerprints stay.
    override_server_flags: bool = opt(False, fingerprint=UNLESS_DEFAULT)
    startup_timeout_s: float = opt(1200.0, NOT_ZERO)
    # a starting server with no new log line and no GPU memory change for
    # this long is called stalled (the panel, status and run --wait say so)
    stall_after_s: float = opt(300.0, POSITIVE)
    request_timeout_s: float = opt(600.0, NOT_ZERO)


@dataclass
class RegenerateSection(ServerCommon):
    # Off by default for your data: the target answering its own prompts is
    # what a draft should learn, but it costs a full generation pass.
    enabled: bool = False
    max_tokens: int = opt(256, POSITIVE)       # per assistant turn
    temperature: float = 0.0    # 0 = greedy
    seed: int = 0
    concurrency: int = opt(8, POSITIVE)        # conversations in flight
    # conversations saved together: what a kill can cost (one chunk's answers);
    # how the work is saved, not what: each size keeps its chunks in a folder
    # of its own (pipeline.stages.regenerate.split_chunks)
    chunk_size: int = opt(50, POSITIVE, fingerprint=NEVER)
    # one vLLM server for regenerate and extract (extract's, which captures hidden
    # states): one target load fewer, generation slower on it (1.4-1.5x measured on
    # the CPU build): pipeline.extract.shared_server. How, not what: the same
    # answers at temperature 0 (sampled ones equally the target's)
    share_server: bool = opt(False, fingerprint=NEVER)


@dataclass
class PrepareSection(StageCommon):
    seq_length: int = opt(512, POSITIVE)
    render_endpoint: str = opt("", rule(
        _http_url, "= {value!r} is not an http(s) URL. Give a running vLLM server's base "
        'URL, e.g. "http://127.0.0.1:8000", or "" to render with the local tokenizer.'))
    render_timeout_s: float = opt(30.0, NOT_ZERO)


@dataclass
class ExtractSection(ServerCommon):
    backend: Literal["auto", "hf", "vllm-server", "vllm-engine"] = "hf"
    layer_ids: list[int] = opt([])
    # auto: the dtype the target runs in (bf16 on GPUs, fp32 on the CPU); fp8:
    # float8_e4m3fn with a scale per token, speculators' layout: half of bf16
    hidden_states_dtype: Literal["auto", "fp8"] = "auto"
    batch_tokens: int = opt(8192, POSITIVE)
    min_free_gb: float = 2.0
    workers: int = opt(0, rule(lambda v: v <= MAX_WORKERS, "= {value} is past any machine's "
                               f"processes (at most {MAX_WORKERS}). Set it to the extractor "
                               "processes wanted, or 0 for one per GPU."))
    # vLLM backends: one server / engine per group of tensor_parallel GPUs
    tensor_parallel: int = opt(1, POSITIVE)
    # vllm-server backend (and the server keys: ServerCommon)
    max_inflight: int = opt(16, POSITIVE)
    # vllm-engine backend
    gpu_memory_utilization: float = opt(0.9, rule(lambda v: 0 < v <= 1,
                                                  "must be in (0, 1], got {value}."))
    max_num_seqs: int = opt(32, POSITIVE)


@dataclass
class VocabSection(StageCommon):
    draft_vocab_size: int = opt(32000, POSITIVE)


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
    lr: float = opt(1e-4, NOT_ZERO)
    # speculators' learning-rate schedule (--scheduler-type): "auto" = its own
    # default (linear decay after a warmup in 0.9)
    lr_schedule: Literal["auto", "linear", "cosine", "none"] = opt(
        "auto", fingerprint=UNLESS_DEFAULT)
    # the draft's decoder layers: 0 = speculators' own for the algorithm (1 for the
    # EAGLE-3 family and P-EAGLE, 5 for the DFlash family)
    num_layers: int = 0
    total_seq_len: int = 0
    target_steps: int = opt(2400, POSITIVE)
    min_steps: int = 300
    max_epochs: int = opt(20, POSITIVE)
    patience: int = 2
    min_delta: float = 0.005
    ttt_steps: int = opt(3, POSITIVE)
    # below 1: at 1 no sample is left for validation, so no estimate, no plateau stop
    train_ratio: float = opt(0.9, rule(
        lambda v: 0 < v < 1, "must be in (0, 1), got {value}: at 1 no sample is left for "
        "validation, so train has no estimate and no plateau stop. Set it below 1, e.g. 0.9."))
    checkpoint_freq: float = opt(1.0, NOT_ZERO)
    max_steps: int = 0
    # online mode: requests in flight per server, and how often a vLLM
    # server that dies mid-training is restarted before the stage fails
    online_max_inflight: int = opt(16, NOT_ZERO)
    server_restarts: int = 2
    # online and hybrid: keep the hidden states the servers generate, up to this
    # many GB, beside extract's files, so later epochs read them from disk
    # (0: speculators' way, each deleted once loaded; min_free_gb applies too)
    keep_generated_gb: float = 0.0
    # speculators' dataloader processes: -1 = auto (4 on GPUs; on the CPU 0,
    # and 2 online so that requests to vLLM overlap)
    dataloader_workers: int = opt(-1, floor=-1)
    loss: Literal["auto", "eager", "fused"] = "auto"
    attention: Literal["auto", "sdpa", "eager", "flex"] = "auto"
    # the draft's decoder layer: "auto" = MLA for an MLA target where the vLLM in
    # use needs it (its CPU build), else speculators' Llama layer
    draft_layer: Literal["auto", "llama", "mla"] = "auto"
    # the draft algorithm (pipeline.train.algorithms): "eagle3", "eagle3.1", "peagle",
    # "dflash", "dspark", "dflash2"; block_size: a block drafter's block (DFlash, DSpark,
    # DFlash2; 0 = speculators' default, 16 / 8 / 8). (Checked with what they combine
    # with: _check_algorithm; left out of the fingerprint together at eagle3 and 0.)
    algorithm: str = "eagle3"
    block_size: int = 0
    # speculators' --loss-fn as weights of its losses ({ kl_div = 1.0 }; { ce = 0.1,
    # tv = 0.9 }); empty = the algorithm's own (kl_div; ce for DFlash)
    loss_weights: dict[str, float] = opt({}, fingerprint=UNLESS_DEFAULT)
    # the per-position loss weight: EAGLE-3's TTT-step decay (step k weighs decay^k),
    # the DFlash family's decay gamma (position p weighs exp(-(p-1)/gamma)); 0 = speculators'
    position_decay: float = opt(0.0, fingerprint=UNLESS_DEFAULT)
    # training processes per node: 0 = one per GPU the stage is given (one on a
    # CPU-only node); on a CPU-only node more train data parallel over gloo
    ranks_per_node: int = opt(0, fingerprint=UNLESS_DEFAULT)
    seed: int = 0
    log_freq: int = opt(1, POSITIVE)


@dataclass
class EvaluateSection(ServerCommon):
    enabled: bool = True
    # chosen (train's: the draft its summary names) | last | best | all | best-K (K: a count)
    checkpoints: str = opt("chosen", _checkpoints_choice)
    num_speculative_tokens: int = opt(3, POSITIVE)
    prompts: str = ""           # "" = the validation split's prompts; or a JSONL file
    max_prompts: int = opt(64, POSITIVE)
    max_tokens: int = opt(64, POSITIVE)
    temperature: float = 0.0    # 0 = greedy; > 0 samples (seeded)
    seed: int = 0
    # requests in flight: the decode speed is measured at this load
    concurrency: int = opt(1, POSITIVE)
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
        """The stage's keys as they decide its output (each field says
        whether it does: pipeline.config_fields.fingerprinted), with the
        rules that involve two keys."""
        d = fingerprinted(self.stage(name))
        if name == "train":
            from pipeline.train.algorithms import num_layers
            # what decides the draft, not how it is spelled: 0 is the algorithm's own count
            d["num_layers"] = num_layers(self.stages.train)
            if d.get("algorithm") == "eagle3" and not d.get("block_size"):
                del d["algorithm"], d["block_size"]   # their defaults: runs made before them stay
            if d.get("epochs") and d.get("total_seq_len"):
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
# (each key's own type and rules: pipeline.config_fields.fill, from its field)

def server_sections(cfg: Config) -> list[str]:
    """The stages that take the server keys (ServerCommon)."""
    return [f.name for f in dataclasses.fields(cfg.stages)
            if isinstance(getattr(cfg.stages, f.name), ServerCommon)]


def _semantic_checks(cfg: Config, src: str):
    """What one field cannot say: the run's name, keys that must agree,
    paths, GPU lists."""
    name = cfg.run.name
    # (the same rule as a --run id's: pipeline.run.rundir.check_run_id)
    if not name or "/" in name or "\\" in name or name.startswith(".") or \
            any(ord(c) < 32 for c in name) or len(name.encode(errors="surrogateescape")) > 255:
        raise ConfigError(f"{src}: `run.name` = {name!r} must be a plain folder name (no "
                          "slashes, not starting with a dot, at most 255 bytes). Fix `run.name`.")
    _check_cluster(cfg, src)
    _check_algorithm(cfg, src)
    _check_meanings(cfg, src)
    _check_server_args(cfg, src)
    _check_paths(cfg, src)
    _check_gpus(cfg, src)


def _check_cluster(cfg: Config, src: str) -> None:
    """Node counts against the scheduler and the mode."""
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
    choice(train.algorithm, tuple(ALGORITHMS), where, src)
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




def _check_meanings(cfg: Config, src: str) -> None:
    """Numbers that must agree with each other."""
    st = cfg.stages
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
    for name in server_sections(cfg):
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
    for name in server_sections(cfg):
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


def _check_gpus(cfg: Config, src: str) -> None:
    """GPU ids: no repeats, stage subsets of [gpus] devices, divisible by
    tensor_parallel. (Whether this machine has them is doctor's launch
    check, pipeline.doctor.target.check_gpus: parsing a config never asks
    NVML.)"""
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


def parse(text: str, src: str = "config.toml", base_dir: Path | None = None) -> Config:
    if not text.strip():
        raise ConfigError(f"{src}: the config is empty. Copy the bundled config.toml and "
                          "change what your run needs.")
    if "\x00" in text:
        raise ConfigError(f"{src}: not a text file (it holds NUL bytes). Give a TOML config.")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{src}: not valid TOML: {e}. Fix the syntax at that line.") from None
    cfg = fill(Config, table, "", src, skip=("source", "base_dir"))
    cfg.base_dir = (base_dir or PROJECT_ROOT).resolve()
    _semantic_checks(cfg, src)
    return cfg


def load(path: str | os.PathLike, base_dir: Path | None = None) -> Config:
    """Load a config file; `base_dir` overrides the folder relative paths are
    resolved from (a run's frozen copy keeps its original folder's meaning).
    Whether this machine has the GPUs named is doctor's launch check."""
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
    cfg = parse(text, str(p), base_dir or p.resolve().parent)
    cfg.source = p.resolve()
    return cfg


def default_config_path() -> Path:
    here = Path.cwd() / "config.toml"
    return here if here.exists() else PROJECT_ROOT / "config.toml"
