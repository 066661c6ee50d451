"""The draft algorithms speculators trains, as the pipeline runs each one.

One table, read by every stage that differs by algorithm, so that adding
one is a row here and not a branch in each stage: train's flags
(`--speculator-type` and the combinations speculators requires), which
draft layers it can use, the acceptance estimate from its own validation metrics, and how
vLLM serves it (the speculative config's method and keys).

Read from speculators 0.9 (train/config/schema.py, models/*/metrics.py) and
vLLM 0.32's speculators adapter:
- EAGLE-3 logs `full_acc_{i}`: position i right with every earlier one
  right, so 1 + sum is the greedy chain's expected acceptance.
- EAGLE-3.1 is EAGLE-3 with a per-layer norm of each aux hidden state
  (`--fc-norm`) and the post-norm state fed across TTT steps
  (`--norm-output`, eagle3's default); `--fc-norm` and the default
  `--norm-before-fc` are mutually exclusive ("norm_before_fc and fc_norm
  are mutually exclusive", models/eagle3/config.py): it needs
  `--no-norm-before-fc`. vLLM serves it as `eagle3`.
- P-EAGLE drafts every position in one pass (`parallel_drafting`) and logs
  only `position_{d}_acc`, each depth's accuracy on its own: the chain's
  estimate is their running product, which understates (errors correlate).
- DFlash logs `eal`, the mean accepted run per block plus the bonus token,
  over its block of `block_size` - 1 drafted tokens; vLLM serves at most
  that many (`num_speculative_tokens` <= block_size - 1). Its
  `position_{p}_acc` count from 1; its default per-position weight (DPACE)
  needs the cross-entropy loss alone.
- DSpark is DFlash with a Markov head and a confidence head; it logs `eal`
  too, over all `block_size` tokens (it samples from the anchor).
- DFlash2 is DFlash with a local convolution and a candidate selector over
  the unary head's top-K: its `eal` is the selector's greedy path (the
  target in the unary top-K). It needs the target's whole vocabulary
  ("DFlash2 currently requires the full verifier vocabulary",
  models/dflash2/core.py): no d2t/t2d, so the vocab stage is off. vLLM's
  speculators adapter serves it as method `dflash` with its own
  architecture, which Model Runner V1 refuses ("DFlash candidate-head
  drafts", VllmConfig._is_dflash_candidate_draft).
- The layers: `[stages.train] num_layers` 0 (the default) is speculators'
  own per algorithm, 1 for the EAGLE-3 family and P-EAGLE, 5 for the DFlash
  family (train/config/schema.py); `loss_weights` is speculators'
  `--loss-fn`; `position_decay` its per-position weight (EAGLE-3's TTT-step
  decay, the DFlash family's decay gamma).
- P-EAGLE trains `num_depths` depths (speculators' default 8, not passed):
  an estimate over more served tokens than that has no metrics.
The others speculators trains are named with why the pipeline does not run
them yet, so a config naming one is refused with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


def eagle3_estimate(val: Mapping, positions: int) -> float | None:
    """Greedy-chain estimate: 1 + the full accuracies of the first `positions`."""
    accs = [val.get(f"full_acc_{i}") for i in range(positions)]
    if not accs or any(a is None for a in accs):
        return None
    return 1.0 + sum(accs)


def chain_of_depths(val: Mapping, positions: int) -> float | None:
    """1 + sum over k of the product of depth 0..k's own accuracies
    (`position_{d}_acc`): P-EAGLE's chain, assuming independent depths."""
    accs = [val.get(f"position_{d}_acc") for d in range(positions)]
    if not accs or any(a is None for a in accs):
        return None
    total, run = 1.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total


def expected_accepted_length(val: Mapping, positions: int) -> float | None:
    """DFlash's own `eal`: its block's accepted run + the bonus token, over
    the block's `block_size` - 1 drafted tokens. Not capped at 1 + the
    tokens vLLM is asked to draft: a cap would flatten every later epoch to
    the same figure (the plateau stop would end a draft still improving,
    and the first epoch at the cap would be chosen); where vLLM drafts
    fewer than the block, it measures less. Below 1 (speculators' figure
    for an empty validation set) is no estimate."""
    eal = val.get("eal")
    if eal is None or (isinstance(eal, float) and math.isnan(eal)) or eal < 1.0:
        return None
    return float(eal)


