"""The built-in target: a tiny Llama-style model and a real byte-level BPE
tokenizer with a Llama-3-style chat template, *trained* on the bundled
conversations so that its greedy continuations are predictable — a draft
has something to learn, and the demo's measured acceptance length means
something (a random target gives ~1.0 whatever the draft).

Built locally (no hub access), deterministically (a seed, one thread count,
deterministic algorithms; the same machine rebuilds the same bytes), once,
into a cache folder; the folder is a normal HF model folder that
transformers, vLLM, the stages and speculators load like any other. Large
enough that aux layer ids [1, 2, 3] plus the last layer (4) are valid.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.builtin import build
from pipeline.builtin.build import deterministic, fit, no_progress_bars
from pipeline.paths import cache_dir as project_cache

VERSION = 4
SEED = 0
VOCAB_SIZE = 1024
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|pad|>"]
# Llama-3 style, with tool use: the row's `tools` as a system turn, an
# assistant's tool calls as <tool_call>{json}</tool_call> after its text,
# tool results as `tool` turns. Rows without tools render as before v4.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] %}{{ message['content'] | trim }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MODEL_CONFIG = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02,
)
# The build's training: next-token loss on the bundled conversations, rendered
# with the chat template, packed into windows. A couple of minutes on 2 cores.
# ~40 s on 2 cores; final loss ~0.45 (measured): sure of itself, not a lookup table.
TRAIN = dict(steps=300, window=128, batch=16, lr=3e-3, warmup=30, threads=2)


def cache_dir() -> Path:
    return project_cache() / "builtin" / f"tiny-llama-v{VERSION}"


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
    # transformers 5 names the class "TokenizersBackend", which transformers 4
    # (vLLM <= 0.16's) cannot load; the fast class's own name loads in both.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return fast


def _build_model(out: Path, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with deterministic(TRAIN["threads"]):
        torch.manual_seed(SEED)
        config = LlamaConfig(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            **MODEL_CONFIG)
        model = LlamaForCausalLM(config).to(torch.float32)
        loss = fit(model, tokenizer, TRAIN, SEED, "tiny-llama")
        # on stderr: stdout may be --json
        print(f"built-in target tiny-llama: trained {TRAIN['steps']} steps on the bundled "
              f"conversations, final loss {loss:.3f}", file=sys.stderr, flush=True)
        no_progress_bars()
        model.save_pretrained(out, safe_serialization=True)


def describe() -> dict:
    """The config.json the build writes, as far as a launch check reads it."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": VOCAB_SIZE, "torch_dtype": "float32", **MODEL_CONFIG}


def ensure_built() -> Path:
    """The model folder, built on first use (safe against concurrent callers)."""
    return build.ensure_built(cache_dir(), lambda tmp: _build_model(tmp, _build_tokenizer(tmp)))


if __name__ == "__main__":
    print(ensure_built())
