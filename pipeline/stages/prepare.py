"""Stage 1, prepare: conversations -> the target's chat template -> token ids
with assistant-only loss masks, in speculators' layout:

    prepare/out/data/            datasets Arrow dir: input_ids, loss_mask, seq_len (torch format)
    prepare/out/token_freq.pt    {token_id: count} over loss-masked tokens (a pickled dict)

Input rows are processed in chunks, each saved atomically under out/.chunks,
so a killed stage resumes at the first unfinished chunk.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.chat_mask import EndpointRenderer, LocalRenderer, RowError, normalize
from pipeline.data.rows import count_rows, iter_raw, regenerated_rows
from pipeline.drive.stage_context import StageContext, StageError, main_for
from pipeline.model.info import read_model
from pipeline.run.events import EventType
from pipeline.run.summaries import PrepareSummary

CHUNK_ROWS = 200
MAX_LISTED = 50


def load_tokenizer(ctx: StageContext):
    from transformers import AutoTokenizer
    target = ctx.cfg.target_path()
    try:
        return AutoTokenizer.from_pretrained(str(target),
                                             trust_remote_code=ctx.cfg.model.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        # a tokenizer that is code in the model folder (auto_map) fails without
        # trust_remote_code in ways that do not always say so (Kimi's:
        # "Couldn't instantiate the backend tokenizer")
        remote = read_model(target).needs_remote_code if (target / "config.json").exists() \
            else False
        if "trust_remote_code" in msg or (remote and not ctx.cfg.model.trust_remote_code):
            raise StageError(f"the tokenizer of {target} runs custom code",
                             hint="set [model] trust_remote_code = true in config.toml "
                                  "if you trust this model") from None
        raise StageError(f"cannot load the tokenizer of {target}: {msg.splitlines()[0]}",
                         hint="[model] target must be a local HF model folder") from None


def process_chunk(rows, renderer, seq_length: int, fmt: str):
    ids_out, mask_out, skipped = [], [], []
    for n, obj in rows:
        try:
            if isinstance(obj, RowError):
                raise obj
            kind, *rest = normalize(obj, fmt)
            if kind == "tokenized":
                made = [rest]
            else:
                made = [(r.input_ids, r.loss_mask)
                        for r in renderer.rows(*rest, limit=seq_length)]
            kept = 0
            for ids, mask in made:
                ids, mask = ids[:seq_length], mask[:seq_length]
                if sum(mask):
                    ids_out.append(ids)
                    mask_out.append(mask)
                    kept += 1
            if not kept:
                raise RowError(f"no assistant tokens within seq_length={seq_length}")
        except RowError as e:
            skipped.append((n, str(e)))
    return {"input_ids": ids_out, "loss_mask": mask_out, "skipped": skipped}


@dataclass(frozen=True)
class Source:
    """Where prepare reads its rows: a path, its format and the row limit."""
    path: Path
    fmt: str
    limit: int | None


def pick_source(ctx: StageContext) -> Source:
    regenerated = regenerated_rows(ctx.run)
    if ctx.cfg.enabled("regenerate") and regenerated.exists():
        # The target's own answers, as token ids (max_samples was applied there).
        print(f"prepare: reading the target's regenerated answers, {regenerated}", flush=True)
        return Source(regenerated, "tokenized", None)
    return Source(ctx.cfg.data_path(), ctx.cfg.data.format, ctx.cfg.data.max_samples or None)


def make_renderer(ctx: StageContext):
    sec = ctx.section
    if sec.render_endpoint:
        renderer = EndpointRenderer(sec.render_endpoint, sec.render_timeout_s)
        try:
            renderer.ids([{"role": "user", "content": "ping"}], True)
        except ConnectionError as e:
            raise StageError(f"render endpoint unusable: {e}",
                             hint="start the vLLM server, or set [stages.prepare] "
                                  "render_endpoint = \"\" to use the local chat template") from None
        return renderer
    try:
        return LocalRenderer(load_tokenizer(ctx))
    except ValueError as e:
        raise StageError(f"{ctx.cfg.target_path()}: {e}",
                         hint="add a chat_template to the tokenizer, or use "
                              "render_endpoint with a vLLM server") from None


def chunk_path(chunk_dir: Path, k: int) -> Path:
    return chunk_dir / f"chunk_{k:06d}.pt"


def tokenize_chunks(ctx: StageContext, src: Source, renderer, chunk_dir: Path) -> tuple[int, int]:
    """Render the source's rows chunk by chunk, skipping chunks already saved;
    returns (chunks, rows seen)."""
    import torch
    total = count_rows(src.path)
    if src.limit:
        total = min(total, src.limit)
    chunk_dir.mkdir(exist_ok=True)
    n_chunks = (total + CHUNK_ROWS - 1) // CHUNK_ROWS
    done_before = sum(1 for k in range(n_chunks) if chunk_path(chunk_dir, k).exists())
    if done_before:
        print(f"prepare: resuming, {done_before}/{n_chunks} chunks already done", flush=True)

    buf, k, seen = [], 0, 0
    for n, obj in iter_raw(src.path):
        if seen >= total:
            break
        seen += 1
        buf.append((n, obj))
        if len(buf) == CHUNK_ROWS or seen == total:
            path = chunk_path(chunk_dir, k)
            if not path.exists():
                ctx.check_stop()
                try:
                    result = process_chunk(buf, renderer, ctx.section.seq_length, src.fmt)
                except ConnectionError as e:
                    raise StageError(f"render endpoint failed: {e}",
                                     hint="check the vLLM server; resume continues here") from None
                tmp = path.with_suffix(".tmp")
                torch.save(result, tmp)
                os.replace(tmp, path)
            ctx.progress(seen, total, "rows", done_before=done_before * CHUNK_ROWS)
            buf, k = [], k + 1
    return k, seen


def gather_chunks(chunk_dir: Path, k: int) -> tuple[list, list, list]:
    import torch
    ids, masks, skipped = [], [], []
    for j in range(k):
        part = torch.load(chunk_path(chunk_dir, j), weights_only=True)
        ids += part["input_ids"]
        masks += part["loss_mask"]
        skipped += part["skipped"]
    return ids, masks, skipped


def check_rows(ctx: StageContext, src: Path, seen: int, ids: list, skipped: list) -> None:
    """Warn about the skipped rows; fail when nothing usable is left."""
    if skipped:
        reasons = Counter(reason.split(" (")[0] for _, reason in skipped)
        where = "line" if src.is_file() else "row"
        listed = "; ".join(f"{where} {n}: {r}" for n, r in skipped[:10])
        ctx.events.warning(
            f"skipped {len(skipped)} of {seen} rows in {src.name}: {listed}"
            + (" ..." if len(skipped) > 10 else ""),
            hint="fix or drop those rows; the rest were used",
            rows=[{where: n, "reason": r} for n, r in skipped[:MAX_LISTED]],
            counts=dict(reasons))
    if not seen:
        raise StageError(f"{src} is empty", hint="check [data] path: a JSONL file with one "
                         "conversation per line, or a datasets folder")
    if not ids:
        raise StageError(
            f"no usable rows in {src}: all {seen} rows were skipped "
            f"({', '.join(f'{v}x {r}' for r, v in Counter(r for _, r in skipped).most_common(3))})",
            hint="check [data] path and format: JSONL with `messages` (OpenAI) or "
                 "`conversations` (ShareGPT), each with at least one assistant turn")


def write_token_freq(out: Path, ids, masks) -> Counter:
    import torch
    freq = Counter()
    for row, mask in zip(ids, masks, strict=True):
        freq.update(t for t, m in zip(row, mask, strict=True) if m)
    tmp = out / ".token_freq.pt.tmp"
    torch.save(dict(freq), tmp)
    os.replace(tmp, out / "token_freq.pt")
    return freq


def body(ctx: StageContext) -> PrepareSummary:
    src = pick_source(ctx)
    renderer = make_renderer(ctx)
    chunk_dir = ctx.out / ".chunks"
    k, seen = tokenize_chunks(ctx, src, renderer, chunk_dir)
    ids, masks, skipped = gather_chunks(chunk_dir, k)
    check_rows(ctx, src.path, seen, ids, skipped)

    write_dataset(ctx.out / "data", ids, masks)
    freq = write_token_freq(ctx.out, ids, masks)
    n_tokens = sum(len(r) for r in ids)
    n_masked = sum(sum(m) for m in masks)
    summary = PrepareSummary(rows_in=seen, samples=len(ids), skipped_rows=len(skipped),
                             tokens=n_tokens, supervised_tokens=n_masked,
                             distinct_tokens=len(freq), max_seq_len=max(len(r) for r in ids),
                             data=str(ctx.out / "data"))
    ctx.write_json(ctx.out / "summary.json", summary.to_json())
    ctx.events.emit(EventType.ARTIFACT, path=str(ctx.out / "data"), kind="dataset",
                    bytes=sum(p.stat().st_size for p in (ctx.out / "data").rglob("*") if p.is_file()))
    return summary


def write_dataset(final: Path, ids, masks, seed: int = 0) -> None:
    """Save the Arrow dataset atomically: build beside it, then rename."""
    import shutil

    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": masks,
                            "seq_len": [len(r) for r in ids]})
    ds = ds.shuffle(seed=seed).flatten_indices()
    ds.set_format(type="torch")
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)


def main() -> None:
    main_for("prepare", body)


if __name__ == "__main__":
    main()
