"""vLLM asked, not only read: each server the run will start, as its stage
would start it, put through `vllm serve`'s own parser and engine config in
the stages' vLLM (pipeline.vllm.validation). A refusal blocks, in vLLM's
words; an answer is cached, and the launch checks read the cache.

The planned servers come from the config the way the stages build theirs:
regenerate's (or the server it shares with extract), extract's capture
servers (and online train's), evaluate's target without a draft; and
evaluate's with the draft, whose folder before training is a config-only
stand-in speculators builds from the train stage's flags
(pipeline/train/draft_stand_in.py), asked in the same vLLM process.
A model vLLM cannot build here (its kernels) is recorded and run around
(planned_around): "auto" extracts on hf, evaluate is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Config
from pipeline.doctor.environment import hf_route_findings
from pipeline.doctor.findings import BLOCK, OK, WARN, Finding, check
from pipeline.doctor.inputs import Inputs, serves_target
from pipeline.model.info import ModelInfo
from pipeline.vllm import validation
from pipeline.vllm.validation import Planned

# extract's servers write here in a run; vLLM's config only carries the path
STORAGE = Path("<run>") / "extract" / "hidden_states"


def _planned(cfg: Config, stage: str, name: str, max_len: int, flags: list[str],
             devices: list[int], env_stage: str | None = None) -> Planned:
    sec = getattr(cfg.stages, env_stage or stage)
    env = {**cfg.runtime.env, **sec.env}
    return Planned(name, tuple(devices), max_len, tuple(flags), cfg.dtype_name(bool(devices)),
                   cfg.model.trust_remote_code, tuple(sorted(env.items())))


def planned_servers(cfg: Config, m: ModelInfo, backend: str,
                    own_connector: bool = True) -> list[Planned]:
    """The servers the run starts, one of each kind (extract's first
    tensor-parallel group stands for the others), as the config gives them."""
    from pipeline.extract import shared_server
    from pipeline.extract.job import gpu_groups
    from pipeline.extract.server_flags import extraction_flags
    from pipeline.model.info import validate_layer_ids
    ex, seq = cfg.stages.extract, cfg.stages.prepare.seq_length
    layers = validate_layer_ids(list(ex.layer_ids), m.layers)
    groups = gpu_groups(cfg.stage_devices("extract"), ex.tensor_parallel) or [[]]
    capture = extraction_flags(layers, STORAGE, own_connector,
                               ex.hidden_states_dtype == "fp8", "linear" in m.kinds)
    capture += list(ex.server_args)
    out = []
    # (as doctor's plan of target loads decides it: plans.planned_loads)
    shared = cfg.enabled("regenerate") and backend.startswith("vllm") and not cfg.online and \
        shared_server.why_not(cfg) is None
    if shared:
        flags, max_len, _ = shared_server.capture_flags(cfg, STORAGE, own_connector)
        out.append(_planned(cfg, "regenerate", "regenerate + extract (one server)", max_len,
                            flags, cfg.stage_devices("extract"), "extract"))
    elif cfg.enabled("regenerate"):
        rg = cfg.stages.regenerate
        out.append(_planned(cfg, "regenerate", "regenerate", shared_server.regenerate_max_len(
            cfg), list(rg.server_args), cfg.stage_devices("regenerate")))
    if cfg.online:
        out.append(_planned(cfg, "train", "train (online)", seq + 8, capture, groups[0],
                            "extract"))
    elif backend == "vllm-server" and not shared:
        out.append(_planned(cfg, "extract", "extract", seq + 8, capture, groups[0]))
    if cfg.enabled("evaluate"):
        ev = cfg.stages.evaluate
        # pipeline.evaluate.load.choose_prompts' rule, at its largest, without the stage
        # context it reads: for prompts from a file or the validation split
        max_len = int(m.max_position or 4096) if ev.prompts else seq + ev.max_tokens + 8
        out.append(_planned(cfg, "evaluate", "evaluate (the target alone)", max_len,
                            list(ev.server_args), cfg.stage_devices("evaluate")))
    return out


def findings(v: validation.Validation, version: str) -> list[Finding]:
    """vLLM's answer as doctor's lines: a block per refusal, one line for the rest."""
    out = [refused(r, version) for r in v.refusals]
    if v.failed:
        out.append(Finding("vllm", WARN, f"vLLM {version}'s own validation did not answer for "
                           f"every server: {v.failed}", "run `eagle-panel doctor` again; the "
                           "checks read from the source above still stand"))
    ok = [r.name for r in v.results if r.ok]
    if ok:
        how = "cached" if v.cached else f"{v.seconds:.0f} s, {v.import_s:.0f} s of it vLLM's import"
        partly = [r.name for r in v.results if r.ok and r.step == "config"]
        unasked = MODEL_NOT_ASKED.format(", ".join(partly)) if partly else ""
        out.append(Finding("vllm", OK, f"vLLM {version} accepts {', '.join(ok)}: each server's "
                           "command line through `vllm serve` to its engine config, and the "
                           "model built from it on the meta device by vLLM's loader (its "
                           f"kernels chosen, at tensor-parallel 1){unasked} ({how})"))
    return out


MODEL_NOT_ASKED = "; the model of {} cannot be built on the meta device, so not asked"


def refused(r: validation.Result, version: str) -> Finding:
    """A refusal, with the fix for the step that refused."""
    if r.step == "model":
        return Finding("vllm", BLOCK, f"vLLM {version} cannot build {r.name}'s model here: "
                       f"{r.error} (its loader built the model on the meta device: the kernels "
                       "it picks for this target on this platform)",
                       "the stage would fail the same way; run it where this vLLM has those "
                       "kernels (a GPU), or: " + "; ".join(
                           fix for stage, fix in ROUTES_AROUND.items() if stage in r.name))
    return Finding("vllm", BLOCK, f"vLLM {version} refuses {r.name}'s server: {r.error}",
                   "change what it names ([stages.*] server_args, [prepare] seq_length, "
                   "[model]); this is vLLM's own check of the exact command line the stage "
                   "would run")


# What runs without that server, by the stage whose server it is
ROUTES_AROUND = {
    "regenerate": "[stages.regenerate] enabled = false (prepare takes the data's own answers)",
    "extract": '[stages.extract] backend = "hf" (transformers reads the weights, dequantized)',
    "train (online)": '[pipeline] mode = "offline" with backend = "hf"',
    "evaluate": "[stages.evaluate] enabled = false (the run ends at train's estimate)",
}


def target_folder(cfg: Config) -> Path | None:
    """The target's folder without building or downloading it (a launch
    must not wait for either): a built-in's cache folder, built or not; None
    for a hub target still to be downloaded."""
    from pipeline import builtin
    from pipeline.model import hub
    if cfg.model.target in builtin.TARGETS:
        return builtin.target(cfg.model.target).cache_dir()
    return None if hub.download_pending(cfg) else cfg.target_path()


def _key(x: Inputs, backend: str) -> tuple[str | None, list[Planned]]:
    """The cache key of the servers this config plans with `backend`, and the
    servers as this vLLM would be asked about them (None, [] where there is no
    target folder yet, or the layer ids are wrong: check_layers says so). The
    key takes them with eagle-panel's own connector, whatever this vLLM has:
    the launch, which reads no source, computes the same key."""
    from pipeline.vllm import compat
    folder = target_folder(x.cfg)
    if folder is None or not (folder / "config.json").exists():
        return None, []
    own = x.source is None or not compat.own_connector_missing(x.source)
    try:
        keyed = planned_servers(x.cfg, x.model, backend)
        servers = keyed if own else planned_servers(x.cfg, x.model, backend, own)
    except ValueError:
        return None, []
    env = x.vllm
    python, vllm_dir = (env.python, env.vllm_dir) if env else (x.cfg.vllm_python(), None)
    return (validation.cache_key(python, folder, keyed, vllm_dir) if keyed else None), servers


@check(135)
def check_vllm_accepts(x: Inputs) -> list[Finding]:
    """Every planned server through vLLM's own validation (cached)."""
    env = x.vllm
    if env is None or not serves_target(x) or x.model is None or \
            not validation.installed_vllm(env.python, env.vllm_dir):
        return []   # no vLLM installed that can be named (nothing to ask)
    why = env.unusable(x.cfg.stage_devices("extract") or x.cfg.stage_devices("evaluate"))
    if why:
        return [Finding("vllm", OK, f"vLLM's own validation not run here: {why.split(':')[0]}; "
                        "the checks read from its source stand")]
    if x.source is not None:
        from pipeline.vllm import contract
        broken = contract.check(x.source, "validate")
        if broken:
            return [Finding("vllm", WARN, f"vLLM's own validation cannot run on {env.version}: "
                            f"{broken[0]}", "report this vLLM version; the checks read from "
                            "its source stand")]
    key, servers = _key(x, x.backend)
    if not servers:
        return []
    validation.remember(env.python, env.vllm_dir)   # (where the launch finds this vLLM)
    draft = draft_ask(x)
    # an answer with no refusal stands; a refusal is asked again (the fix may be in); what
    # is asked goes to one vLLM process (its import is most of the time)
    v, d = validation.cached(key), validation.cached(draft.key)
    base, own = v is None or bool(v.refusals), draft.planned is not None and (
        d is None or bool(d.refusals))
    if base or own:
        asked = [*(servers if base else []), *([draft.planned] if own else [])]
        got = validation.validate(env, x.cfg.target_path(), asked)
        if base:
            v = got.part({s.name for s in servers})
            validation.store(key, v)
        if own:
            d = got.part({draft.planned.name})
            validation.store(draft.key, d)
    record_model(x, v)
    out = planned_around(x, v, env.version or "?")
    if validation.model_refused(env.python, x.cfg.target_path(), env.vllm_dir):
        return out   # (evaluate is skipped, said above: its draft is not asked about)
    return out + draft.lines + (planned_around(x, d, env.version or "?") if d else [])