@dataclass(frozen=True)
class Algorithm:
    name: str                      # [stages.train] algorithm
    speculator_type: str           # speculators' --speculator-type
    estimate: Callable[[Mapping, int], float | None]
    estimate_from: str             # the metrics it reads, in words (train's summary)
    flags: tuple[str, ...] = ()    # more `speculators train` flags it needs
    vllm_method: str = "eagle3"    # the speculative config's method
    vllm_extra: Mapping = field(default_factory=dict)   # more speculative-config keys
    eagle3_layers: bool = True     # its draft is EAGLE-3's (a Llama or our MLA layer)
    title: str = ""                # as papers and model cards write it
    block: int = 0                 # a block drafter's default block (speculators'); 0: none
    from_anchor: bool = False      # it drafts the block's anchor too: block tokens, not block - 1
    layers: int = 1                # speculators' default --num-layers for it
    full_vocab: bool = False       # it trains on the target's whole vocabulary: no vocab stage
    # the draft's architecture as vLLM reads it, where vLLM refuses by architecture
    # (a candidate-head draft under Model Runner V1); () where the method decides
    architectures: tuple[str, ...] = ()
    # the flag of its per-position loss weight ([stages.train] position_decay); "" none
    decay_flag: str = ""

    def most_drafted(self, block_size: int = 0) -> int:
        """How many tokens vLLM drafts at most from one block (`block_size`,
        0: speculators' default): the block less its anchor, unless drafted too."""
        block = block_size or self.block
        return block if self.from_anchor else block - 1

    @property
    def display(self) -> str:
        return self.title or self.name


EAGLE3_DECAY = "--ttt-step-loss-decay"   # TTT step k weighs decay ** k
DFLASH_DECAY = "--dflash-decay-gamma"    # block position p weighs exp(-(p - 1) / gamma)

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("eagle3", "eagle3", eagle3_estimate, "1 + sum of full_acc_i", title="EAGLE-3",
              decay_flag=EAGLE3_DECAY),
    Algorithm("eagle3.1", "eagle3", eagle3_estimate, "1 + sum of full_acc_i",
              flags=("--fc-norm", "--no-norm-before-fc", "--norm-output"), title="EAGLE-3.1",
              decay_flag=EAGLE3_DECAY),
    Algorithm("peagle", "peagle", chain_of_depths,   # (depths: speculators' default 8)
              "1 + sum of running products of position_d_acc (depths taken as independent)",
              vllm_extra={"parallel_drafting": True}, eagle3_layers=False, title="P-EAGLE"),
    Algorithm("dflash", "dflash", expected_accepted_length,
              "speculators' eal (accepted run per block + the bonus token)",
              vllm_method="dflash", eagle3_layers=False, title="DFlash", block=16, layers=5,
              decay_flag=DFLASH_DECAY),
    # DFlash plus a Markov head over the block's earlier tokens and a
    # confidence head (models/dspark); it samples from the anchor (its
    # default), so it drafts all `block_size` tokens. vLLM serves it on
    # Model Runner V2 only: doctor and evaluate read which runner the
    # installed vLLM can give it (compat.draft_method_unservable).
    Algorithm("dspark", "dspark", expected_accepted_length,
              "speculators' eal (accepted run per block + the bonus token)",
              vllm_method="dspark", eagle3_layers=False, title="DSpark", block=8,
              from_anchor=True, layers=5, decay_flag=DFLASH_DECAY),
    # DFlash plus a local convolution and a candidate selector (models/dflash2);
    # vLLM serves it as `dflash`, refusing its architecture on Model Runner V1.
    Algorithm("dflash2", "dflash2", expected_accepted_length,
              "speculators' eal (the candidate selector's greedy path per block + the bonus "
              "token)", vllm_method="dflash", eagle3_layers=False, title="DFlash2", block=8,
              layers=5, full_vocab=True, architectures=("DFlash2DraftModel",),
              decay_flag=DFLASH_DECAY),
)}

# speculators' losses (losses/utils.py): `[stages.train] loss_weights` names some of these
LOSSES = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")

PEAGLE_DEPTHS = 8   # speculators' --num-depths default (not passed): the depths it logs

# What speculators also trains, and why the pipeline does not run it yet.
NOT_YET: dict[str, str] = {
    "xpress": "it logs no acceptance estimate to stop or choose by",
    "mtp": "it fine-tunes the target's own MTP module and logs losses only",
}


def get(name: str) -> Algorithm:
    return ALGORITHMS[name]


def num_layers(sec) -> int:
    """The draft's decoder layers: `[stages.train] num_layers`, or at 0
    speculators' own default for the algorithm."""
    return sec.num_layers or get(sec.algorithm).layers
