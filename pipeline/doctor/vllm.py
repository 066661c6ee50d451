"""doctor's checks of what vLLM will do with this run, read from the
installed vLLM's source (never imported): the compatibility adaptations
that will fire, the strings eagle-panel passes or reads, what `vllm serve`
needs for the target, the CPU build's attention kernels, how long this
run's servers took to start, and server_args that override eagle-panel's
own server settings."""

from __future__ import annotations

from pipeline.config import Config
from pipeline.doctor.findings import BLOCK, GIB, OK, WARN, Finding, check
from pipeline.doctor.inputs import Inputs, model_refused, serves_target, serves_vllm
from pipeline.model.info import ModelInfo
from pipeline.run.rundir import RunDir
from pipeline.vllm import compat, contract, contract_strings
from pipeline.vllm.environment import VllmEnv
from pipeline.vllm.target_flags import has_cpu_mla


@check(120)
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


@check(130)
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


@check(140)
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


@check(145)
def check_cpu_int4_dtype(x: Inputs) -> list[Finding]:
    """An INT4 target's Linear layers on vLLM's CPU build run through its
    `cpu_gemm_wna16`, which has no float32 kernel: in float32 the server
    starts and fails at its first forward ("cpu_gemm_wna16" not implemented
    for 'Float'), which vLLM's validation on the meta device cannot see. A
    rule from what a float32 server did here (docs/FACTS.md, 2026-12-06);
    tests/vllm/test_int4_target.py runs the bfloat16 route it asks for."""
    v, m = x.vllm, x.model
    if v is None or not v.cpu_build or m is None or not m.packed_linears or \
            not serves_vllm(x) or x.cfg.dtype_name(False) != "float32" or \
            model_refused(x.cfg, v, m):
        return []
    more = f" and {len(m.packed_linears) - 1} more" if len(m.packed_linears) > 1 else ""
    return [Finding("vllm", BLOCK, f"vLLM {v.version}'s CPU build runs this target's INT4 "
                    f"Linear layers ({m.packed_linears[0]}{more}) through its cpu_gemm_wna16 "
                    "kernel, which has no float32 kernel: its servers would start and fail at "
                    "the first forward (\"cpu_gemm_wna16\" not implemented for 'Float')",
                    '[model] dtype = "bfloat16"')]


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


@check(150)
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


@check(210, launch=60)
def check_server_overrides(x: Inputs) -> list[Finding]:
    """server_args that take over what eagle-panel owns, set on purpose."""
    from pipeline.config import overridden_server_flags
    return [Finding("privacy", WARN, f"{what} overrides eagle-panel's own server setting "
                    "(loopback only, a free port, a random API key, no development endpoints)",
                    "remove it and override_server_flags unless the server must be reached "
                    "that way") for what in overridden_server_flags(x.cfg)]
