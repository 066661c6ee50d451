"""How much to train: a budget that follows the data, and when to stop.

A fixed epoch count is right for one dataset only. On small data the draft
is short of optimizer steps, not of passes: speculators' own prepare-data
makes a row per assistant turn, so at the same `total_seq_len` their trainer
takes ~1.7x our steps over the same supervised tokens, and on the bundled
data ours at 302 steps measured acceptance 2.09 against 2.86 at 567 steps
(total_seq_len 300; docs/benchmarks.md). On the CPU a step's cost follows
its tokens, so fewer tokens a step cost no time: the rule lowers
`total_seq_len` until `PLANNED_PASSES` passes give `target_steps`, then
takes the epochs that reach it (capped by `max_epochs`, never below the
floor `min_steps`). Big data keeps big steps (up to speculators' 8192) and
needs one pass or few. `epochs = N` / `total_seq_len = N` override either.

The steps an epoch takes are counted by speculators' own packer
(MultipackDistributedBatchSamplerV2, as its dataloader builds it), so the
plan is the trainer's, not a guess; past `EXACT_ROWS` rows (where packing
costs seconds) the count is estimated from the tokens. speculators' LR
schedule then warms up and decays over epochs x the real batches of its
loader: the planned steps.

The plateau stop (`plateau_reason`) ends training when train's acceptance
estimate has gained less than `min_delta` over the last `patience` epochs.
It is decided after an epoch's checkpoint and validation are written, from
a history kept on disk (pipeline.train.in_process.plateau_watch), so a kill or resume at any
point neither loses an epoch's figure nor trains past a stop already
decided. Stopping inside speculators' own epoch loop (an exception raised
after its validation, caught around `run_training`) beats running epochs in
resumable chunks: one trainer, one dataloader, one LR schedule, and the
checkpoint it leaves is the last complete epoch's, exactly as a kill's is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.run.rundir import atomic_write_bytes

# Passes over the data the rule plans on before it adds epochs: the demo
# measured 4 passes at 512 tokens beating 6 at 1024 (3.36 vs 3.01).
PLANNED_PASSES = 4
SEQ_STEP = 64          # total_seq_len candidates: multiples of this
SEQ_MAX = 8192         # speculators' default total_seq_len: the largest the rule picks
EXACT_ROWS = 50_000    # beyond this many rows the steps per epoch are estimated
PACKING = 0.9          # the share of a step's tokens packing fills, when estimated


@dataclass(frozen=True)
class Budget:
    """The plan: what the trainer is given, and why, in words."""
    epochs: int
    total_seq_len: int
    steps_per_epoch: int
    auto: bool                # the rule chose the epochs (the plateau stop applies)
    why: str

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch


def estimated_steps(lengths: Sequence[int], seq_len: int, replicas: int = 1) -> int:
    """Steps an epoch takes, from the tokens (samples longer than a step truncated)."""
    tokens = sum(min(n, seq_len) for n in lengths)
    return max(1, math.ceil(tokens / (seq_len * replicas * PACKING)))


def packed_steps(lengths: Sequence[int], seq_len: int, replicas: int = 1, seed: int = 0) -> int:
    """Steps an epoch takes as speculators packs it (its sampler, epoch 0)."""
    if len(lengths) > EXACT_ROWS:
        return estimated_steps(lengths, seq_len, replicas)
    import warnings

    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    with warnings.catch_warnings():   # "samples longer than batch_max_length": said by the trainer
        warnings.simplefilter("ignore")
        sampler = MultipackDistributedBatchSamplerV2(seq_len, list(lengths), replicas, 0,
                                                     seed=seed)
    return max(1, len(sampler))


def seq_len_candidates(longest: int, cap: int = SEQ_MAX) -> list[int]:
    """total_seq_len values the rule may pick: multiples of SEQ_STEP from the
    longest sample (none truncated) up to `cap`."""
    low = max(SEQ_STEP, math.ceil(longest / SEQ_STEP) * SEQ_STEP)
    return list(range(low, max(low, cap) + 1, SEQ_STEP))


def choose_seq_len(lengths: Sequence[int], target_steps: int,
                   count: Callable[[int], int]) -> int:
    """The largest candidate at which PLANNED_PASSES epochs reach
    `target_steps` (fewer, bigger steps where the data allows: better on a
    GPU, the same cost on a CPU); the smallest when none does. The steps an
    epoch takes fall as total_seq_len grows: binary search."""
    cands = seq_len_candidates(max(lengths))
    if count(cands[0]) * PLANNED_PASSES < target_steps:
        return cands[0]
    if count(cands[-1]) * PLANNED_PASSES >= target_steps:
        return cands[-1]                 # big data: the biggest steps reach it
    lo, hi = 0, len(cands) - 1          # count(cands[lo]) reaches the target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(cands[mid]) * PLANNED_PASSES >= target_steps:
            lo = mid
        else:
            hi = mid - 1
    return cands[lo]


def choose_epochs(steps_per_epoch: int, target_steps: int, min_steps: int,
                  max_epochs: int) -> tuple[int, str]:
    """(epochs, why): those that reach `target_steps`, at most `max_epochs`,
    but never fewer than the floor `min_steps` needs."""
    want = max(1, math.ceil(target_steps / steps_per_epoch))
    epochs = min(want, max_epochs)
    why = f"{plural(epochs, 'epoch')} x {steps_per_epoch} steps reach the target of {target_steps}"
    if epochs < want:
        why = f"max_epochs {max_epochs} caps the target of {target_steps} steps"
    floor = math.ceil(min_steps / steps_per_epoch)
    if epochs * steps_per_epoch < min_steps:
        epochs = floor
        why = (f"the floor of {min_steps} steps needs {plural(floor, 'epoch')} of "
               f"{steps_per_epoch} steps (small data)")
    return epochs, why


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def plan(lengths: Sequence[int], *, epochs: int = 0, total_seq_len: int = 0,
         target_steps: int = 2400, min_steps: int = 300, max_epochs: int = 20,
         count: Callable[[int], int] | None = None) -> Budget:
    """The training budget for samples of these token `lengths` (the train
    split). `epochs` / `total_seq_len` > 0 are the user's and kept; 0 lets
    the rule choose. `count(seq_len)` gives the steps an epoch takes
    (default: speculators' packer, one replica)."""
    if not lengths:
        raise ValueError("no training samples to plan a budget for")
    count = count or (lambda s: packed_steps(lengths, s))
    seq = total_seq_len or choose_seq_len(lengths, target_steps, count)
    per_epoch = count(seq)
    seq_why = f"total_seq_len {seq}" + ("" if total_seq_len else " (chosen)")
    if epochs:
        return Budget(epochs, seq, per_epoch, False,
                      f"epochs = {epochs} set: {epochs * per_epoch} steps at {seq_why}")
    n, why = choose_epochs(per_epoch, target_steps, min_steps, max_epochs)
    return Budget(n, seq, per_epoch, True, f"{why}: {n * per_epoch} steps at {seq_why}")


def plateau_reason(history: Sequence[tuple[int, float]], patience: int,
                   min_delta: float) -> str | None:
    """Why to stop now, or None: the best estimate of `history` ((epoch,
    estimate) in order, epochs 0-based) gained less than `min_delta`
    (relative) over its last `patience` epochs."""
    if patience <= 0 or len(history) <= patience:
        return None
    values = [v for _, v in history]
    before, now = max(values[:-patience]), max(values)
    gain = now / before - 1 if before > 0 else math.inf
    if gain >= min_delta:
        return None
    epoch, last = history[-1]
    return (f"plateau at epoch {epoch + 1}: estimate {last:.2f}, {gain:+.1%} over "
            f"{plural(patience, 'epoch')}")


class PlateauWatch:
    """The estimate after each epoch, kept in `path` (JSON, written
    atomically by global rank 0 before any stop is acted on), and the
    plateau decision from it. A resume reloads it: epochs the trainer redoes
    are replaced, and a stop already decided stays decided."""

    def __init__(self, path, patience: int, min_delta: float, writer: bool = True):
        self.path, self.patience, self.min_delta, self.writer = path, patience, min_delta, writer
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        self.history = [(int(e), float(v)) for e, v in saved.get("history", [])]
        self.stopped = saved.get("stopped")           # {"epoch": e, "reason": ...} or None

    def stopped_before(self, epoch: int) -> bool:
        """A stop decided at an epoch before `epoch` (where a resume starts)."""
        return bool(self.stopped) and self.stopped["epoch"] < epoch

    def update(self, epoch: int, estimate: float | None) -> str | None:
        """Record epoch `epoch`'s estimate; the reason to stop now, or None."""
        if estimate is None:
            return None
        self.history = [(e, v) for e, v in self.history if e < epoch] + [(epoch, estimate)]
        reason = plateau_reason(self.history, self.patience, self.min_delta)
        self.stopped = {"epoch": epoch, "reason": reason} if reason else None
        self.save()
        return reason

    def top_epoch(self) -> int | None:
        """The epoch with the highest estimate (the later on a tie)."""
        return max(reversed(self.history), key=lambda ev: ev[1])[0] if self.history else None

    def best_epoch(self) -> int | None:
        """The trained draft's epoch: the latest whose estimate is within
        `min_delta` (relative) of the highest. It is the plateau rule's own
        tolerance: estimates closer than that are not told apart (the rule
        stops on them), and the later epoch has trained more steps. On the
        bench's data (vs_speculators at its defaults, 2026-12-07) the highest
        estimate named epoch 10 of 12 (3.441; epochs 11 and 12: 3.430, 3.440),
        which vLLM measured at 3.189, and epochs 11 and 12 at 3.246 and 3.226."""
        if not self.history:
            return None
        top = max(v for _, v in self.history)
        return max(e for e, v in self.history if v * (1 + self.min_delta) >= top)

    def save(self) -> None:
        if not self.writer:
            return
        atomic_write_bytes(self.path, json.dumps({
            "history": self.history, "stopped": self.stopped, "patience": self.patience,
            "min_delta": self.min_delta}, indent=1).encode() + b"\n")
