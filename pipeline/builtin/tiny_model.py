"""The built-in target: a tiny Llama-style model with random weights and a
real byte-level BPE tokenizer with a Llama-3-style chat template.

Built locally (no hub access), deterministically from a seed, once, into a
cache folder; the folder is a normal HF model folder that transformers, the
stages and speculators load like any other. Large enough that aux layer ids
[1, 2, 3] plus the last layer (4) are valid.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from pipeline.config import PROJECT_ROOT

VERSION = 1
SEED = 0
VOCAB_SIZE = 1024
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MODEL_CONFIG = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False,
    # Wider than the usual 0.02: a random model with near-uniform logits has no
    # greedy choice worth learning; this one has confident (if meaningless) ones.
    initializer_range=0.1,
)


def cache_dir() -> Path:
    base = os.environ.get("EAGLE_PANEL_CACHE") or (PROJECT_ROOT / ".cache")
    return Path(base) / "builtin" / f"tiny-llama-v{VERSION}"


def _corpus():
    from pipeline.builtin import conversations_path
    with open(conversations_path(), encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["content"]


def _build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return fast


def _build_model(out: Path, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def ensure_built() -> Path:
    """The model folder, built on first use (safe against concurrent callers)."""
    final = cache_dir()
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
        tokenizer = _build_tokenizer(tmp)
        _build_model(tmp, tokenizer)
        os.replace(tmp, final)
    return final


if __name__ == "__main__":
    print(ensure_built())
