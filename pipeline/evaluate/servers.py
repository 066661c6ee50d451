"""evaluate's servers: the pool that serves each checkpoint (the running
server with the next draft swapped in, where it can), the folder vLLM loads
a checkpoint from (an MLA draft's vLLM export), and the command that serves
a measured draft from the start."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from pipeline.data.prompt_sets import Prompt
from pipeline.drive.stage_context import StageContext, StageError
from pipeline.evaluate.load import generate
from pipeline.evaluate.measurement import Measurement
from pipeline.model.info import kv_bytes_per_token, read_model
from pipeline.train import algorithms
from pipeline.train.mla_draft import (
    CPU_CONFLICT,
    export_for_vllm,
    export_is_current,
    is_mla_checkpoint,
    validate_export,
)
from pipeline.vllm import contract_strings as vs
from pipeline.vllm import draft_swap
from pipeline.vllm.acceptance import by_category, worst_prompts
from pipeline.vllm.metrics import acceptance, spec_counters
from pipeline.vllm.serve_command import rewritten
from pipeline.vllm.server import bring_up, make_server, server_log
from pipeline.vllm.target_flags import parser_has


class ServerPool:
    """evaluate's servers: the draft's, kept up with each next checkpoint
    swapped in where that gives what a fresh server would (else started
    again, said with why), and the baseline's; what each started, swapped
    and restarted is counted for results.json."""

    def __init__(self, ctx: StageContext, env, prompts: list[Prompt], max_len: int):
        self.ctx, self.env, self.prompts, self.max_len = ctx, env, prompts, max_len
        # the baseline's server started ahead (baseline.BaselineAhead, which imports this
        # module): the next draft's start watches it and waits for it
        self.ahead = None
        self.sec = ctx.section
        self.target = ctx.cfg.target_path()
        self.devices = ctx.cfg.stage_devices("evaluate")
        self.dtype = ctx.cfg.dtype_name(bool(self.devices))
        elem = 4 if self.dtype == "float32" else 2
        # the target's KV; a server with a draft adds the draft's layers, at the
        # target's attention shape (an EAGLE-3 draft's layer copies it)
        m = read_model(self.target)
        self.kv_per_token = kv_bytes_per_token(m, max(1, len(self.devices)), elem)
        with_kv = sum(k != "linear" for k in m.kinds) or m.layers
        self.draft_kv_per_token = self.kv_per_token + self.kv_per_token * algorithms.num_layers(
            ctx.cfg.stages.train) // max(1, with_kv)
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
                           sec.serve_command, sec.concurrency * self.max_len,
                           self.kv_per_token if draft is None else self.draft_kv_per_token,
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

    def run_prompts(self, k: int, draft: Path | None, served: Path | None = None,
                    spec_extra: dict | None = None, server=None) -> Measurement:
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
        records = run.pop("records")
        base = dict(run, vllm_command=command, prompts=len(self.prompts), served_by=how)
        if draft is None:
            return Measurement(**base)
        k_ = sec.num_speculative_tokens
        return Measurement(**base, **acceptance(before, after), per_request=self.per_request,
                           requests_measured=records, per_category=by_category(records, k_),
                           worst_prompts=worst_prompts(records, k_))


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
