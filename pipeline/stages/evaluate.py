"""Stage 5, evaluate: the acceptance length vLLM measures when it serves the
trained draft — the number users judge a draft by (train only estimates it).

    evaluate/out/checkpoints/<name>.json  one checkpoint's measurement (atomic)
    evaluate/out/baseline.json            the same prompts without a draft
    evaluate/out/results.json             all of it, with the exact vLLM commands (last)

For each checkpoint ([stages.evaluate] checkpoints = chosen (the default: the
one train's summary names) | last | best | all | best-K, the K that train's
estimates rank highest): a
`vllm serve <target>` with `--speculative-config {"method": "eagle3",
"model": <checkpoint>, "num_speculative_tokens": k}` (the method and keys are
the [stages.train] algorithm's: pipeline.train.algorithms; an MLA draft: its vLLM
export, train/out/vllm/<epoch>/, which vLLM loads as
`Eagle3DeepseekV2ForCausalLM`; made here, in evaluate/out/vllm/, if train's
is missing or older than the checkpoint), the held-out prompts
(the prompts of the validation split train held out, or a JSONL file), greedy
unless a temperature is set, `concurrency` at a time; /metrics read before and
after (pipeline.vllm.metrics): acceptance length, the acceptance rate at each
draft position, decode tokens/s. Then the same server flags without the draft,
same prompts: the speedup (on a CPU-only machine its server starts beside the
first draft's, BaselineAhead). Each measurement is saved as it ends, so a killed
evaluate redoes only what it had not finished; every server's process tree
is stopped however the stage ends. Without a usable vLLM, or with one that
cannot serve the algorithm's method (its model runners' lists, read from its
source: compat.draft_method_unservable), it is skipped and says why: the
pipeline ends at train, with its estimate.

With more than one checkpoint measured, the trained draft the summary names
is the one vLLM measured the longest acceptance for (`choice.best_measured`),
not the last: the number users judge a draft by picks it, train's estimate
only where nothing measures.

The parts, one module each in pipeline/evaluate/: `choice` (which
checkpoints; pure), `load` (the prompts and one pass of them through a
server), `servers` (the pool, the draft swap, what vLLM loads), `baseline`,
`measurement` (the typed result), `measure` (one checkpoint's, saved as it
ends), `results` (results.json, the summary, the gate) and `trackers`.
This module is the stage's entry point.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace

from pipeline import tracking
from pipeline.data.prompt_sets import PROMPTS_FILE, as_row
from pipeline.drive.stage_context import Skipped, StageContext, StageError, main_for
from pipeline.evaluate import baseline, choice, load, measure, results, trackers
from pipeline.evaluate.servers import ServerPool
from pipeline.run.rundir import atomic_write_bytes
from pipeline.run.summaries import EvaluateSummary
from pipeline.train import algorithms
from pipeline.vllm.environment import probe
from pipeline.vllm.validation import model_refused


def body(ctx: StageContext) -> EvaluateSummary:
    """Measure the chosen checkpoints (and the baseline), write results.json, gate."""
    sec = ctx.section
    env = probe(ctx.cfg.vllm_python())
    algo = algorithms.get(ctx.cfg.stages.train.algorithm)
    refused = model_refused(env.python, ctx.cfg.target_path(), env.vllm_dir)
    why = env.unusable(ctx.cfg.stage_devices("evaluate")) or \
        (refused and f"vLLM {env.version} cannot build the target here ({refused}: found by "
                     "`eagle-panel doctor`, which asked it)") or \
        env.cannot_serve(algo.vllm_method, os.environ, algo.architectures, tuple(algo.vllm_extra),
                         algo.speculator_type)
    if why:
        raise Skipped(f"{why}; the pipeline ends at train, with its estimate")
    tracking.require(ctx.cfg.tracking.loggers, StageError)
    save = ctx.out_of("train") / "checkpoints"
    train_named = choice.train_chose(ctx.run)
    chosen = choice.checkpoints(save, sec.checkpoints, train_named)
    if not chosen:
        raise StageError(f"no complete checkpoint in {save}", hint="run the train stage first")
    choice.check_drafted_tokens(ctx, algo, chosen)
    prompts, max_len = load.choose_prompts(ctx)
    atomic_write_bytes(ctx.out / PROMPTS_FILE,
                       "".join(json.dumps(as_row(p)) + "\n" for p in prompts).encode())
    (ctx.out / "checkpoints").mkdir(exist_ok=True)
    ev = ServerPool(ctx, env, prompts, max_len)
    total = len(chosen) + int(sec.baseline)
    measured = {}
    with contextlib.ExitStack() as stack:
        if sec.baseline and baseline.saved(ctx, ev) is None \
                and not all(measure.saved(ctx, c) for c in chosen) \
                and baseline.BaselineAhead.worth_it(ev):
            ev.ahead = baseline.BaselineAhead(ev, len(chosen))
            stack.callback(ev.ahead.stop)   # however the stage ends
        stack.callback(ev.close_live)
        for n, ckpt in enumerate(chosen):
            measured[ckpt.name] = measure.measure(ctx, ev, n, ckpt)
            measure.emit(ctx, ckpt, measured[ckpt.name])
            ctx.progress(n + 1, total, "measurements")
        without = None
        if sec.baseline:
            without = baseline.measure(ctx, ev, len(chosen))
            ctx.progress(total, total, "measurements")
    named = choice.best_measured({n: m.acceptance_length for n, m in measured.items()}) \
        if len(measured) > 1 else chosen[-1].name
    servers = {"target_loads": ev.starts, "swaps": ev.swaps, "restarts": ev.restarts,
               "one_server": ev.swap_why or "yes"}
    summary = replace(
        results.write(ctx, measured, named, without, len(prompts), servers),
        checkpoint_path=str(next(c for c in chosen if c.name == named)),
        checkpoint_chosen_by=(f"highest measured acceptance of {len(measured)}"
                              if len(measured) > 1 else
                              choice.chosen_by(sec.checkpoints, train_named, chosen)))
    trackers.log(ctx, measured, named, summary)
    if ctx.cfg.tracking.loggers:
        summary = replace(summary,
                          trackers=tracking.where(ctx.run.path, ctx.cfg.tracking.loggers))
    results.gate(sec.min_acceptance, summary)
    return summary


def main() -> None:
    main_for("evaluate", body)


if __name__ == "__main__":
    main()
