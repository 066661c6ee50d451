"""What building a built-in target takes, whichever it is: the bundled
conversations rendered with its own chat template (what it learns to
continue), a short deterministic training on them, and a cache folder made
once, atomically, safe against concurrent callers."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def training_tokens(tokenizer) -> list[int]:
    """The bundled conversations as the chat template renders them, one
    after another."""
    from pipeline.builtin import conversations_path
    ids: list[int] = []
    with open(conversations_path(), encoding="utf-8") as f:
        for line in f:
            text = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def fit(model, tokenizer, train: dict, seed: int, name: str = "", **forward) -> float:
    """Next-token loss on windows of the rendered conversations, cosine
    schedule after a warm-up; returns the last loss. `forward`: extra
    arguments of the model's forward. A line on stderr at each quarter
    (`name`: which target): a build takes a minute or more on a small CPU,
    and runs inside install.sh or the first stage that needs it."""
    import math
    import sys
    import time

    import torch
    data = torch.tensor(training_tokens(tokenizer), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=train["lr"], weight_decay=0.01)
    model.train()
    loss = torch.tensor(0.0)
    t0, quarter = time.monotonic(), max(1, train["steps"] // 4)
    for step in range(train["steps"]):
        lr = train["lr"] * min(1.0, (step + 1) / train["warmup"]) * 0.5 * (
            1 + math.cos(math.pi * step / train["steps"]))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - train["window"] - 1, (train["batch"],),
                               generator=gen)
        batch = torch.stack([data[s:s + train["window"]] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch, **forward).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % quarter == 0 and step + 1 < train["steps"]:
            print(f"built-in target {name}: training step {step + 1}/{train['steps']}, loss "
                  f"{float(loss.detach()):.3f}, {time.monotonic() - t0:.0f} s", file=sys.stderr,
                  flush=True)
    model.eval()
    return float(loss.detach())


def no_progress_bars() -> None:
    """A build says one line (stderr); transformers' "Writing model shards"
    bar would follow it in install.sh's output."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


@contextmanager
def deterministic(threads: int, fill_uninitialized: bool = True):
    """The same bytes on every build on a machine: one thread count (the
    reduction order), deterministic algorithms. fill_uninitialized=False
    spares deterministic mode's NaN-filling of every torch.empty (nothing
    reads uninitialized memory; it costs a tenth of a MoE model's step)."""
    import torch
    before = torch.get_num_threads()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.set_num_threads(before)


def ensure_built(final: Path, build) -> Path:
    """`final`, made by build(folder) into a temporary folder and renamed,
    on first use; concurrent callers wait for one build."""
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").exists():
            return final
        tmp = final.parent / f".{final.name}.building-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        build(tmp)
        os.replace(tmp, final)
    return final
