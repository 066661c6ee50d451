"""`eagle-panel doctor`: everything that can be checked before a launch.

Versions in the stage environment and the backends they allow, GPUs present
against configured, the target's config (read from config.json, no code
run), layer ids, EAGLE-3 support of the architecture in the installed vLLM
(read from its source, never imported), the compatibility adaptations that
will fire, a KV-cache memory plan per GPU and the hidden-state disk
forecast. Each finding is ok / warning / blocking, with the fix.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import vllm_compat
from pipeline.config import Config
from pipeline.rundir import RunDir

OK, WARN, BLOCK = "ok", "warning", "blocking"
GIB = 1 << 30
DEFAULT_GPU_UTIL = 0.9  # vLLM's --gpu-memory-utilization default


@dataclass
class Finding:
    area: str
    level: str
    message: str
    fix: str = ""


@dataclass
class ModelInfo:
    architecture: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    dtype: str
    wrapped: bool            # decoder settings under text_config (multimodal wrapper)
    needs_remote_code: bool  # auto_map in config or tokenizer config
    weights_bytes: int | None

    @property
    def mla(self) -> bool:
        return bool(self.kv_lora_rank)


def read_model(folder: Path) -> ModelInfo:
    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config") or raw
    heads = int(text.get("num_attention_heads") or 1)
    hidden = int(text["hidden_size"])
    tok_cfg = folder / "tokenizer_config.json"
    tok_auto = tok_cfg.exists() and "auto_map" in json.loads(tok_cfg.read_text() or "{}")
    weights = None
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weights = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    if weights is None:
        files = list(folder.glob("*.safetensors"))
        weights = sum(f.stat().st_size for f in files) if files else None
    return ModelInfo(
        architecture=(raw.get("architectures") or ["?"])[0],
        model_type=str(text.get("model_type") or raw.get("model_type") or "?"),
        layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        kv_lora_rank=text.get("kv_lora_rank"), qk_rope_head_dim=text.get("qk_rope_head_dim"),
        dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                  or "bfloat16"),
        wrapped="text_config" in raw, needs_remote_code="auto_map" in raw or tok_auto,
        weights_bytes=int(weights) if weights else None)


def kv_bytes_per_token(m: ModelInfo, tp: int = 1, elem: int = 2) -> int:
    """KV-cache bytes one token takes on one GPU of a tensor-parallel group.
    MLA (DeepSeek-V3, Kimi-K2): the compressed latent plus the rope key,
    kv_lora_rank + qk_rope_head_dim per layer, replicated on every rank.
    GQA/MHA: K and V of the KV heads, split over the ranks (at least one head each)."""
    if m.mla:
        return m.layers * (int(m.kv_lora_rank) + int(m.qk_rope_head_dim or 0)) * elem
    return 2 * m.layers * max(1, m.kv_heads // tp) * m.head_dim * elem


def hs_bytes_per_token(m: ModelInfo, n_layers: int, elem: int) -> int:
    """One token of extracted hidden states: n_layers x hidden, plus its int64 id."""
    return n_layers * m.hidden * elem + 8


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
                       timeout=timeout, cwd=str(Path(__file__).resolve().parent.parent),
                       check=False)
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


def _server_util(cfg: Config) -> float:
    args = list(cfg.stages.extract.server_args)
    for i, a in enumerate(args):
        if a.startswith("--gpu-memory-utilization"):
            val = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return float(val)
            except ValueError:
                pass
    return DEFAULT_GPU_UTIL


def diagnose(cfg: Config, env: dict | None = None, gpus: list[dict] | None | bool = False,
             vllm_source=None) -> list[Finding]:
    """All findings for a config. `env`, `gpus` and `vllm_source` default to
    probing this machine (tests pass their own)."""
    from pipeline.stages.extract_hf import validate_layer_ids
    f: list[Finding] = []
    sec = cfg.stages.extract
    backend = sec.backend
    uses_vllm = backend.startswith("vllm")
    env = env if env is not None else probe_env(cfg.python())
    pk = env.get("packages", {})

    # -- environment and backends
    if "error" in env:
        f.append(Finding("environment", BLOCK, f"the stage interpreter {cfg.python()} failed "
                         f"to report its packages: {env['error']}",
                         "fix [runtime] python or that environment"))
        pk = {}
    else:
        cuda = env.get("torch_cuda")
        f.append(Finding("environment", OK, f"python {env.get('python')} ({env.get('executable')}); "
                         f"torch {pk.get('torch')}{f' + CUDA {cuda}' if cuda else ' (CPU build)'}, "
                         f"transformers {pk.get('transformers')}, speculators "
                         f"{pk.get('speculators')}, vllm {pk.get('vllm') or 'not installed'}"))
    if env.get("torch_error"):
        f.append(Finding("environment", BLOCK, f"torch fails to import in the stage "
                         f"environment: {env['torch_error']}",
                         "repair that environment's torch (or point [runtime] python elsewhere)"))
    for name, why in (("torch", "every stage"), ("transformers", "prepare and the hf backend"),
                      ("speculators", "vocab and train")):
        if pk and not pk.get(name):
            f.append(Finding("environment", BLOCK, f"{name} is not installed in the stage "
                             f"environment; {why} need it",
                             "run scripts/install.sh, or point [runtime] python at an "
                             "environment that has it"))
    vver = pk.get("vllm")
    usable = ["hf"] if pk.get("torch") and pk.get("transformers") else []
    if vver and vllm_compat.version_at_least(vver, vllm_compat.ENGINE_RANGE[0]):
        usable.append("vllm-engine")
    if vver and vllm_compat.version_at_least(vver, vllm_compat.SERVER_ROUTE_SINCE):
        usable.append("vllm-server")
    if pk:
        f.append(Finding("backends", OK, "usable extract backends: " + (", ".join(usable) or
                                                                         "none")))
    if uses_vllm and pk and not vver:
        f.append(Finding("backends", BLOCK, f"[stages.extract] backend = {backend!r} but vLLM "
                         "is not installed in the stage environment",
                         'install vLLM there, or set backend = "hf"'))
    if backend == "vllm-engine" and vver:
        lo, hi = vllm_compat.ENGINE_RANGE
        if not vllm_compat.version_at_least(vver, lo):
            f.append(Finding("backends", BLOCK, f"vLLM {vver} is older than the vllm-engine "
                             f"backend supports ({lo})", f"upgrade vLLM to >= {lo}"))
        elif vllm_compat.version_at_least(vver, hi):
            f.append(Finding("backends", WARN, f"vLLM {vver} is newer than the releases the "
                             "vllm-engine backend was checked against (0.11-0.16); its "
                             "internals may have moved",
                             f'prefer backend = "vllm-server" (vLLM >= '
                             f'{vllm_compat.SERVER_ROUTE_SINCE}), the official route'))
    if backend == "vllm-server" and vver and "vllm-server" not in usable:
        f.append(Finding("backends", BLOCK, f"vLLM {vver} has no extract_hidden_states / "
                         f"ExampleHiddenStatesConnector (added in {vllm_compat.SERVER_ROUTE_SINCE})",
                         f"upgrade vLLM to >= {vllm_compat.SERVER_ROUTE_SINCE}"))

    # -- GPUs
    if gpus is False:
        gpus = nvml_gpus()
    configured = cfg.gpus.devices
    if gpus is None:
        level = BLOCK if configured or uses_vllm else OK
        f.append(Finding("gpus", level, "no NVIDIA driver / GPU found"
                         + (f", but [gpus] devices = {configured}" if configured else "")
                         + ("; vLLM needs GPUs" if uses_vllm else "; stages run on the CPU"),
                         "run on the GPU server, or set [gpus] devices = [] and backend = \"hf\""
                         if level == BLOCK else ""))
        gpus = []
    else:
        names = sorted({g["name"] for g in gpus})
        f.append(Finding("gpus", OK, f"{len(gpus)} GPU(s): {', '.join(names)}; configured "
                         f"{configured or 'none (CPU)'}"))
        missing = [d for d in configured if d >= len(gpus)]
        if missing:
            f.append(Finding("gpus", BLOCK, f"[gpus] devices names GPU {missing} but this "
                             f"machine has {len(gpus)}", "fix [gpus] devices"))
        if uses_vllm and not configured:
            f.append(Finding("gpus", BLOCK, "vLLM backends need GPUs: [gpus] devices is empty",
                             "list the GPUs in [gpus] devices"))

    # -- the target model
    try:
        m = read_model(cfg.target_path())
    except (OSError, ValueError, KeyError) as e:
        f.append(Finding("model", BLOCK, f"cannot read the target's config.json: {e}",
                         "point [model] target at a local HF model folder"))
        return f
    kind = "MLA" if m.mla else ("GQA" if m.kv_heads < m.heads else "MHA")
    f.append(Finding("model", OK, f"{m.architecture} ({m.model_type}): {m.layers} layers, hidden "
                     f"{m.hidden}, {m.heads} heads / {m.kv_heads} KV heads, {kind} attention, "
                     f"{m.dtype}" + (", decoder under text_config (multimodal wrapper)"
                                     if m.wrapped else "")
                     + (f", weights {_size(m.weights_bytes)}" if m.weights_bytes else "")))
    if m.needs_remote_code and not cfg.model.trust_remote_code:
        f.append(Finding("model", BLOCK, "the target's config or tokenizer has auto_map (custom "
                         "code) and [model] trust_remote_code = false",
                         "set [model] trust_remote_code = true if you trust this model's code"))
    elif m.needs_remote_code:
        f.append(Finding("model", OK, "custom code (auto_map): trust_remote_code is on and is "
                         "passed to every tokenizer/config load and to vLLM"))
    try:
        layer_ids = validate_layer_ids(list(sec.layer_ids), m.layers)
        f.append(Finding("layers", OK, f"aux layer ids {layer_ids[:-1]} + last {layer_ids[-1]} "
                         f"(vLLM convention) are valid for {m.layers} layers"))
    except ValueError as e:
        f.append(Finding("layers", BLOCK, f"[stages.extract] layer_ids: {e}",
                         f"use ids in 0..{m.layers - 1}, e.g. [2, {m.layers // 2}, {m.layers - 3}]"))
        layer_ids = None

    # -- vLLM: EAGLE-3 support and adaptations (read from its source)
    if uses_vllm and (vllm_source is not None or env.get("vllm_dir")):
        from pipeline.vllm_source import VllmSource
        src = vllm_source or VllmSource.from_dir(Path(env["vllm_dir"]), vver or "?")
        e3 = vllm_compat.eagle3_support(src, m.architecture)
        f.append(Finding("eagle3", BLOCK if e3.fires else OK, e3.detail,
                         "upgrade vLLM, or use the hf backend" if e3.fires else ""))
        route = backend.removeprefix("vllm-")
        for a in vllm_compat.plan(src):
            if not a.fires or a.route != route or a.key == "server_route":
                continue  # another backend's, or (server_route) said under backends
            if a.key == "kv_config_missing":
                f.append(Finding("compat", BLOCK, a.detail, "upgrade vLLM"))
            else:
                f.append(Finding("compat", OK, f"adapts: {a.detail}"))

    # -- KV-cache plan per GPU (vLLM backends)
    if uses_vllm:
        tp = max(1, sec.tensor_parallel)
        util = (sec.gpu_memory_utilization if backend == "vllm-engine" else _server_util(cfg))
        f.extend(kv_plan(m, tp, gpus, cfg, util))

    # -- disk forecast for the hidden states
    if layer_ids is not None:
        f.append(disk_forecast(cfg, m, len(layer_ids), uses_vllm or bool(configured)))
    return f


def kv_plan(m: ModelInfo, tp: int, gpus: list[dict], cfg: Config, util: float) -> list[Finding]:
    per_tok = kv_bytes_per_token(m, tp)
    max_len = cfg.stages.prepare.seq_length + 8
    kind = ("MLA: layers x (kv_lora_rank + qk_rope_head_dim) x 2 B, replicated per rank"
            if m.mla else "2 (K,V) x layers x KV heads per rank x head_dim x 2 B")
    devices = [g for g in gpus if g["index"] in (cfg.stage_devices("extract") or [])]
    if not devices:
        return [Finding("kv_cache", OK, f"KV cache: {per_tok:,} B/token per GPU at TP={tp} "
                        f"({kind}); no GPU memory to plan against")]
    mem = min(g["memory_total"] for g in devices)
    weights = (m.weights_bytes or 0) / tp
    free = mem * util - weights
    if free <= 0:
        need = math.ceil((m.weights_bytes or 0) / (mem * util))
        return [Finding("kv_cache", BLOCK, f"weights {weights / GIB:.1f} GiB per GPU at TP={tp} "
                        f"exceed {util:.0%} of {mem / GIB:.0f} GiB",
                        f"use [stages.extract] tensor_parallel >= {need}")]
    tokens = int(free // per_tok)
    note = "" if m.weights_bytes else " (weights size unknown: not subtracted)"
    return [Finding("kv_cache", OK if tokens >= max_len else BLOCK,
                    f"KV cache per GPU at TP={tp}: {per_tok:,} B/token ({kind}); "
                    f"{util:.0%} of {mem / GIB:.0f} GiB - weights {weights / GIB:.1f} GiB = "
                    f"{free / GIB:.1f} GiB -> ~{tokens:,} tokens, max concurrency "
                    f"~{tokens / max_len:.1f} at {max_len} tokens{note}",
                    "" if tokens >= max_len else "raise tensor_parallel or lower seq_length")]


def disk_forecast(cfg: Config, m: ModelInfo, n_layers: int, gpu: bool,
                  tokens: int | None = None) -> Finding:
    elem = 4 if cfg.dtype_name(gpu) == "float32" else 2
    bpt = hs_bytes_per_token(m, n_layers, elem)
    exact = tokens is not None
    if tokens is None:
        tokens, exact = _prepared_tokens(cfg)
    runs = cfg.runs_dir()
    probe = runs
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if tokens is None:
        return Finding("disk", OK, f"hidden states: {bpt / 1024:.1f} KiB/token ({n_layers} "
                       f"layers x {m.hidden} x {elem} B); data size unknown, {free / GIB:.0f} "
                       f"GiB free at {probe}")
    need = tokens * bpt
    room = free - cfg.stages.extract.min_free_gb * GIB
    what = "" if exact else "at most "
    msg = (f"hidden states: {bpt / 1024:.1f} KiB/token ({n_layers} layers x {m.hidden} x "
           f"{elem} B) x {what}{tokens:,} tokens = {what}{need / GIB:,.1f} GiB; "
           f"{free / GIB:,.0f} GiB free at {probe}")
    if need > room:
        level = BLOCK if exact else WARN
        return Finding("disk", level, msg, "free space, move [run] runs_dir to a bigger disk, "
                       "or lower [data] max_samples / [stages.prepare] seq_length")
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


def _size(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / (1 << 20):,.1f} MiB"


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