@dataclass
class DraftAsk:
    """speculators' part of asking about evaluate's server with the draft:
    its lines, and the server to put to vLLM (None: not asked, lines say why)."""
    lines: list[Finding]
    planned: Planned | None = None
    key: str | None = None


def draft_ask(x: Inputs) -> DraftAsk:
    """The draft train will make, asked before training: speculators builds
    its config from the stage's flags (a config-only stand-in, no weights),
    for vLLM's own validation to read as evaluate's server will. An MLA
    draft is served from an export of trained weights: not asked."""
    from pipeline.doctor.vllm import draft_layer
    from pipeline.train import algorithms, draft_stand_in
    env = x.vllm
    if not (x.cfg.enabled("evaluate") and x.cfg.enabled("train")) or x.layer_ids is None or \
            "error" in x.env or env.unusable(x.cfg.stage_devices("evaluate")) or \
            validation.model_refused(env.python, x.cfg.target_path(), env.vllm_dir):
        return DraftAsk([])
    algo = algorithms.get(x.cfg.stages.train.algorithm)
    if draft_layer(x.cfg, x.model, env.cpu_build) == "mla":
        return DraftAsk([Finding("vllm", OK, "evaluate with the MLA draft: not asked before "
                                 "training (vLLM serves its export, made from the trained "
                                 "weights)")])
    if x.model.mla and env.cpu_build:
        return DraftAsk([])   # another layer beside an MLA target: check_cpu_attention blocks it
    version = x.packages.get("speculators") or "?"
    stand_in = draft_stand_in.ask(x.cfg.python(), f"{version} {x.env.get('speculators_dir')}",
                                  x.cfg, x.layer_ids[:-1])
    if stand_in.failed:
        return DraftAsk([Finding("speculators", WARN, f"speculators did not answer for the "
                                 f"{algo.display} draft: {stand_in.failed}",
                                 "run `eagle-panel doctor` again")])
    if not stand_in.ok:
        return DraftAsk([stand_in_refused(stand_in, version, algo.display)])
    folder, planned = target_folder(x.cfg), draft_server(x.cfg, x.model, stand_in.folder)
    how = "cached" if stand_in.cached else f"{stand_in.import_s + stand_in.seconds:.0f} s"
    return DraftAsk([Finding("speculators", OK, f"speculators {version} takes the train stage's "
                             f"flags and builds the {algo.display} draft's config ({how}); "
                             "vLLM is asked about evaluate's server with it below")], planned,
                    validation.cache_key(env.python, folder, [planned], env.vllm_dir)
                    if folder else None)


