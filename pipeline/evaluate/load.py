"""The load evaluate puts on a server: which prompts (train's held-out
rows, or a prompt set), and one pass of them through a server, a few
conversations at a time, with each request's acceptance where it can be read."""

from __future__ import annotations

import queue
import threading
import time

from pipeline.data.prompt_sets import Prompt, from_token_ids, take
from pipeline.data.prompt_sets import load as load_prompts
from pipeline.drive.stage_context import StageContext, StageError
from pipeline.model.info import read_model
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.acceptance import from_counters, from_response
from pipeline.vllm.metrics import spec_counters


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
