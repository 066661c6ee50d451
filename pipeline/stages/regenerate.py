"""Stage 0 (optional), regenerate: the target answers the conversations'
user turns itself, through vLLM — what speculators 0.9's
`regenerate-responses` does. A draft should learn the target's own
distribution, not someone else's answers.

    regenerate/out/rows.jsonl   one row per regenerated assistant turn:
        input_ids  the prompt as vLLM rendered it + the tokens the target generated
        loss_mask  0 over the prompt, 1 over the generated tokens
        messages   the conversation so far, with the target's answer as text
        source     the line (or row) of [data] it comes from
    prepare reads it instead of [data] (tokens as generated: no re-tokenizing).

Each conversation keeps its system and tool turns and its user turns; its
assistant turns are dropped and generated anew, turn after turn (each sees the
target's own earlier answers). A conversation whose prompt outgrows
[stages.prepare] seq_length stops there (prepare would cut it anyway).
Conversations go in chunks, each saved atomically, so a killed stage redoes
at most the chunk it was in; rows that fail are listed with the reason.
Without a usable vLLM the stage is skipped and says why.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import RegenerateSection
from pipeline.data.chat_mask import RowError, normalize, wire_messages
from pipeline.data.rows import iter_raw, regenerated_rows
from pipeline.drive.stage_context import Skipped, StageContext, StageError, main_for
from pipeline.extract import shared_server
from pipeline.model.info import kv_bytes_per_token, read_model
from pipeline.run.events import EventType
from pipeline.run.summaries import RegenerateSummary
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.compat import SKIP_KEY
from pipeline.vllm.environment import probe
from pipeline.vllm.server import make_server, server_log, serving

MAX_LISTED = 50
# a conversation the server answered with an HTTP error: not the conversation's
# fault (a wrong key, an overloaded server), so a resume asks again
REFUSED = "the server refused it"
DEFAULT_CHUNK = RegenerateSection.chunk_size


def conversations(ctx: StageContext):
    """(row number, messages or RowError) of [data], at most max_samples."""
    limit = ctx.cfg.data.max_samples or None
    for k, (n, obj) in enumerate(iter_raw(ctx.cfg.data_path())):
        if limit is not None and k >= limit:
            return
        try:
            if isinstance(obj, RowError):
                raise obj
            kind, *rest = normalize(obj, ctx.cfg.data.format)
            if kind != "messages":
                raise RowError("pre-tokenized rows have no conversation to regenerate")
            yield n, {"messages": rest[0], "tools": rest[1]}
        except RowError as e:
            yield n, e


def regenerate_one(server, model: str, conv: dict, sec, limit: int) -> list[dict]:
    """The target's answers to one conversation: one row each. It answers
    wherever the recorded assistant answered in text after a user or tool
    turn, and after a final user turn; recorded tool calls stay as they are
    (the target cannot run the tools: the calls and their results are
    context for the answers after them), as does an assistant turn that
    opens the conversation."""
    rows, prefix, tools = [], [], conv["tools"]
    msgs = conv["messages"]
    for k, m in enumerate(msgs):
        answers_here = m["role"] == "assistant" and not m.get("tool_calls") and \
            bool(prefix) and prefix[-1]["role"] in ("user", "tool")
        if not answers_here:
            prefix.append(m)
            if not (m["role"] == "user" and k == len(msgs) - 1):
                continue
        row = _answer(server, model, prefix, tools, sec)
        prefix = list(row["messages"])   # a copy: the row keeps its own conversation
        rows.append(row)
        if len(row["input_ids"]) >= limit:
            break   # prepare keeps seq_length tokens: later turns would be cut
    return rows


def _answer(server, model: str, prefix: list[dict], tools, sec) -> dict:
    """One answer of the target to `prefix`, as exact token ids."""
    body = {"model": model, "messages": wire_messages(prefix), "max_tokens": sec.max_tokens,
            "temperature": sec.temperature, "seed": sec.seed, "return_token_ids": True}
    if server.shared:   # the server it shares with extract captures: not these
        body["kv_transfer_params"] = {SKIP_KEY: True}
    if tools:   # in the prompt, as the template renders them; no tool parser needed
        body.update(tools=tools, tool_choice="none")
    resp = server.post(vs.ROUTE_CHAT, body, sec.request_timeout_s)
    choice = resp["choices"][0]
    prompt, out = resp.get("prompt_token_ids"), choice.get("token_ids")
    if prompt is None or out is None:
        raise StageError("the vLLM server answers without token ids",
                         hint="regenerate needs a vLLM whose chat API takes "
                              "return_token_ids (vLLM >= 0.11)")
    answer = choice["message"].get("content") or ""
    return {"input_ids": prompt + out, "loss_mask": [0] * len(prompt) + [1] * len(out),
            "messages": prefix + [{"role": "assistant", "content": answer}]}


def retryable(e: OSError) -> bool:
    """An error a resume may not get again: the server's state, not the
    conversation (a wrong key 401/403, too many requests 429, a server error
    5xx, no connection). A 400 (a prompt over max_model_len) is the
    conversation's own, and would come again."""
    code = getattr(e, "code", None)
    return code is None or code in (401, 403, 408, 429) or code >= 500


