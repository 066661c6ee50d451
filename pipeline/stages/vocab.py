"""Stage 3, vocab: the draft's vocabulary from the prepared token frequencies.

    vocab/out/d2t-{N}.npy   int64 [N]: target id = draft id + d2t[draft id]
    vocab/out/t2d-{N}.npy   bool [target vocab]: whether a target token is in the draft vocab

Built by speculators' own `build_vocab_mappings_from_distribution`, saved
under the file names its trainer looks for next to the data.
"""

from __future__ import annotations

import io
from pathlib import Path

from pipeline.run.events import EventType
from pipeline.run.rundir import atomic_write_bytes
from pipeline.run.stage_context import StageContext, StageError, main_for


def save_npy(path: Path, array) -> None:
    import numpy as np
    buf = io.BytesIO()
    np.save(buf, array)
    atomic_write_bytes(path, buf.getvalue())


def body(ctx: StageContext) -> dict:
    import torch
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        get_target_vocab_size,
    )

    freq_path = ctx.out_of("prepare") / "token_freq.pt"
    if not freq_path.exists():
        raise StageError(f"{freq_path} is missing", hint="run the prepare stage first")
    freq = torch.load(freq_path, weights_only=True)
    if not isinstance(freq, dict) or not freq:
        raise StageError(f"{freq_path} holds no token frequencies",
                         hint="re-run prepare with --force")
    target_vocab = get_target_vocab_size(None, str(ctx.cfg.target_path()),
                                         trust_remote_code=ctx.cfg.model.trust_remote_code)
    n = ctx.section.draft_vocab_size
    if n > target_vocab:
        raise StageError(
            f"[stages.vocab] draft_vocab_size = {n} is larger than the target's vocabulary "
            f"({target_vocab})", hint=f"set draft_vocab_size to at most {target_vocab}")
    d2t, t2d = build_vocab_mappings_from_distribution(freq, n, target_vocab)
    draft_ids = (torch.arange(n) + d2t).tolist()
    total = sum(freq.values())
    covered = sum(freq.get(t, 0) for t in draft_ids)
    coverage = covered / total
    save_npy(ctx.out / f"d2t-{n}.npy", d2t.numpy())
    save_npy(ctx.out / f"t2d-{n}.npy", t2d.numpy())
    if len(freq) < n:
        ctx.events.warning(
            f"only {len(freq)} distinct tokens were supervised, fewer than draft_vocab_size={n}; "
            "the rest of the draft vocabulary is filled with the lowest token ids",
            hint="use more data, or a smaller draft_vocab_size")
    if coverage < 0.95:
        ctx.events.warning(f"the draft vocabulary covers {coverage:.1%} of supervised tokens",
                           hint="a larger draft_vocab_size raises coverage")
    for kind, name in (("d2t", f"d2t-{n}.npy"), ("t2d", f"t2d-{n}.npy")):
        p = ctx.out / name
        ctx.events.emit(EventType.ARTIFACT, path=str(p), kind=kind, bytes=p.stat().st_size)
    summary = {"draft_vocab_size": n, "target_vocab_size": target_vocab,
               "distinct_supervised_tokens": len(freq), "coverage": round(coverage, 6),
               "d2t": str(ctx.out / f"d2t-{n}.npy"), "t2d": str(ctx.out / f"t2d-{n}.npy")}
    ctx.write_json(ctx.out / "summary.json", summary)
    return summary


def main() -> None:
    main_for("vocab", body)


if __name__ == "__main__":
    main()
