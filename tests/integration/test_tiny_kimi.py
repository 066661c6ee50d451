"""The built-in Kimi target (pipeline/builtin/tiny_kimi.py): Kimi-K2.5's
architecture at toy scale, built and trained locally. Its folder is what a
Kimi run meets: config.json as describe() says (launch checks read that
without building), a tokenizer that loads only with trust_remote_code, a
chat template whose renders the loss masks' boundary method can use (tool
calls supervised, tool results not), weights under the names vLLM loads and
transformers reloads without missing or unexpected keys, a deterministic
build — and (marked `vllm`) vLLM 0.32 serving it text-only with the same
greedy tokens as transformers.

The parts in other tiers: tests/vllm/test_tiny_kimi.py."""

import json
import os

import pytest
import torch

from pipeline.builtin import conversations_path, tiny_kimi

FILES = {"config.json", "model.safetensors", "generation_config.json", "preprocessor_config.json",
         "kimi_tokenizer.json", "tokenization_kimi.py", "tokenizer_config.json",
         "chat_template.jinja"}


@pytest.fixture(scope="module")
def folder():
    return tiny_kimi.ensure_built()


@pytest.fixture(scope="module")
def tok(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)


@pytest.fixture(scope="module")
def model(folder):
    from transformers import AutoModelForImageTextToText
    m, info = AutoModelForImageTextToText.from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True)
    return m.eval(), info


def bundled(n=None):
    with open(conversations_path(), encoding="utf-8") as f:
        rows = [json.loads(line)["messages"] for line in f]
    return rows[:n] if n else rows


def test_the_folder_is_what_describe_says(folder):
    from pipeline import builtin
    from pipeline.model.info import model_info, validate_layer_ids
    assert builtin.target("builtin:tiny-kimi") is tiny_kimi
    assert {p.name for p in folder.iterdir()} == FILES
    assert json.loads((folder / "config.json").read_text()) == tiny_kimi.describe()
    m = model_info(tiny_kimi.describe())
    assert m.architecture == "KimiK25ForConditionalGeneration" and m.wrapped
    assert (m.layers, m.hidden, m.vocab_size, m.dtype) == (4, 128, 1024, "float32")
    assert m.kv_lora_rank + m.qk_rope_head_dim == 576    # vLLM's CPU MLA kernels: 576 only
    assert validate_layer_ids([1, 2, 3], m.layers) == [1, 2, 3, 4]
    text = tiny_kimi.describe()["text_config"]
    assert "index_topk" not in text and text["topk_method"] == "noaux_tc"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tiny_kimi.token_id("<|im_end|>")


def test_describe_needs_no_build_and_no_ml_stack(tmp_path):
    """Launch checks call describe() before anything is built, in well under
    a second: no torch, no transformers, nothing written."""
    import subprocess
    import sys

    from tests.helpers import ROOT
    code = ("import sys, json; from pipeline.builtin import tiny_kimi; d = tiny_kimi.describe(); "
            "print(json.dumps([d['architectures'], 'torch' in sys.modules, "
            "'transformers' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(ROOT), env=dict(os.environ, EAGLE_PANEL_CACHE=str(tmp_path)))
    assert json.loads(out.stdout) == [["KimiK25ForConditionalGeneration"], False, False]
    assert not list(tmp_path.iterdir())


def test_the_tokenizer_loads_only_with_trust_remote_code(folder, tok):
    from transformers import AutoTokenizer
    for trust in (None, False):
        with pytest.raises((ValueError, OSError)):
            AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust)
    assert type(tok).__name__ == "KimiTokenizer" and tok.is_fast and len(tok) == 1024
    for name in ("[BOS]", "[EOS]", "<|im_end|>", "<|im_middle|>", "<|media_pad|>", "<think>",
                 "</think>", "<|tool_call_begin|>", "[PAD]", "[UNK]"):
        assert tok.convert_tokens_to_ids(name) == tiny_kimi.token_id(name), name
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (768, 769, 1023)
    text = "Hello, Kimi! 12345 plus 6."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_layout(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
        "<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello.<|im_end|>")
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    quiet = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True,
                                    thinking=False)
    assert quiet == prompt + "</think>"
    thought = tok.apply_chat_template(
        [msgs[0], dict(msgs[1], reasoning_content="greet back")], tokenize=False)
    assert "<|im_middle|><think>greet back</think>Hello.<|im_end|>" in thought


def supervised(tok, row) -> str:
    return tok.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m])


def test_loss_masks_on_the_bundled_and_agentic_rows(tok):
    """The boundary method (pipeline/data/chat_mask.py) on this template:
    every conversation prefix-stable (one row), every assistant turn
    supervised; tool calls are the assistant's tokens, tool results and the
    tools list are context."""
    from pipeline.data.chat_mask import LocalRenderer, normalize
    from tests.data_corpus import AGENTIC, AGENTIC_STRING_ARGS
    r = LocalRenderer(tok)
    for msgs in bundled():
        rows = r.rows(msgs)
        assert len(rows) == 1 and any(rows[0].loss_mask), msgs
        text = supervised(tok, rows[0])
        for m in msgs:
            if m["role"] == "assistant":
                assert f"</think>{m['content']}<|im_end|>" in text
            else:
                assert m["content"] not in text
    _, msgs, tools = normalize(AGENTIC)
    rows = r.rows(msgs, tools)
    assert len(rows) == 1
    text = supervised(tok, rows[0])
    assert text == ('</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
                    '<|tool_calls_section_end|><|im_end|></think>Yes, light rain and 12 degrees.'
                    '<|im_end|>')
    full = tok.decode(rows[0].input_ids)
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nlight rain, 12 C" \
        in full
    _, msgs, tools = normalize(AGENTIC_STRING_ARGS)
    rows = r.rows(msgs, tools)
    assert len(rows) == 1 and '{"city": "Oslo"}<|tool_call_end|>' in supervised(tok, rows[0])


def test_transformers_loads_the_trained_model(folder, tok, model):
    m, info = model
    assert type(m).__name__ == "Kimi_K25ForConditionalGeneration"
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # trained on the bundled conversations: it predicts them well
    ids = []
    for msgs in bundled(40):
        ids += tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids[:1024]])
    with torch.no_grad():
        loss = float(m(input_ids=x, labels=x).loss)
    assert loss < 1.2, loss
    # and answers a chat prompt in the template's shape
    prompt = tok.apply_chat_template(bundled(1)[0][:1], add_generation_prompt=True, tokenize=False)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    out = m.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
    assert out[0] == tiny_kimi.token_id("</think>"), tok.decode(out)


def test_tiny_kimi_is_deterministic(tmp_path, monkeypatch):
    """Two builds, byte for byte the same files: the real build's procedure
    (seeded data order, fixed threads, deterministic kernels), 20 steps of
    4 windows each (a whole build takes minutes on a busy 2-core machine)."""
    monkeypatch.setitem(tiny_kimi.TRAIN, "steps", 20)
    monkeypatch.setitem(tiny_kimi.TRAIN, "batch", 4)
    built = []
    for name in ("a", "b"):
        monkeypatch.setenv("EAGLE_PANEL_CACHE", str(tmp_path / name))
        built.append(tiny_kimi.ensure_built())
        assert built[-1] == tmp_path / name / "builtin" / f"tiny-kimi-v{tiny_kimi.VERSION}"
    assert {p.name for p in built[0].iterdir()} == FILES
    for name in sorted(FILES):
        assert (built[0] / name).read_bytes() == (built[1] / name).read_bytes(), name


# -- vLLM ---------------------------------------------------------------------------------


