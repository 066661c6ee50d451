"""What doctor's checks look at, gathered once (`Inputs`, `gather`): the
stages' environment (probed in a subprocess), vLLM's, NVML's GPUs, the
installed vLLM's source and the target's config — plus the questions about
them more than one area asks (does the run serve the target with vLLM?).
The launch checks' `target_info` is here too: it reads the target without
building or downloading it."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import Config
from pipeline.model.info import ModelInfo, model_info, read_model
from pipeline.paths import PROJECT_ROOT
from pipeline.vllm.environment import VllmEnv, choose_backend
from pipeline.vllm.environment import probe as probe_vllm


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
    plans: dict = field(default_factory=dict)   # what the plan checks made: "kv", "disk", "loads"

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


def model_refused(cfg: Config, env: VllmEnv | None, model: ModelInfo | None) -> str | None:
    """vLLM's words where an earlier doctor found it cannot build this target
    here (pipeline.vllm.validation.record_model), else None."""
    if env is None or model is None:
        return None
    from pipeline.vllm import validation
    return validation.model_refused(env.python, cfg.target_path(), env.vllm_dir)


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


def serves_vllm(x: Inputs) -> bool:
    """Whether any stage of the run starts a vLLM server or engine."""
    return x.uses_vllm or any(x.cfg.enabled(s) for s in ("regenerate", "evaluate"))


def serves_target(x: Inputs) -> bool:
    """Whether any stage starts `vllm serve` (the engine route does not)."""
    return x.backend == "vllm-server" or x.cfg.online or \
        any(x.cfg.enabled(s) for s in ("regenerate", "evaluate"))


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
                                                  cfg.dtype_name(bool(devices)),
                                                  model_refused(cfg, vllm_env, x.model))
    else:
        x.backend = sec.backend
    return x