def record_model(x: Inputs, v: validation.Validation) -> None:
    """Keep vLLM's answer on building the target for the stages (auto's
    backend, evaluate's skip): its first model refusal, or none once a
    server's model was built."""
    built = [r for r in v.results if r.step == "model"]
    if not built or x.vllm is None:
        return
    refused = next((r.error for r in built if not r.ok), None)
    validation.record_model(x.vllm.python, x.cfg.target_path(), refused, x.vllm.vllm_dir)


def planned_around(x: Inputs, v: validation.Validation, version: str) -> list[Finding]:
    """vLLM's answer as doctor's lines, where a model vLLM cannot build here is
    run around rather than blocked: `backend = "auto"` extracts on hf (said
    once, x.backend follows for the checks after this one), and evaluate is
    skipped with vLLM's reason (the run ends at train's estimate), as the
    stages themselves do from the recorded answer."""
    out, kept = [], []
    auto = x.cfg.stages.extract.backend == "auto" and not x.cfg.online
    for r in v.results:
        cannot = not r.ok and r.step == "model"
        if cannot and auto and r.name == "extract":
            resolved = x.backend == "hf"
            x.backend, x.backend_why = "hf", f"vLLM {version} cannot build the target here"
            out.append(Finding("backends", OK, f'backend = "auto" -> hf: vLLM {version} '
                               f"cannot build the target here ({r.error}): the hf backend "
                               "extracts instead (recorded: the stages decide the same way)"))
            if x.env and not resolved:   # doctor's hf checks ran before vLLM was asked
                out += hf_route_findings(x)
        elif cannot and r.name.startswith("evaluate"):
            out.append(Finding("evaluate", WARN, f"evaluate will be skipped: vLLM {version} "
                               f"cannot build the target here ({r.error}); the run ends at "
                               "train's estimate",
                               "measure the draft where this vLLM has the target's kernels (a "
                               "GPU build); [stages.evaluate] enabled = false says it is meant"))
        else:
            kept.append(r)
    answer = validation.Validation(kept, v.import_s, v.seconds, v.cached, v.failed)
    return out + findings(answer, version)


