"""Stage 3, vocab: the draft's vocabulary from the prepared token frequencies.

    vocab/out/d2t-{N}.npy   int64 [N]: target id = draft id + d2t[draft id]
    vocab/out/t2d-{N}.npy   bool [target vocab]: whether a target token is in the draft vocab

Built by speculators' own `build_vocab_mappings_from_distribution`, saved
under the file names its trainer looks for next to the data.
"""

from __future__ import annotations

import io
from pathlib import Path

from pipeline.drive.stage_context import StageContext, StageError, main_for
from pipeline.run.events import EventType
from pipeline.run.rundir import atomic_write_bytes
from pipeline.run.summaries import VocabSummary


def save_npy(path: Path, array) -> None:
    import numpy as np
    buf = io.BytesIO()
    np.save(buf, array)
    atomic_write_bytes(path, buf.getvalue())


def speculators_vocab_mapping():
    """speculators' own `train/vocab_mapping.py`, loaded without the package's
    `__init__`, which imports every model speculators knows: 5-10 s on a CPU,
    most of this stage's wall, for a module that needs only torch, datasets and
    transformers. The plain import where the file is not there or does not load
    on its own (a release that moves it or makes it import relatively)."""
    import importlib.util
    import sys
    name = "speculators.train.vocab_mapping"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("speculators")
    where = spec and spec.submodule_search_locations
    path = Path(where[0]) / "train" / "vocab_mapping.py" if where else None
    if path is not None and path.is_file():
        alone = importlib.util.spec_from_file_location("_speculators_vocab_mapping", path)
        module = importlib.util.module_from_spec(alone)
        try:
            alone.loader.exec_module(module)
            return module
        except ImportError:
            pass
    import importlib
    return importlib.import_module(name)


def body(ctx: StageContext) -> VocabSummary:
    import torch
    mapping = speculators_vocab_mapping()
    build_vocab_mappings_from_distribution = mapping.build_vocab_mappings_from_distribution
    get_target_vocab_size = mapping.get_target_vocab_size

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
    summary = VocabSummary(draft_vocab_size=n, target_vocab_size=target_vocab,
                           distinct_supervised_tokens=len(freq), coverage=round(coverage, 6),
                           d2t=str(ctx.out / f"d2t-{n}.npy"), t2d=str(ctx.out / f"t2d-{n}.npy"))
    ctx.write_json(ctx.out / "summary.json", summary.to_json())
    return summary


def main() -> None:
    main_for("vocab", body)


if __name__ == "__main__":
    main()
