"""The built-in Kimi target (pipeline/builtin/tiny_kimi.py): Kimi-K2.5's
architecture at toy scale, built and trained locally. Its folder is what a
Kimi run meets: config.json as describe() says (launch checks read that
without building), a tokenizer that loads only with trust_remote_code, a
chat template whose renders the loss masks' boundary method can use (tool
calls supervised, tool results not), weights under the names vLLM loads and
transformers reloads without missing or unexpected keys, a deterministic
build — and (marked `vllm`) vLLM 0.32 serving it text-only with the same
greedy tokens as transformers.

The vllm tier's part of tests/integration/test_tiny_kimi.py."""

import os

import torch

from pipeline.paths import VLLM_VENV
from tests.integration.test_tiny_kimi import bundled, folder, model, tok  # noqa: F401 - fixtures, used by name

PY = VLLM_VENV / "bin" / "python"


def test_vllm_serves_it_text_only_greedy_as_transformers_and_renders_as_prepare(
        folder, tok, model, vllm_env, tmp_path):  # noqa: F811 - the fixtures imported above
    """vLLM 0.32 (the CPU build in .venv-vllm) serves the folder the way the
    stages start servers (pipeline.vllm.server: --language-model-only and the
    CPU_MLA backend come from the target's config), float32 like
    transformers: chat prompts render to the same ids, and greedy
    completions are transformers' greedy tokens. Agentic rows (tools, tool
    calls, tool results) through its render endpoint (--enable-scale-out):
    the same token ids and loss masks as prepare's local renderer with
    Kimi's template, the tool-call section supervised."""
    from pipeline.data.chat_mask import EndpointRenderer, LocalRenderer, normalize
    from pipeline.vllm.server import make_server, serving
    from tests.data_corpus import AGENTIC, AGENTIC_STRING_ARGS
    env = vllm_env
    # vLLM's interpreter (its own transformers) loads the tokenizer only with the remote code
    import subprocess
    code = ("import sys; from transformers import AutoTokenizer\n"
            "for trust in (False, True):\n"
            "    try: print(type(AutoTokenizer.from_pretrained(sys.argv[1], "
            "trust_remote_code=trust)).__name__)\n"
            "    except Exception as e: print(type(e).__name__)\n")
    out = subprocess.run([str(PY), "-c", code, str(folder)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.stdout.split() == ["ValueError", "KimiTokenizer"], out.stdout + out.stderr
    server = make_server(0, env, folder, [], tmp_path / "vllm.log", "float32", 512, True,
                         ["--enable-scale-out"], kv_tokens=2048, kv_bytes_per_token=1 << 14)
    flags = " ".join(server.argv)
    assert "--language-model-only" in flags and "--attention-backend CPU_MLA" in flags
    m, _ = model
    prompts = [msgs[:1] for msgs in bundled(4)] + [bundled(1)[0][:3]]
    with serving(server, 600, lambda: False) as s:
        for msgs in prompts:
            resp = s.post("/v1/chat/completions",
                          {"model": str(folder), "messages": msgs, "max_tokens": 16,
                           "temperature": 0.0, "return_token_ids": True}, 300)
            want_prompt = tok(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                      tokenize=False),
                              add_special_tokens=False)["input_ids"]
            assert resp["prompt_token_ids"] == want_prompt
            got = resp["choices"][0]["token_ids"]
            with torch.no_grad():
                ref = m.generate(torch.tensor([want_prompt]), max_new_tokens=16,
                                 do_sample=False)[0, len(want_prompt):].tolist()
            assert got == ref[:len(got)] and len(got) >= 2, (tok.decode(got), tok.decode(ref))
        remote, local = EndpointRenderer(s.url, 60, api_key=s.api_key), LocalRenderer(tok)
        for msgs, tools in [normalize(r)[1:] for r in (AGENTIC, AGENTIC_STRING_ARGS)]:
            a, b = local.rows(msgs, tools), remote.rows(msgs, tools)
            assert [(r.input_ids, r.loss_mask) for r in a] == \
                [(r.input_ids, r.loss_mask) for r in b], msgs
            call = tok.convert_tokens_to_ids("<|tool_call_begin|>")
            assert any(i == call and m for r in a
                       for i, m in zip(r.input_ids, r.loss_mask, strict=True))
