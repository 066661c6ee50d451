"""The `speculators train` flags that decide what draft is made, in one
place: the train stage passes them (pipeline/stages/train.py, with its data,
checkpoint and schedule flags), and doctor asks speculators about the same
ones before training (pipeline/train/draft_stand_in.py)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.train import algorithms


def algorithm_flags(sec) -> list[str]:
    """`--speculator-type` and the flags `[stages.train] algorithm` needs
    (pipeline.train.algorithms), its loss weights, per-position decay and
    learning-rate schedule; nothing for plain EAGLE-3 at speculators' defaults."""
    algo = algorithms.get(sec.algorithm)
    flags = [] if algo.name == "eagle3" else ["--speculator-type", algo.speculator_type,
                                              *algo.flags]
    if algo.block and sec.block_size:
        flags += ["--block-size", str(sec.block_size)]
    if sec.loss_weights:
        weights = dict(sec.loss_weights)
        alone = next(iter(weights)) if len(weights) == 1 and set(weights.values()) == {1.0} \
            else None
        flags += ["--loss-fn", alone or json.dumps(weights)]
    if sec.position_decay:
        flags += [algo.decay_flag, str(sec.position_decay)]
    if sec.lr_schedule != "auto":
        flags += ["--scheduler-type", sec.lr_schedule]
    return flags


def draft_flags(cfg, layer_ids: list[int], mask_token: int | None) -> list[str]:
    """The target, the draft vocabulary's size (none for an algorithm on the
    target's whole vocabulary), the layers read, the draft's depth and steps,
    the algorithm's own flags, remote code and a mask token found for a
    wrapped target (pipeline/stages/train.py: wrapper_mask_token)."""
    sec = cfg.stages.train
    flags = ["--verifier-name-or-path", str(cfg.target_path())]
    if not algorithms.get(sec.algorithm).full_vocab:
        flags += ["--draft-vocab-size", str(cfg.stages.vocab.draft_vocab_size)]
    flags += ["--target-layer-ids", *map(str, layer_ids),
              "--num-layers", str(algorithms.num_layers(sec)), "--ttt-steps", str(sec.ttt_steps),
              *algorithm_flags(sec)]
    if cfg.model.trust_remote_code:
        flags.append("--trust-remote-code")
    if mask_token is not None:
        flags += ["--mask-token-id", str(mask_token)]
    return flags


def wrapper_mask_token(target: Path, trust_remote_code: bool) -> int | None:
    """speculators 0.9 finds its mask token through the verifier's
    AutoProcessor; a multimodal wrapper's (Kimi-K2.5's) also builds its image
    processor, which needs torchvision — not installable beside a CPU torch,
    and not needed for text. For such a target the token is found here the
    way speculators would from the tokenizer (its mask token, else pad,
    eos, unk) and passed as --mask-token-id; other targets are left to
    speculators."""
    from pipeline.model.info import read_model
    if not read_model(target).wrapped:
        return None
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    for token_id in (tok.mask_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id):
        if token_id is not None:
            return int(token_id)
    return None
