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
from pipeline.run.rundir import RunDir
from pipeline.run.snapshot import read_run
from pipeline.stage_graph import STAGE_NAMES
from pipeline.vllm import contract_strings as vs


class ExportError(Exception):
    """What keeps a run from being exported, and what to do (exit 2)."""


def measured_checkpoint(results: dict, name: str | None, chosen: str | None) -> tuple[str, dict]:
    """The checkpoint to export and its measurement: `name` when given,
    else the one evaluate chose."""
    ckpts = results.get("checkpoints") or {}
    pick = name if name is not None else chosen
    if pick not in ckpts:
        have = ", ".join(sorted(ckpts, key=lambda s: (len(s), s))) or "none"
        raise ExportError(f"checkpoint {pick!r} was not measured by evaluate (measured: {have}); "
                          "pass one of them to --checkpoint, or run evaluate with "
                          '[stages.evaluate] checkpoints = "all"')
    return pick, ckpts[pick]


# training state a resume needs and a served draft does not
NOT_SHIPPED = ("optimizer_state_dict.pt", "scheduler_state_dict.pt", "training_state.json")
OWN_FLAGS = (vs.FLAG_HOST, vs.FLAG_PORT)   # the panel's server address: the user picks their own


def served_command(command: str, to: Path) -> str:
    """The measured server's command as a user runs it: `vllm serve`
    (not the panel's launcher), without the panel's address, its
    speculative config naming the exported folder instead of the run's."""
    argv = shlex.split(command)
    argv = ["vllm", *argv[argv.index("serve"):]] if "serve" in argv else argv
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in OWN_FLAGS and i + 1 < len(argv):
            i += 2
            continue
        if a == vs.FLAG_SPECULATIVE_CONFIG and i + 1 < len(argv):
            out += [a, json.dumps({**json.loads(argv[i + 1]), "model": str(to)})]
            i += 2
            continue
        out.append(a)
        i += 1
    return shlex.join(out)


def export(rd: RunDir, checkpoint: str | None = None, to: Path | None = None) -> Path:
    """Write the export folder; returns where it is."""
    snap = read_run(rd)
    ev = snap.stages["evaluate"].summary
    results_path = rd.out_dir("evaluate") / "results.json"
    if not results_path.exists():
        raise ExportError(f"{rd.id}: evaluate has not measured a draft ({results_path} is "
                          "missing); run the pipeline through evaluate first")
    try:
        results = json.loads(results_path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{results_path} cannot be read ({e}); run evaluate again "
                          "(`eagle-panel run --stage evaluate`)") from None
    name, m = measured_checkpoint(results, checkpoint, ev.get("checkpoint"))
    to = Path(to) if to is not None else rd.path / "export" / name
    if to.exists():
        raise ExportError(f"{to} already exists; remove it or pass another --to")
    served = Path(m["served"])
    if not served.is_dir():
        raise ExportError(f"the served draft {served} is gone; run evaluate again")
    tmp = to.with_name(f".{to.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(served, tmp, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    n = snap.stages["vocab"].summary.get("draft_vocab_size")
    for f in sorted(rd.out_dir("vocab").glob("*2*-*.npy")):   # d2t/t2d, where used
        if n is None or f.stem.endswith(f"-{n}"):
            shutil.copy2(f, tmp / f.name)
    prompts = rd.out_dir("evaluate") / PROMPTS_FILE   # (evaluates before it kept none)
    if prompts.is_file():
        shutil.copy2(prompts, tmp / PROMPTS_FILE)
    card = model_card(rd, snap, results, name, m, to, prompts.is_file())
    (tmp / "README.md").write_text(card)
    tmp.rename(to)
    return to


def target_of(rd: RunDir) -> tuple[str, str]:
    """The run's target as its config names it (id or path) and revision."""
    import tomllib
    try:
        model = tomllib.loads((rd.path / "config.toml").read_text()).get("model", {})
    except (OSError, ValueError):
        model = {}
    from pipeline.config import BUILTIN_MODEL
    return str(model.get("target", BUILTIN_MODEL)), str(model.get("revision", ""))


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
    train = snap.stages["train"].summary
    prep = snap.stages["prepare"].summary
    prov = provenance.read_run(rd.path, STAGE_NAMES)
    target, revision = target_of(rd)
    k = results.get("num_speculative_tokens")
    base = results.get("baseline") or {}
    lines = [
        "---", "tags:", "- speculative-decoding", "- eagle3", "- eagle-panel", "---", "",
        f"# EAGLE-3 draft from eagle-panel run `{rd.id}` (checkpoint {name})", "",
        "## Acceptance vLLM measured", "",
        f"- acceptance length **{m['acceptance_length']:.3f}** at "
        f"`num_speculative_tokens` {k}, over {m.get('prompts')} prompts "
        f"({results.get('prompts')}), temperature {results.get('temperature')}",
        "- per draft position: " + ", ".join(
            f"{r:.3f}" for r in m.get("per_position") or [] if r is not None),
        f"- decode {m['decode_tokens_per_s']:.1f} tokens/s with the draft"
        + (f", {base['decode_tokens_per_s']:.1f} without "
           f"(speedup {results['speedup']:.2f}x)" if base and results.get("speedup") else ""),
    ]
    if m.get("estimate") is not None:
        lines.append(f"- train's estimate {m['estimate']:.3f}")
    cats = m.get("per_category") or {}
    if cats:
        lines += ["", "| category | acceptance length |", "| --- | --- |"]
        lines += [f"| {c} | {v['acceptance_length']:.3f} |" for c, v in sorted(cats.items())
                  if v.get("acceptance_length") is not None]
    lines += ["", "## Serve it", "", "```", served_command(m["vllm_command"], to), "```", ""]
    if with_prompts:
        lines += [f"The prompts measured are in `{PROMPTS_FILE}` (one JSON object per line; "
                  f"{results.get('concurrency', 1)} request(s) at a time, `max_tokens` "
                  f"{results.get('max_tokens', '?')}): send them to this server to measure it again, "
                  f"or give them to eagle-panel as `[stages.evaluate] prompts`.", ""]
    lines += [
              "## How it was trained", "",
              f"- target: `{target}`" + (f" at revision `{revision}`" if revision else ""),
              f"- data: {prep.get('samples', '?')} samples, {prep.get('tokens', '?')} tokens "
              f"({prep.get('supervised_tokens', '?')} supervised)"
              + ("; the target's own answers (regenerated)"
                 if snap.stages["regenerate"].summary.get("rows") else ""),
              f"- training: {train.get('epochs_trained', '?')} epochs "
              f"(`total_seq_len` {train.get('total_seq_len', '?')}; {train.get('budget', '')}); "
              f"stopped: {train.get('stopped', '?')}; draft layer {train.get('draft_layer', '?')}",
              "", "```", str(train.get("train_argv", "")), "```", "",
              "## Versions", "", "```", json.dumps(versions(prov), indent=1), "```", "",
              "## Publish", "", "```", f"hf upload <user>/<repo> {to}", "```", ""]
    return "\n".join(lines)