def run_chunk(server, model: str, items: list, sec, limit: int, should_stop) -> dict:
    """Regenerate a chunk's conversations (`concurrency` at a time)."""
    work: queue.Queue = queue.Queue()
    for item in items:
        work.put(item)
    results: dict[int, list] = {}
    failed: list[tuple[int, str]] = []
    fatal: list[BaseException] = []
    lock = threading.Lock()

    def client():
        while not fatal and not should_stop():
            try:
                n, conv = work.get_nowait()
            except queue.Empty:
                return
            if isinstance(conv, RowError):
                with lock:
                    failed.append((n, str(conv)))
                continue
            try:
                rows = regenerate_one(server, model, conv, sec, limit)
            except StageError as e:
                fatal.append(e)
                return
            except OSError as e:   # HTTP errors: this conversation only, unless the server died
                if server.died() is not None:
                    fatal.append(server.died())
                    return
                with lock:
                    failed.append((n, f"{REFUSED} ({e})" if retryable(e) else
                                   f"the server rejected it ({e})"))
                continue
            with lock:
                results[n] = [dict(r, source=n) for r in rows]

    threads = [threading.Thread(target=client, daemon=True)
               for _ in range(min(sec.concurrency, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if fatal:
        raise fatal[0]
    return {"rows": [r for n in sorted(results) for r in results[n]], "failed": sorted(failed)}


@dataclass
class Chunks:
    """The conversations in chunks of `chunk_size`, each saved as it is regenerated."""
    folder: Path
    parts: list[list]
    todo: list[int]   # the chunks not saved yet

    def path(self, k: int) -> Path:
        return self.folder / f"chunk_{k:06d}.json"


def split_chunks(ctx: StageContext, items: list) -> Chunks:
    """The chunks, and which of them to (re)do: the unsaved ones, and the saved
    ones with conversations the server refused (after the cause is fixed, a
    resume would otherwise keep the refusals for ever)."""
    size = ctx.section.chunk_size
    # chunk k is conversations [k*size, (k+1)*size): another size, another folder (the
    # default's is the one runs made before chunk_size have)
    folder = ctx.out / (".chunks" if size == DEFAULT_CHUNK else f".chunks-{size}")
    folder.mkdir(exist_ok=True)
    parts = [items[i:i + size] for i in range(0, len(items), size)]
    chunks = Chunks(folder, parts, [])
    refused = [k for k in range(len(parts)) if refusals(chunks.path(k))]
    chunks.todo = [k for k in range(len(parts)) if not chunks.path(k).exists() or k in refused]
    if len(chunks.todo) < len(parts) or refused:
        print(f"regenerate: resuming, {len(parts) - len(chunks.todo)}/{len(parts)} chunks already "
              "done" + (f"; {len(refused)} saved chunk(s) asked again: the server refused "
                        f"{sum(refusals(chunks.path(k)) for k in refused)} of their "
                        "conversations last time" if refused else ""), flush=True)
    return chunks


def refusals(path: Path) -> int:
    """How many of a saved chunk's conversations the server refused (0: none,
    or not saved)."""
    try:
        failed = json.loads(path.read_text())["failed"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return sum(1 for _, why in failed if str(why).startswith(REFUSED))


def start_server(ctx: StageContext, env, devices: list):
    """The one vLLM server regenerate asks (not started yet): the run's
    shared server where the driver started one for regenerate and extract
    (pipeline.extract.shared_server), else its own."""
    sec, target = ctx.section, ctx.cfg.target_path()
    dtype = ctx.cfg.dtype_name(bool(devices))
    elem = 4 if dtype == "float32" else 2
    max_len = shared_server.regenerate_max_len(ctx.cfg)
    shared = shared_server.adopt("vLLM server (regenerate + extract)",
                                 report=lambda kind, f: ctx.events.emit(kind, **f),
                                 stall_after_s=sec.stall_after_s)
    if shared is not None:
        why = shared_server.check_adoptable(shared, max_len=max_len)
        if why is None:
            print(f"regenerate: on the run's shared server ({shared.url}): extract uses it "
                  "next, one target load for both", flush=True)
            return shared
        ctx.events.warning(f"the run's shared server is not used: {why}; regenerate starts "
                           "its own")
    return make_server(0, env, target, devices, server_log(ctx.run.stage_dir("regenerate"), 0),
                       dtype, max_len, ctx.cfg.model.trust_remote_code,
                       list(sec.server_args), sec.serve_command,
                       sec.concurrency * max_len,
                       kv_bytes_per_token(read_model(target), max(1, len(devices)), elem),
                       what="vLLM server (regenerate)",
                       report=lambda kind, f: ctx.events.emit(kind, **f),
                       stall_after_s=sec.stall_after_s)


def regenerate_todo(ctx: StageContext, server, chunks: Chunks, n_items: int) -> None:
    """Serve, and regenerate the chunks not saved yet, saving each."""
    sec, parts = ctx.section, chunks.parts
    model, limit = str(ctx.cfg.target_path()), ctx.cfg.stages.prepare.seq_length
    with serving(server, sec.startup_timeout_s, lambda: ctx.stop_requested,
                 ctx.cfg.runtime.term_grace_s):
        ctx.check_stop()
        t0 = time.time()
        done_before = sum(len(parts[k]) for k in range(len(parts)) if k not in chunks.todo)
        done = 0
        for k in chunks.todo:
            result = run_chunk(server, model, parts[k], sec, limit,
                               lambda: ctx.stop_requested)
            ctx.check_stop()   # a chunk cut short by a stop is not saved
            ctx.write_json(chunks.path(k), result)
            done += len(parts[k])
            ctx.progress(done_before + done, n_items, "conversations",
                         rate=done / (time.time() - t0))


def gather(ctx: StageContext, chunks: Chunks, n_items: int) -> tuple[list, list]:
    """Every chunk's rows; the conversations that failed listed in a warning."""
    rows, failed = [], []
    for k in range(len(chunks.parts)):
        part = json.loads(chunks.path(k).read_text())
        rows += part["rows"]
        failed += part["failed"]
    if failed:
        listed = "; ".join(f"row {n}: {r}" for n, r in failed[:10])
        ctx.events.warning(f"{len(failed)} of {n_items} conversations were not regenerated: "
                           f"{listed}" + (" ..." if len(failed) > 10 else ""),
                           hint="the others were; prepare uses what was regenerated",
                           rows=[{"row": n, "reason": r} for n, r in failed[:MAX_LISTED]])
    if not rows:
        raise StageError("no conversation could be regenerated",
                         hint=f"see {ctx.run.log_path('regenerate')}")
    return rows, failed


def write_rows(ctx: StageContext, rows: list[dict]) -> Path:
    """rows.jsonl, atomically, with its artifact event."""
    out = regenerated_rows(ctx.run)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    ctx.events.emit(EventType.ARTIFACT, path=str(out), kind="dataset", bytes=out.stat().st_size)
    return out


def body(ctx: StageContext) -> RegenerateSummary:
    env = probe(ctx.cfg.vllm_python())
    devices = ctx.cfg.stage_devices("regenerate")
    why = env.unusable(devices)
    if why:
        raise Skipped(f"{why}; prepare uses [data] as it is")
    items = list(conversations(ctx))
    if not items:
        raise StageError(f"{ctx.cfg.data_path()}: no conversations",
                         hint="check [data] path and max_samples")
    chunks = split_chunks(ctx, items)
    if chunks.todo:
        regenerate_todo(ctx, start_server(ctx, env, devices), chunks, len(items))
    rows, failed = gather(ctx, chunks, len(items))
    out = write_rows(ctx, rows)
    tokens = sum(sum(r["loss_mask"]) for r in rows)
    return RegenerateSummary(conversations=len(items), regenerated=len(items) - len(failed),
                             failed=len(failed), rows=len(rows), generated_tokens=tokens,
                             rows_file=str(out))


def main() -> None:
    main_for("regenerate", body)


if __name__ == "__main__":
    main()
