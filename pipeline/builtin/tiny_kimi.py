"""The built-in Kimi target (`builtin:tiny-kimi`): Kimi-K2.5's architecture
at toy scale, for trying the pipeline on what a Kimi run meets — a
multimodal wrapper (`KimiK25ForConditionalGeneration`, a DeepSeek-V3 text
model beside a vision tower), MLA attention, a DeepSeek-V3 MoE (8 routed
experts top-2 + 1 shared, sigmoid "noaux_tc" routing), a tokenizer that
loads only with `trust_remote_code`, and Kimi's chat template with tool
calls and thinking blocks.

Built like tiny-llama (pipeline.builtin.tiny_model): locally (no hub
access), deterministically (a seed, one thread count, deterministic
algorithms), once, into a cache folder, and *trained* at build time on the
bundled conversations rendered with its own chat template, so a draft has
something to learn.

What the folder holds, and why (docs/FACTS.md, "Checked 2026-12-01"):
- `config.json`: transformers' `Kimi_K25Config` schema, written from
  `describe()`; architectures named as vLLM registers the wrapper
  (`KimiK25ForConditionalGeneration`, not transformers' class name).
  MLA with kv_lora_rank 512 + qk_rope_head_dim 64: vLLM's CPU MLA kernels
  take head size 576 only; nope/v head dims 32 (the AMX MLA backend rejects
  16). `topk_method` / `scoring_func` are written (transformers' config has
  no such fields; vLLM needs them to create the router bias and route with
  sigmoid). No `index_topk` (it would switch on V3.2's sparse indexer).
- `model.safetensors`: the original Kimi key names vLLM loads —
  transformers 5.19's save_pretrained writes three prefixes vLLM cannot map
  (`blocks.` for `layers.` and two vision/projector ones); they are renamed
  back, and transformers reloads the renamed file with no missing or
  unexpected keys.
- `preprocessor_config.json`: vLLM builds the image processor even when
  serving text-only (`--language-model-only`), and fails without it.
- `generation_config.json`: stops at `<|im_end|>`, as Kimi's does.
- The tokenizer: `tokenization_kimi.py` (remote code: a TokenizersBackend
  subclass), `kimi_tokenizer.json` (a byte-level BPE trained here, base
  vocabulary 768, then Kimi's 256 reserved special slots as in the real
  model: vocab 1024), `tokenizer_config.json` with its `auto_map`, and
  `chat_template.jinja`. No `tokenizer.json`: without trust_remote_code it
  does not load, like the real one.

`python -m pipeline.builtin.tiny_kimi` builds it and prints the folder.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

from pipeline.builtin import build
from pipeline.builtin.build import deterministic, fit, no_progress_bars
from pipeline.paths import cache_dir as project_cache

VERSION = 2   # 2: rms_norm_eps 1e-6 (transformers and vLLM then agree on the MLA latent norms)
SEED = 0
HERE = Path(__file__).resolve().parent
SHIPPED = HERE / "kimi"            # copied into the model folder
TOKENIZER_CODE = "tokenization_kimi.py"
TOKENIZER_FILE = "kimi_tokenizer.json"
TRUST_REMOTE_CODE = True           # the tokenizer is remote code (auto_map)

# Kimi's tokenizer: a byte-level BPE (base vocabulary), then 256 reserved
# special-token slots; named ones at Kimi's offsets, the rest
# <|reserved_token_ID|>. The real model: base 163584, vocab 163840.
BASE_VOCAB = 768
NUM_RESERVED = 256
VOCAB_SIZE = BASE_VOCAB + NUM_RESERVED
SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
    "<|start_header_id|>": 6, "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13, "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15,
    "<|im_middle|>": 17, "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20,
    "<|media_pad|>": 21, "<think>": 22, "</think>": 23, "[UNK]": 254, "[PAD]": 255,
}
# Kimi's pre-tokenizer pattern (its tokenization_kimi.py `pat_str`)
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# What the chat template writes around the conversations' own text: in the
# BPE's training text, so the roles and the default system prompt compress.
TEMPLATE_WORDS = ["system", "user", "assistant", "tool", "tool_declare",
                  "You are Kimi, an AI assistant created by Moonshot AI.",
                  "## Return of functions.", "image"]


def token_id(name: str) -> int:
    """A special token's id (its place is fixed: no build needed)."""
    return BASE_VOCAB + SPECIAL_OFFSETS[name]


def special_tokens() -> list[str]:
    """The 256 special tokens in id order, from BASE_VOCAB."""
    names = {off: name for name, off in SPECIAL_OFFSETS.items()}
    return [names.get(i, f"<|reserved_token_{BASE_VOCAB + i}|>") for i in range(NUM_RESERVED)]


