"""`eagle-panel doctor`: everything that can be checked before a launch.

A list of small checks (`checks()`), each a function of what was gathered
once (`Inputs`) returning findings: the stages' environment and vLLM's
(reported separately: they may be two interpreters), the extract backend
they allow and what `auto` picks, GPUs present against configured, the
target's config (read from config.json, no code run), layer ids, EAGLE-3
support of the architecture in the installed vLLM (read from its source,
never imported), the compatibility adaptations that will fire, a KV-cache
plan (per GPU, or the CPU build's KV space) and the hidden-state disk
forecast; and vLLM itself, in its own interpreter, asked about each server
the run will start (cached). Each finding is ok / warning / blocking, with the fix; a vLLM
that cannot be read is a finding too, never a traceback.

One module per area, each check registered where it is defined, with its
position in doctor's output (and in the launch checks', for those):
findings.py (levels, `Finding`, the registry, the renderings), inputs.py
(`Inputs` and what gathers them), environment.py (interpreters, speculators,
trackers, extract backends), data.py ([data] path), target.py (GPUs, the
target's shapes, EAGLE-3 and draft support), vllm.py (what vLLM will do, read
from its source: adaptations, flags, CPU attention, starts), validation.py
(vLLM asked: each planned server through `vllm serve` to its engine config
and model), plans.py (target loads, KV cache, disk), rundir.py (the run
directory: versions, privacy, survivors) and cluster.py (Slurm). This
package imports every area module, so that all checks are registered
before `diagnose` or `launch_findings` runs; it keeps the API its callers
use (`from pipeline import doctor`).
"""

from __future__ import annotations

from pipeline.config import Config

# The area modules: imported for their checks' registration (the positions,
# not this order, order doctor's output).
from pipeline.doctor import (  # noqa: F401
    cluster,
    data,
    environment,
    plans,
    rundir,
    target,
    validation,
    vllm,
)
from pipeline.doctor.environment import (
    check_environment,
    check_speculators,
    check_vllm_environment,
)
from pipeline.doctor.findings import (
    BLOCK,
    OK,
    WARN,
    Finding,
    as_json,
    as_text,
    blocking,
    checks,
    launch_checks,
)
from pipeline.doctor.inputs import Inputs, gather, nvml_gpus, target_info, vllm_env_from
from pipeline.doctor.plans import check_target_loads, disk_forecast, kv_plan
from pipeline.doctor.rundir import check_privacy, check_versions
from pipeline.doctor.target import check_draft_method, tp_sizes
from pipeline.doctor.vllm import string_mismatches
from pipeline.run.plans import Plans
from pipeline.vllm import compat
from pipeline.vllm.environment import VllmEnv

__all__ = [
    "BLOCK", "OK", "WARN", "Finding", "Inputs", "as_json", "as_text", "blocking",
    "check_draft_method", "check_environment", "check_privacy", "check_speculators",
    "check_target_loads",
    "check_versions", "check_vllm_environment", "checks", "diagnose", "disk_forecast", "examine",
    "gather", "kv_plan", "launch_checks", "launch_findings", "nvml_gpus", "string_mismatches",
    "target_info", "tp_sizes", "vllm_env_from",
]


def launch_findings(cfg: Config) -> list[Finding]:
    """The launch checks' findings for a config (doctor's own lines)."""
    x = Inputs(cfg, env={}, vllm=None, gpus=nvml_gpus() if cfg.gpus.devices else None)
    try:
        x.model = target_info(cfg)
    except (OSError, ValueError, KeyError) as e:
        x.extra["model_error"] = str(e)
    findings: list[Finding] = []
    for check in launch_checks():
        findings += check(x)
    return findings


def diagnose(cfg: Config, env: dict | None = None, gpus: list[dict] | None | bool = False,
             vllm_source=None, vllm_env: VllmEnv | None | bool = False) -> list[Finding]:
    """All findings for a config. `env`, `gpus`, `vllm_source` and
    `vllm_env` default to probing this machine."""
    return examine(cfg, env, gpus, vllm_source, vllm_env)[0]


def examine(cfg: Config, env: dict | None = None, gpus: list[dict] | None | bool = False,
            vllm_source=None, vllm_env: VllmEnv | None | bool = False
            ) -> tuple[list[Finding], Plans]:
    """All findings for a config, and the plans the checks made (typed:
    pipeline.run.plans), for `doctor --json`."""
    try:
        x = gather(cfg, env, gpus, vllm_source, vllm_env)
    except compat.CompatError as e:
        return [Finding("compat", BLOCK, f"eagle-panel cannot read the installed vLLM: {e}",
                        "report this vLLM version; use the hf backend meanwhile")], Plans()
    findings: list[Finding] = []
    for check in checks():
        try:
            findings += check(x)
        except compat.CompatError as e:
            findings.append(Finding("compat", WARN, f"{check.__name__}: the installed vLLM "
                                    f"differs from what eagle-panel knows: {e}",
                                    "report this vLLM version; the hf backend is unaffected"))
    return findings, Plans(**x.plans)
