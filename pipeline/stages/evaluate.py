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
is the one vLLM measured the longest acceptance for (`best_measured`), not
the last: the number users judge a draft by picks it, train's estimate
only where nothing measures.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import threading
import time
from pathlib import Path

from pipeline import tracking
from pipeline.data.prompt_sets import PROMPTS_FILE, Prompt, as_row, from_token_ids, take
from pipeline.data.prompt_sets import load as load_prompts
from pipeline.drive.stage_context import Skipped, StageContext, StageError, main_for
from pipeline.model.info import kv_bytes_per_token, read_model
from pipeline.run.events import EventType, last_event
from pipeline.run.rundir import atomic_write_bytes
from pipeline.train import algorithms
from pipeline.train.checkpoints import complete_checkpoint
from pipeline.train.mla_draft import (
    CPU_CONFLICT,
    export_for_vllm,
    export_is_current,
    is_mla_checkpoint,
    validate_export,
)
from pipeline.train.val_metrics import estimate, read_val_metrics
from pipeline.vllm import contract_strings as vs
from pipeline.vllm import draft_swap
from pipeline.vllm.acceptance import by_category, from_counters, from_response, worst_prompts
from pipeline.vllm.environment import probe
from pipeline.vllm.metrics import acceptance, spec_counters
from pipeline.vllm.serve_command import rewritten
from pipeline.vllm.server import bring_up, make_server, server_log
from pipeline.vllm.target_flags import parser_has
from pipeline.vllm.validation import model_refused


def checkpoints(save_path: Path, which: str, train_chose: Path | None = None) -> list[Path]:
    """The checkpoint folders to measure, oldest first. "chosen": the one
    train's summary names (`train_chose`: its budget rule's highest
    estimate, else speculators' best or last), so that the draft train
    reports is the one measured and shipped; the last where train named none."""
    epochs = sorted((d for d in save_path.iterdir() if d.name.isdigit() and not d.is_symlink()
                     and complete_checkpoint(d)), key=lambda d: int(d.name)) \
        if save_path.is_dir() else []
    if not epochs:
        return []
    if which == "all":
        return epochs
    if which.startswith("best-"):
        return top_estimated(epochs, save_path.parent / "plateau.json", int(which[5:]))
    best = save_path / "checkpoint_best"
    if which == "best" and best.exists():
        return [best.resolve()]
    named = named_checkpoint(epochs, train_chose) if which == "chosen" else None
    return [named or epochs[-1]]


def named_checkpoint(epochs: list[Path], named: Path | None) -> Path | None:
    """The epoch folder of `epochs` that train's summary named, found by its
    name (checkpoint_best: the epoch it points to), so that a run folder
    moved or copied elsewhere still finds it; None where it is not there."""
    if named is None or not epochs:
        return None
    name = os.path.basename(os.path.realpath(epochs[0].parent / named.name)) \
        if named.name == "checkpoint_best" else named.name
    return next((d for d in epochs if d.name == name), None)


def chosen_by(which: str, named: Path | None, measured: list[Path]) -> str:
    """How the one checkpoint measured was chosen, in words ("chosen" where
    train named none, or one not there, falls back to the last and says so)."""
    if which != "chosen":
        return f"{which} checkpoint"
    return "the checkpoint train chose" if named_checkpoint(measured, named) is not None \
        else "last checkpoint (train named none)"