@check(None, launch=70)
def check_vllm_accepted(x: Inputs) -> list[Finding]:
    """The launch's: doctor's last answer for this config and vLLM, when
    there is one (asking takes vLLM's import: doctor's job, not a launch's)."""
    if x.model is None:
        return []
    # the launch resolves no backend: "auto" is looked up both ways doctor may have gone
    backend = x.cfg.stages.extract.backend
    for b in ("vllm-server", "hf") if backend == "auto" else (backend,):
        v = validation.cached(_key(x, b)[0])
        if v is not None:
            return [f for f in planned_around(x, v, "(as `eagle-panel doctor` found)")
                    if f.level == BLOCK]
    return []


def draft_server(cfg: Config, m: ModelInfo, folder: str) -> Planned:
    """evaluate's server with the draft, as the stage starts it (its
    speculative config: the algorithm's method and keys), the draft read from
    the stand-in `folder` speculators made (pipeline/train/draft_stand_in.py)."""
    import json

    from pipeline.train import algorithms
    from pipeline.vllm import contract_strings as vs
    ev, algo = cfg.stages.evaluate, algorithms.get(cfg.stages.train.algorithm)
    spec = {"method": algo.vllm_method, "model": folder,
            "num_speculative_tokens": ev.num_speculative_tokens, **algo.vllm_extra}
    max_len = int(m.max_position or 4096) if ev.prompts else \
        cfg.stages.prepare.seq_length + ev.max_tokens + 8
    return _planned(cfg, "evaluate", f"evaluate (with the {algo.display} draft)", max_len,
                    [vs.FLAG_SPECULATIVE_CONFIG, json.dumps(spec), *ev.server_args],
                    cfg.stage_devices("evaluate"))


def stand_in_refused(s, version: str, algo: str) -> Finding:
    """speculators' refusal of the train stage's flags or of its draft."""
    what = "the train stage's flags" if s.step == "resolve" else f"the {algo} draft's config"
    return Finding("speculators", BLOCK, f"speculators {version} refuses {what}: {s.error}",
                   "this is speculators' own parser and draft builder on the flags train "
                   "would pass; change what it names in [stages.train], or install the "
                   "speculators the stage was written for (scripts/install.sh)")