# Kimi-K2.5's text model (DeepSeek-V3) at toy scale. 4 layers, so aux layer
# ids [1, 2, 3] plus the last layer (4) are valid.
TEXT_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, routed_scaling_factor=2.827, hidden_act="silu",
    num_nextn_predict_layers=0, max_position_embeddings=2048,
    # transformers' DeepSeek-V3 gives the q/kv latent norms eps 1e-6 whatever the config
    # says, vLLM gives them rms_norm_eps: 1e-6 (DeepSeek-V3's own) keeps the two equal
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                     "original_max_position_embeddings": 512, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    tie_word_embeddings=False, initializer_range=0.02, attention_bias=False,
    attention_dropout=0.0, use_cache=True, dtype="float32",
    bos_token_id=token_id("[BOS]"), eos_token_id=token_id("[EOS]"),
    pad_token_id=token_id("[PAD]"),
)
# MoonViT at toy scale (transformers' Kimi_K25VisionConfig names; vLLM reads
# the same ones). Untrained: the pipeline serves the target text-only.
VISION_CONFIG = dict(
    model_type="kimi_k25_vision", hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
    intermediate_size=64, hidden_act="gelu_pytorch_tanh", patch_size=14, pos_emb_height=8,
    pos_emb_width=8, pos_emb_time=4, merge_kernel_size=[2, 2],
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
PREPROCESSOR_CONFIG = {"media_proc_cfg": {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None, "sample_fps": 2.0, "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}}
# The build's training, as tiny-llama's: next-token loss on the bundled
# conversations rendered with the chat template, packed into windows.
# Measured: ~75 s of training on an idle 2-core machine, final loss 0.416
# (MLA's 512-wide latent projections make a step ~2x tiny-llama's); minutes
# when other processes share the cores (2 threads wait on each other).
TRAIN = dict(steps=300, window=128, batch=16, lr=3e-3, warmup=30, threads=2)


def cache_dir() -> Path:
    return project_cache() / "builtin" / f"tiny-kimi-v{VERSION}"


def describe() -> dict:
    """config.json exactly as the build writes it (no build needed)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": copy.deepcopy(TEXT_CONFIG),
        "vision_config": copy.deepcopy(VISION_CONFIG),
        "projection_hidden_size": VISION_CONFIG["hidden_size"],   # == the tower's width
        "projection_layer_norm_eps": 1e-5,
        "image_token_id": token_id("<|media_pad|>"),
        "media_placeholder_token_id": token_id("<|media_pad|>"),  # the hub schema's name
        "video_token_id": token_id("<|media_pad|>"),
        "vision_start_token_id": token_id("<|media_begin|>"),
        "vision_end_token_id": token_id("<|media_end|>"),
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "bos_token_id": token_id("[BOS]"), "eos_token_id": token_id("[EOS]"),
        "pad_token_id": token_id("[PAD]"),
        "tie_word_embeddings": False,   # Kimi_K25Config's default is True
        "dtype": "float32",
    }


# -- the tokenizer -------------------------------------------------------------------------

def _corpus():
    """The conversations' text, and the template's words once per
    conversation (about as often as the rendered conversations have them)."""
    from pipeline.builtin import conversations_path
    with open(conversations_path(), encoding="utf-8") as f:
        for line in f:
            yield from TEMPLATE_WORDS
            for m in json.loads(line)["messages"]:
                yield m["content"]


def _tokenizer_class():
    """KimiTokenizer from the shipped source, imported by path (the same
    file the folder holds; no HF modules cache involved)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_tiny_kimi_tokenization",
                                                  SHIPPED / TOKENIZER_CODE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KimiTokenizer


def _build_tokenizer(out: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB, special_tokens=[], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != BASE_VOCAB:
        raise RuntimeError(f"the BPE learned {tok.get_vocab_size()} tokens, not {BASE_VOCAB}: "
                           "the special tokens would not land at Kimi's offsets")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in special_tokens()])
    assert tok.token_to_id("[PAD]") == token_id("[PAD]") == VOCAB_SIZE - 1
    fast = _tokenizer_class()(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
        pad_token="[PAD]", model_max_length=TEXT_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)
    # remote code: the class is named by auto_map, its source beside it
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "KimiTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": [f"{TOKENIZER_CODE[:-3]}.KimiTokenizer", None]}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(SHIPPED / TOKENIZER_CODE, out / TOKENIZER_CODE)
    shutil.copyfile(SHIPPED / "chat_template.jinja", out / "chat_template.jinja")
    assert (out / TOKENIZER_FILE).exists()
    for name in ("tokenizer.json", "tokenizer.model", "tiktoken.model"):
        if (out / name).exists():
            raise RuntimeError(f"{name} in the folder would load without trust_remote_code")
    loaded = _tokenizer_class().from_pretrained(out)   # with its chat template
    if len(loaded) != VOCAB_SIZE or not loaded.chat_template:
        raise RuntimeError("the saved tokenizer does not reload as built")
    return loaded


# transformers 5.19's save_pretrained reverts its kimi_k25 weight mapping
# lossily; these are the original Kimi names vLLM's loader expects.
RENAMES = (("language_model.model.blocks.", "language_model.model.layers."),
           ("model.mm_projector.", "mm_projector."),
           ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."))


def kimi_key(name: str) -> str:
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _build_model(out: Path, tokenizer) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    with deterministic(TRAIN["threads"], fill_uninitialized=False):
        torch.manual_seed(SEED)
        config = Kimi_K25Config.from_dict(describe())
        model = Kimi_K25ForConditionalGeneration(config).to(torch.float32)
        loss = fit(model, tokenizer, TRAIN, SEED, "tiny-kimi", use_cache=False)
        print(f"built-in target tiny-kimi: trained {TRAIN['steps']} steps on the bundled "
              f"conversations, final loss {loss:.3f}", file=sys.stderr, flush=True)
        staging = out / ".hf"
        no_progress_bars()
        model.save_pretrained(staging, safe_serialization=True)
        tensors = {kimi_key(k): v for k, v in sorted(load_file(staging / "model.safetensors").items())}
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        shutil.rmtree(staging)
    _write_json(out / "config.json", describe())
    _write_json(out / "generation_config.json", {
        "bos_token_id": token_id("[BOS]"), "eos_token_id": token_id("<|im_end|>"),
        "pad_token_id": token_id("[PAD]")})
    _write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def ensure_built() -> Path:
    """The model folder, built on first use (safe against concurrent callers)."""
    return build.ensure_built(cache_dir(), lambda tmp: _build_model(tmp, _build_tokenizer(tmp)))


if __name__ == "__main__":
    print(ensure_built())