def recorded_tokens(ckpt: Path) -> int | None:
    """The tokens a checkpoint was trained to draft, as speculators records
    them (config.json: speculators_config.proposal_methods[0].speculative_tokens)."""
    try:
        spec = json.loads((ckpt / "config.json").read_text())["speculators_config"]
        return int(spec["proposal_methods"][0]["speculative_tokens"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def check_drafted_tokens(ctx: StageContext, algo, chosen: list[Path]) -> None:
    """`num_speculative_tokens` against what each checkpoint records: more than a
    block drafter's block holds is an error before any server starts (vLLM cannot
    draft them; the config's own check sees only today's block_size, not the one
    the draft was trained with); more than EAGLE-3's TTT steps a warning (vLLM
    drafts on, past what the draft was trained for)."""
    k = ctx.section.num_speculative_tokens
    for ckpt in chosen:
        most = recorded_tokens(ckpt)
        if most is None or k <= most:
            continue
        if algo.block:
            raise StageError(f"[stages.evaluate] num_speculative_tokens = {k}, but checkpoint "
                             f"{ckpt.name} of {algo.display} drafts at most {most} tokens (its "
                             f"config.json: speculators_config.proposal_methods[0]."
                             "speculative_tokens)",
                             hint=f"set num_speculative_tokens <= {most}, or train again with a "
                                  "larger [stages.train] block_size")
        ctx.events.warning(f"[stages.evaluate] num_speculative_tokens = {k}, but checkpoint "
                           f"{ckpt.name} was trained for {most} (its TTT steps): vLLM drafts the "
                           "rest past what the draft learned, and accepts few of them",
                           hint=f"set num_speculative_tokens <= {most}, or [stages.train] "
                                f"ttt_steps >= {k}")
        return


def train_chose(ctx: StageContext) -> Path | None:
    """The checkpoint train's last summary names (None: train has not
    succeeded, or named none); whether it is still there is the caller's."""
    fin = last_event(ctx.run.events_path("train"), ("stage_finished",))
    named = ((fin or {}).get("summary") or {}).get("checkpoint")
    return Path(named) if named and fin.get("status") == "succeeded" else None


def train_estimates(history: Path) -> dict[str, float]:
    """Train's estimate per epoch (train/out/plateau.json: every epoch's;
    speculators writes a checkpoint's val_metrics.json only when its
    validation loss improved); {} without it."""
    try:
        return {str(e): v for e, v in json.loads(history.read_text())["history"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def top_estimated(epochs: list[Path], history: Path, k: int) -> list[Path]:
    """The k of `epochs` with the highest estimates in train's history
    (train/out/plateau.json), oldest first; without it, the last k."""
    est = train_estimates(history)
    ranked = sorted(epochs, key=lambda d: (est.get(d.name, float("-inf")), int(d.name)))
    return sorted(ranked[-k:], key=lambda d: int(d.name))


def best_measured(results: dict) -> str:
    """The measured checkpoint with the longest acceptance (the later on a tie)."""
    names = list(results)
    return max(reversed(names), key=lambda n: results[n]["acceptance_length"] or 0.0)


def checkpoint_id(folder: Path) -> dict:
    """What identifies a checkpoint's contents (a re-trained one differs)."""
    state = json.loads((folder / "training_state.json").read_text())
    return {"name": folder.name, "global_step": state.get("global_step"),
            "bytes": (folder / "model.safetensors").stat().st_size}


def validation_prompts(ctx: StageContext) -> list[list[int]]:
    """The prompts of the rows train validated on: speculators keeps rows
    [int(n x train_ratio), n) of the prepared data for validation; a row's
    prompt is everything before its first supervised token."""
    from datasets import load_from_disk
    ds = load_from_disk(str(ctx.out_of("prepare") / "data")).with_format(None)
    start = int(len(ds) * ctx.cfg.stages.train.train_ratio)
    if start >= len(ds):
        start = 0   # no validation split: all rows (said in the summary)
    prompts, seen = [], set()
    for row in ds.select(range(start, len(ds))):
        mask = row["loss_mask"]
        first = mask.index(1) if 1 in mask else len(mask)
        prompt = tuple(row["input_ids"][:first])
        if prompt and prompt not in seen:
            seen.add(prompt)
            prompts.append(list(prompt))
    return prompts


def generate(server, model: str, prompts: list[Prompt], sec, should_stop,
             per_request: str | None, k: int) -> dict:
    """Ask every prompt (`concurrency` conversations at a time; a prompt's
    turns one after the other, each after the target's own answer to the
    last). Returns tokens, wall time and one record per request with its
    acceptance: from the response (`per_request` = "response"), from /metrics
    around it ("metrics": one request at a time), or none (no draft)."""
    return Generation(server, model, sec, should_stop, per_request, k).run(prompts)


class Generation:
    """One pass of the prompts through a server: what its client threads share."""

    def __init__(self, server, model: str, sec, should_stop, per_request: str | None, k: int):
        self.server, self.sec, self.should_stop = server, sec, should_stop
        self.per_request, self.k = per_request, k
        self.work: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.done = {"completion_tokens": 0, "requests": 0, "records": []}
        self.errors: list[BaseException] = []
        self.serial = threading.Lock() if per_request == "metrics" else None
        self.params = {"model": model, "max_tokens": sec.max_tokens,
                       "temperature": sec.temperature, "seed": sec.seed}

    def ask(self, path: str, body: dict) -> tuple[dict, dict | None]:
        server, timeout = self.server, self.sec.request_timeout_s
        if self.serial is None:
            r = server.post(path, {**self.params, **body}, timeout)
            return r, (from_response(r) if self.per_request else None)
        with self.serial:   # /metrics around one request: nothing else in flight
            before = spec_counters(server.metrics_text() or "")
            r = server.post(path, {**self.params, **body}, timeout)
            return r, from_counters(before, spec_counters(server.metrics_text() or ""), self.k)

    def conversation(self, p: Prompt) -> None:
        msgs = []
        for turn, content in enumerate(p.turns):
            if p.kind == "turns":
                msgs = msgs + [{"role": "user", "content": content}]
                r, acc = self.ask(vs.ROUTE_CHAT, {"messages": msgs})
                msgs = msgs + [{"role": "assistant",
                                "content": r["choices"][0]["message"].get("content") or ""}]
            elif p.kind == "messages":
                r, acc = self.ask(vs.ROUTE_CHAT, {"messages": content})
            else:   # text or token ids
                r, acc = self.ask(vs.ROUTE_COMPLETIONS, {"prompt": content})
            self.record(p, turn, r, acc)

    def record(self, p: Prompt, turn: int, r: dict, acc: dict | None) -> None:
        done = self.done
        with self.lock:
            done["completion_tokens"] += r["usage"]["completion_tokens"]
            done["requests"] += 1
            if acc is not None:
                done["records"].append({"prompt_id": p.id, "category": p.category,
                                        "turn": turn, "text": p.text()[:200],
                                        "completion_tokens": r["usage"]["completion_tokens"],
                                        **acc})

    def client(self) -> None:
        while not self.errors and not self.should_stop():
            try:
                p = self.work.get_nowait()
            except queue.Empty:
                return
            try:
                self.conversation(p)
            except OSError as e:
                self.errors.append(self.server.died() or e)
                return

    def run(self, prompts: list[Prompt]) -> dict:
        for p in prompts:
            self.work.put(p)
        done = self.done
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self.client, daemon=True)
                   for _ in range(self.sec.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done["seconds"] = time.perf_counter() - t0
        if self.errors:
            e = self.errors[0]
            raise e if isinstance(e, StageError) else StageError(
                f"a request to the vLLM server failed: {e}", hint="see the server log")
        done["decode_tokens_per_s"] = done["completion_tokens"] / max(done["seconds"], 1e-9)
        return done


class Evaluation:
    def __init__(self, ctx: StageContext, env, prompts: list[Prompt], max_len: int):
        self.ctx, self.env, self.prompts, self.max_len = ctx, env, prompts, max_len
        self.ahead: BaselineAhead | None = None
        self.sec = ctx.section
        self.target = ctx.cfg.target_path()
        self.devices = ctx.cfg.stage_devices("evaluate")
        self.dtype = ctx.cfg.dtype_name(bool(self.devices))
        elem = 4 if self.dtype == "float32" else 2
        # the target's KV plus the draft's (one layer): a generous plan
        self.kv_per_token = 2 * kv_bytes_per_token(read_model(self.target),
                                                   max(1, len(self.devices)), elem)
        # each request's acceptance in its response where the vLLM has it
        per_request = parser_has(env.source(), vs.FLAG_PER_REQUEST_SPEC_METRICS)
        self.per_request = "response" if per_request else "metrics"
        # one server for every checkpoint, the next drafts swapped in (None: it can)
        self.algorithm = algorithms.get(ctx.cfg.stages.train.algorithm)
        self.swap_why = draft_swap.unavailable(env.source(), self.sec.server_args) \
            if self.sec.one_server else "[stages.evaluate] one_server = false"
        if self.swap_why is None and not self.algorithm.eagle3_layers:
            # the swap loads through an EAGLE-3 drafter's load_weights (swap_worker):
            # another algorithm's drafter is served fresh per checkpoint
            self.swap_why = f"the draft swap is EAGLE-3's; {self.algorithm.name} is served fresh"
        self.live = None          # the draft's server, kept up for the next checkpoint
        self.live_served: Path | None = None   # the folder it loaded its drafter from
        self.starts, self.swaps, self.restarts = 0, 0, []   # target loads; why each restart

    def server(self, k: int, draft: Path | None, served: Path | None = None,
               spec_extra: dict | None = None):
        """Server k (with the draft, or without), not started; `served` is the
        folder vLLM loads the draft from (default: `draft`), `spec_extra` more
        keys of the speculative config."""
        sec = self.sec
        flags = list(sec.server_args)
        if draft is not None:
            algo = self.algorithm   # how vLLM serves it: eagle3, + parallel_drafting, dflash
            spec = {"method": algo.vllm_method, "model": str(served or draft),
                    "num_speculative_tokens": sec.num_speculative_tokens, **algo.vllm_extra,
                    **(spec_extra or {})}
            flags = [vs.FLAG_SPECULATIVE_CONFIG, json.dumps(spec)] + flags
            if self.per_request == "response":
                flags = [vs.FLAG_PER_REQUEST_SPEC_METRICS, "summary"] + flags
            if self.swap_why is None:
                flags = draft_swap.SERVER_FLAGS + flags
        swappable = draft is not None and self.swap_why is None
        return make_server(k, self.env, self.target, self.devices,
                           server_log(self.ctx.run.stage_dir("evaluate"), k), self.dtype,
                           self.max_len, self.ctx.cfg.model.trust_remote_code, flags,
                           sec.serve_command, sec.concurrency * self.max_len, self.kv_per_token,
                           what=f"vLLM server ({'checkpoint ' + draft.name if draft else 'no draft'})",
                           report=lambda kind, f: self.ctx.events.emit(kind, **f),
                           stall_after_s=sec.stall_after_s,
                           extra_env=draft_swap.SERVER_ENV if swappable else None)

    def up(self, server, poll=None) -> None:
        """Start `server` (unless it was started ahead) and wait for it."""
        if server.proc is None:
            self.starts += 1
        bring_up(server, self.sec.startup_timeout_s, lambda: self.ctx.stop_requested, poll)
        self.ctx.check_stop()

    def close_live(self) -> None:
        """Stop the draft's server kept up for the next checkpoint (if any)."""
        if self.live is not None:
            self.live.stop(grace=self.ctx.cfg.runtime.term_grace_s)
            self.live = self.live_served = None

    def draft_server(self, k: int, draft: Path, served: Path, spec_extra: dict | None):
        """(the server to measure checkpoint `draft` on, how it got the draft):
        the running one with the draft swapped in where that gives what a
        fresh server would, else a new one (said, with why)."""
        if self.live is not None:
            why = draft_swap.incompatible(self.live_served, served)
            if why is None:
                try:
                    r = draft_swap.swap(self.live, served, self.sec.request_timeout_s)
                    print(f"evaluate: checkpoint {draft.name} loaded into the running server "
                          f"({r.get('loaded')} tensors in {r.get('seconds')} s; the target's "
                          f"{', '.join(r.get('shared') or []) or 'none'} left shared)",
                          flush=True)
                    self.swaps += 1
                    self.live.what = f"vLLM server (checkpoint {draft.name})"
                    self.live.report_startup(force=True)   # the panel's label follows it
                    return self.live, "swapped into the running server"
                except draft_swap.SwapFailed as e:
                    why = str(e)
            print(f"evaluate: checkpoint {draft.name} on a new server: the running one "
                  f"cannot take it ({why})", flush=True)
            self.restarts.append(f"checkpoint {draft.name}: {why}")
            self.close_live()
        server = self.server(k, draft, served, spec_extra)
        ahead = self.ahead if self.ahead and not self.ahead.waited else None
        try:
            self.up(server, poll=ahead.watch if ahead is not None else None)
            if ahead is not None:
                ahead.wait()   # up before this one's prompts: it must not share their cores
        except BaseException:
            server.stop(grace=self.ctx.cfg.runtime.term_grace_s)
            raise
        self.live, self.live_served = server, served
        return server, "a new server"

    def measure(self, k: int, draft: Path | None, served: Path | None = None,
                spec_extra: dict | None = None, server=None) -> dict:
        """The prompts through a server with the draft (the running one, the
        draft swapped in, where it can be) or without (server k: `server`
        when one was started ahead, BaselineAhead, else a new one)."""
        sec = self.sec
        if draft is not None:
            server, how = self.draft_server(k, draft, served or draft, spec_extra)
        else:
            self.close_live()   # no draft's server beside the baseline's prompts
            server, how = server or self.server(k, None), "a new server"
            try:
                self.up(server)
            except BaseException:
                server.stop(grace=self.ctx.cfg.runtime.term_grace_s)
                raise
        keep = draft is not None and self.swap_why is None   # for the next checkpoint
        try:
            before = spec_counters(server.metrics_text() or "")
            run = generate(server, str(self.target), self.prompts, sec,
                           lambda: self.ctx.stop_requested,
                           self.per_request if draft is not None else None,
                           sec.num_speculative_tokens)
            after = spec_counters(server.metrics_text() or "")
        finally:
            if not keep:
                server.stop(grace=self.ctx.cfg.runtime.term_grace_s)
                if server is self.live:
                    self.live = self.live_served = None
        self.ctx.check_stop()   # cut short by a stop: not a measurement
        command = shlex.join(fresh_command(server.argv, served or draft))
        out = {**run, "vllm_command": command, "prompts": len(self.prompts), "served_by": how}
        if draft is not None:
            k_ = sec.num_speculative_tokens
            records = out.pop("records")
            out.update(acceptance(before, after))
            out.update(per_request=self.per_request, requests_measured=records,
                       per_category=by_category(records, k_),
                       worst_prompts=worst_prompts(records, k_))
        else:
            out.pop("records")
        return out


def fresh_command(argv: list[str], served: Path | None) -> list[str]:
    """The `vllm serve` command that serves `served` from the start: the
    server's own, its speculative config naming that folder (a swapped-in
    draft), without the swap's flags (they change nothing measured)."""
    swap = tuple(draft_swap.SERVER_FLAGS)
    return rewritten(argv, {vs.FLAG_WORKER_EXTENSION_CLS: swap, vs.FLAG_MIDDLEWARE: swap},
                     str(served) if served is not None else None)


def served_draft(ctx: StageContext, ckpt: Path, env) -> Path:
    """The folder vLLM serves for checkpoint `ckpt`: the checkpoint itself
    (speculators' format, a Llama-layer draft), or an MLA draft's vLLM
    export — train's, or one made here when train's is missing or stale."""
    if not is_mla_checkpoint(ckpt):
        if env.cpu_build and read_model(ctx.cfg.target_path()).mla and \
                vs.FLAG_ATTENTION_BACKEND not in ctx.section.server_args:
            algo = algorithms.get(ctx.cfg.stages.train.algorithm)
            # (the error vLLM gave a Llama-layer draft here; an algorithm's own
            # layers are GQA attention too: the same CPU_ATTN backend)
            kind = "Llama-layer" if algo.eagle3_layers else f"{algo.display} (its own GQA layers)"
            raise StageError(
                f"vLLM {env.version} (CPU build) cannot serve this MLA target with the {kind} "
                f"draft {ckpt} ({CPU_CONFLICT})",
                hint='train an MLA draft: [stages.train] draft_layer = "auto" or "mla", then '
                     "run train and evaluate again" if algo.eagle3_layers else
                     'only EAGLE-3\'s drafts have an MLA layer: set [stages.train] algorithm = '
                     '"eagle3" or "eagle3.1", or evaluate on a GPU build of vLLM')
        return ckpt
    export = ctx.out_of("train") / "vllm" / ckpt.name
    if export_is_current(ckpt, export) and not validate_export(export):
        return export
    own = ctx.out / "vllm" / ckpt.name
    if not (export_is_current(ckpt, own) and not validate_export(own)):
        print(f"evaluate: no current vLLM export of checkpoint {ckpt.name} in {export}; "
              f"writing one to {own}", flush=True)
        export_for_vllm(ckpt, own)
    return own


def mla_draft_backend(ctx: StageContext, env) -> dict:
    """The speculative-config keys an MLA draft needs: the target's
    attention backend, when one is set (target_flags' CPU_MLA on the CPU
    build, or the user's server_args). vLLM picks a draft's backend on its
    own, never inheriting `--attention-backend`: on an AMX host it gives an
    MLA draft AMX_MLA, which takes bf16 only, beside a float32 CPU_MLA target."""
    from pipeline.vllm.target_flags import flags_for
    source = env.source()
    flags = flags_for(ctx.cfg.target_path(), env.cpu_build, source) + list(ctx.section.server_args)
    backend = None
    for i, flag in enumerate(flags):
        if flag == vs.FLAG_ATTENTION_BACKEND and i + 1 < len(flags):
            backend = flags[i + 1]
        elif flag.startswith(vs.FLAG_ATTENTION_BACKEND + "="):
            backend = flag.split("=", 1)[1]
    text = source.text("config.speculative") if source is not None else None
    if backend is None or (text is not None and "attention_backend" not in text):
        return {}   # (a vLLM whose speculative config has no such key picks its own)
    return {"attention_backend": backend}


def choose_prompts(ctx: StageContext) -> tuple[list[Prompt], int]:
    """The prompts to serve and the longest context they need."""
    sec = ctx.section
    if sec.prompts:
        prompts = load_prompts(sec.prompts, ctx.cfg.resolve)
        max_len = int(read_model(ctx.cfg.target_path()).max_position or 4096)
    else:
        ids = validation_prompts(ctx)
        prompts = from_token_ids(ids)
        max_len = max(len(p) for p in ids) + sec.max_tokens + 8 if ids else 0
    prompts = take(prompts, sec.max_prompts)
    if not prompts:
        raise StageError("no prompts to evaluate with",
                         hint='give [stages.evaluate] prompts "mt-bench" or a JSONL file')
    return prompts, max_len


def measured(ctx: StageContext, ckpt: Path) -> dict | None:
    """Checkpoint `ckpt`'s saved measurement, when it is of these contents."""
    path = ctx.out / "checkpoints" / f"{ckpt.name}.json"
    old = json.loads(path.read_text()) if path.exists() else None
    return old if old and old.get("checkpoint") == checkpoint_id(ckpt) else None


def measure_checkpoint(ctx: StageContext, ev: Evaluation, n: int, ckpt: Path) -> dict:
    """Checkpoint `ckpt`'s measurement: the saved one when it is of these
    contents, else a new one (server n), saved as it ends."""
    old = measured(ctx, ckpt)
    if old is not None:
        print(f"evaluate: checkpoint {ckpt.name} already measured", flush=True)
        return old
    ident = checkpoint_id(ckpt)
    path = ctx.out / "checkpoints" / f"{ckpt.name}.json"
    served = served_draft(ctx, ckpt, ev.env)
    if served != ckpt:
        print(f"evaluate: checkpoint {ckpt.name} is an MLA draft: serving its vLLM "
              f"export {served}", flush=True)
    m = ev.measure(n, ckpt, served,
                   mla_draft_backend(ctx, ev.env) if served != ckpt else None)
    m["served"] = str(served)
    m["checkpoint"] = ident
    m["estimate"] = estimate(ctx.cfg, read_val_metrics(ckpt))
    if m["estimate"] is None:   # no val_metrics.json there: the epoch's figure from train
        m["estimate"] = train_estimates(ctx.out_of("train") / "plateau.json").get(ckpt.name)
    ctx.write_json(path, m)
    print(f"evaluate: checkpoint {ckpt.name}: acceptance length "
          f"{m['acceptance_length']:.3f} (train's estimate "
          f"{'-' if m['estimate'] is None else format(m['estimate'], '.3f')}) over "
          f"{m['drafts']} drafts, {m['decode_tokens_per_s']:.1f} tokens/s", flush=True)
    return m


def emit_measurement(ctx: StageContext, ckpt: Path, m: dict) -> None:
    ctx.events.emit(EventType.METRIC, step=m["checkpoint"]["global_step"], epoch=ckpt.name,
                    split="eval", values={
                        "acceptance_length": m["acceptance_length"],
                        "acceptance_estimate": m["estimate"],
                        **{f"accept_rate_{k}": r for k, r in enumerate(m["per_position"])}})


class BaselineAhead:
    """The baseline's server, started beside the first draft's.

    Most of a server's start is one core's work (imports, engine set-up:
    ~40 s of the demo's ~45 s on 2 cores), so on a CPU-only machine two
    starting side by side take little longer than one: the demo's evaluate
    saves about one server start. Only on the CPU build without GPUs (a GPU
    server's servers each need the GPUs), and only with room in memory for a
    second copy of the target. It must be up before the draft's prompts
    start, or its start would share their cores and skew the decode speed
    the speedup is measured from. One that fails to start is stopped and
    left to the baseline's own measurement, which starts it again and
    reports whatever stops it there."""

    def __init__(self, ev: Evaluation, k: int):
        self.ev, self.server = ev, ev.server(k, None)
        self.failed = self.waited = False
        self.server.start()
        ev.starts += 1

    def watch(self) -> None:
        """Its start's phases reported while the draft's server starts."""
        self.server.read_log()
        self.server.report_startup()

    def wait(self) -> None:
        sec = self.ev.sec
        try:
            self.server.wait_ready(sec.startup_timeout_s, lambda: self.ev.ctx.stop_requested)
        except StageError as e:
            print(f"evaluate: the baseline's server, started ahead, did not come up ({e}); "
                  "it starts again for its own measurement", flush=True)
            self.stop()
            self.failed = True
        self.waited = True   # once: the next drafts' servers start alone

    def stop(self) -> None:
        self.server.stop(grace=self.ev.ctx.cfg.runtime.term_grace_s)

    @staticmethod
    def worth_it(ev: Evaluation) -> bool:
        """A CPU-only evaluate with memory for two servers of this target."""
        if not ev.env.cpu_build or ev.devices:
            return False
        import psutil
        weights = sum(f.stat().st_size for f in Path(ev.target).glob("*.safetensors"))
        kv = ev.sec.concurrency * ev.max_len * ev.kv_per_token
        return psutil.virtual_memory().available > 2 * (weights + kv) + (4 << 30)


def baseline_measured(ctx: StageContext, ev: Evaluation) -> dict | None:
    path = ctx.out / "baseline.json"
    baseline = json.loads(path.read_text()) if path.exists() else None
    return baseline if baseline and baseline.get("prompts") == len(ev.prompts) else None


def measure_baseline(ctx: StageContext, ev: Evaluation, k: int) -> dict:
    """The same prompts without a draft (server k, or the one started ahead),
    unless already measured."""
    baseline = baseline_measured(ctx, ev)
    if baseline is None:
        ahead = ev.ahead
        alive = ahead is not None and not ahead.failed and ahead.server.died() is None
        server = ahead.server if alive else None   # (one that died meanwhile: a new one)
        baseline = ev.measure(k, None, server=server)
        ctx.write_json(ctx.out / "baseline.json", baseline)
    return baseline


def body(ctx: StageContext) -> dict:
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
    train_named = train_chose(ctx)
    chosen = checkpoints(save, sec.checkpoints, train_named)
    if not chosen:
        raise StageError(f"no complete checkpoint in {save}", hint="run the train stage first")
    check_drafted_tokens(ctx, algo, chosen)
    prompts, max_len = choose_prompts(ctx)
    atomic_write_bytes(ctx.out / PROMPTS_FILE,
                       "".join(json.dumps(as_row(p)) + "\n" for p in prompts).encode())
    (ctx.out / "checkpoints").mkdir(exist_ok=True)
    ev = Evaluation(ctx, env, prompts, max_len)
    total = len(chosen) + int(sec.baseline)
    results = {}
    with contextlib.ExitStack() as stack:
        if sec.baseline and baseline_measured(ctx, ev) is None \
                and not all(measured(ctx, c) for c in chosen) and BaselineAhead.worth_it(ev):
            ev.ahead = BaselineAhead(ev, len(chosen))
            stack.callback(ev.ahead.stop)   # however the stage ends
        stack.callback(ev.close_live)
        for n, ckpt in enumerate(chosen):
            results[ckpt.name] = measure_checkpoint(ctx, ev, n, ckpt)
            emit_measurement(ctx, ckpt, results[ckpt.name])
            ctx.progress(n + 1, total, "measurements")
        baseline = None
        if sec.baseline:
            baseline = measure_baseline(ctx, ev, len(chosen))
            ctx.progress(total, total, "measurements")
    named = best_measured(results) if len(results) > 1 else chosen[-1].name
    servers = {"target_loads": ev.starts, "swaps": ev.swaps, "restarts": ev.restarts,
               "one_server": ev.swap_why or "yes"}
    summary = report(ctx, results, named, baseline, len(prompts), servers)
    summary["checkpoint_path"] = str(next(c for c in chosen if c.name == named))
    summary["checkpoint_chosen_by"] = (f"highest measured acceptance of {len(results)}"
                                       if len(results) > 1 else
                                       chosen_by(sec.checkpoints, train_named, chosen))
    log_to_trackers(ctx, results, named, summary)
    if ctx.cfg.tracking.loggers:
        summary["trackers"] = tracking.where(ctx.run.path, ctx.cfg.tracking.loggers)
    gate(sec.min_acceptance, summary)
    return summary


def log_to_trackers(ctx: StageContext, results: dict, named: str, summary: dict) -> None:
    """What vLLM measured, into train's run in [tracking]'s trackers: each
    checkpoint at its step, and the chosen draft's per category and speedup.
    Each once: a resume logs only what no attempt logged (tracked.json), and
    a tracker that fails is a warning, not a failed stage after the
    measurements are done."""
    loggers = ctx.cfg.tracking.loggers
    if not loggers:
        return
    done_path = ctx.out / "tracked.json"
    try:
        done = set(json.loads(done_path.read_text()))
    except (OSError, ValueError, TypeError):
        done = set()   # none yet (or damaged: logged again, a repeat at the same steps)
    points, keys = [], []
    for name, m in results.items():
        key = f"{name}@{m['checkpoint']['global_step']}"
        if key not in done:
            points.append((m["checkpoint"]["global_step"], {"eval": measured_values(m)}))
            keys.append(key)
    chosen = {f"category/{c}": v for c, v in summary["per_category"].items()}
    if summary.get("speedup"):
        chosen["speedup"] = summary["speedup"]
    key = f"chosen {named}@{results[named]['checkpoint']['global_step']}"
    if chosen and key not in done:
        points.append((results[named]["checkpoint"]["global_step"], {"eval": chosen}))
        keys.append(key)
    if points:
        try:
            tracking.log_measured(ctx.run.path, ctx.run.id, loggers, points)
        except Exception as e:  # noqa: BLE001 - any tracker's own error: the measurements stand
            ctx.events.warning(f"the measured acceptance was not logged to {', '.join(loggers)}"
                               f": {type(e).__name__}: {e}")
            return
        ctx.write_json(done_path, sorted(done | set(keys)))
    print(f"evaluate: measured acceptance logged to {', '.join(loggers)}; to look: "
          + "; ".join(tracking.where(ctx.run.path, loggers)), flush=True)


def measured_values(m: dict) -> dict:
    """One checkpoint's figures as tracker scalars."""
    values = {"acceptance_length": m["acceptance_length"],
              "decode_tokens_per_s": m["decode_tokens_per_s"],
              **{f"accept_rate_{k}": r for k, r in enumerate(m["per_position"])
                 if r is not None}}
    if m.get("estimate") is not None:
        values["acceptance_estimate"] = m["estimate"]
    return values


def report(ctx: StageContext, results: dict, last_name: str, baseline: dict | None,
           n_prompts: int, servers: dict) -> dict:
    """results.json (with its artifact event) and the stage's summary."""
    sec = ctx.section
    last = results[last_name]
    speedup = (last["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
               if baseline and baseline["decode_tokens_per_s"] else None)
    cats = last.get("per_category") or {}
    worst = min(((c, v["acceptance_length"]) for c, v in cats.items()
                 if v.get("acceptance_length") is not None), key=lambda x: x[1], default=None)
    out = {"checkpoints": results, "baseline": baseline, "speedup": speedup,
              "num_speculative_tokens": sec.num_speculative_tokens,
              "temperature": sec.temperature, "concurrency": sec.concurrency,
              "max_tokens": sec.max_tokens, "seed": sec.seed,
              "prompts": "validation split" if not sec.prompts else sec.prompts,
              "per_category": cats, "worst_prompts": last.get("worst_prompts") or [],
              "min_acceptance": sec.min_acceptance or None, "servers": servers,
              "algorithm": ctx.cfg.stages.train.algorithm}
    ctx.write_json(ctx.out / "results.json", out)
    ctx.events.emit(EventType.ARTIFACT, path=str(ctx.out / "results.json"), kind="evaluation",
                    bytes=(ctx.out / "results.json").stat().st_size)
    return {
        "checkpoint": last_name, "acceptance_length": last["acceptance_length"],
        "acceptance_estimate": last["estimate"],
        "per_position": [round(r, 4) for r in last["per_position"] if r is not None],
        "per_category": {c: round(v["acceptance_length"], 4) for c, v in cats.items()
                         if v.get("acceptance_length") is not None},
        "worst_category": {"category": worst[0], "acceptance_length": round(worst[1], 4)}
        if worst and len(cats) > 1 else None,
        "decode_tokens_per_s": round(last["decode_tokens_per_s"], 1),
        "baseline_tokens_per_s": round(baseline["decode_tokens_per_s"], 1) if baseline else None,
        "speedup": round(speedup, 3) if speedup else None, "prompts": n_prompts,
        "target_loads": servers["target_loads"],   # (this attempt's)
        "measured": len(results), "drafts_swapped": sum(
            str(m.get("served_by", "")).startswith("swapped") for m in results.values()),
        "results": str(ctx.out / "results.json")}


def gate(threshold: float, summary: dict) -> None:
    """[stages.evaluate] min_acceptance: below it the stage fails, so a
    script can rely on `run --wait`'s exit status (0 = off). The
    measurements are kept: a resume fails again at once, without serving."""
    measured = summary.get("acceptance_length")
    if not threshold or measured is None or measured >= threshold:
        return
    worst = summary.get("worst_category")
    raise StageError(f"acceptance length {measured:.2f} measured is below min_acceptance "
                     f"{threshold:g}" + (f"; lowest category: {worst['category']} "
                                         f"{worst['acceptance_length']:.2f}" if worst else ""),
                     hint=f"see the worst prompts in {summary['results']}; train longer or "
                          "on the target's own answers ([stages.regenerate]), or lower "
                          "min_acceptance")


def main() -> None:
    main_for("evaluate", body)


if __name__ == "__main__":
    main()
