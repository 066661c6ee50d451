"""Each real stage on its own: formats, bad input, resumability details."""

import http.server
import json
import shutil
import threading

import pytest
import torch

from pipeline.builtin import broken_conversations_path, conversations_path
from pipeline.builtin.make_conversations import BROKEN
from pipeline.builtin.tiny_model import ensure_built
from pipeline.data.chat_mask import LocalRenderer, RowError, normalize
from pipeline.extract import hf as extract_hf
from pipeline.model import hsfile
from pipeline.model.info import validate_layer_ids
from pipeline.stages import extract, prepare, train, vocab
from tests.configs import merged, render
from tests.helpers import finished, run_body


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(ensure_built()))


# Like reasoning templates: earlier assistant turns are shortened when a later turn
# exists, so renders are not prefixes of each other.
NOT_PREFIX_STABLE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}{{ m['content'] }}"
    "{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")


# -- prepare ------------------------------------------------------------------

def test_prepare_skips_malformed_rows_with_line_numbers(tmp_path):
    code, rd, evs = run_body(tmp_path, "prepare", prepare.body,
                             render({"data": {"path": str(broken_conversations_path())}}))
    assert code == 0
    summary = finished(evs)["summary"]
    assert summary["samples"] == 20 and summary["skipped_rows"] == len(BROKEN) + 1
    warn = [e for e in evs if e["type"] == "warning"][0]
    lines = broken_conversations_path().read_bytes().split(b"\n")
    listed = {r["line"]: r["reason"] for r in warn["rows"]}
    assert len(listed) == len(BROKEN) + 1
    for n, reason in listed.items():
        raw = lines[n - 1]
        assert raw in [b.encode() for b in BROKEN] or b"\xff" in raw, (n, reason)
    reasons = " | ".join(listed.values())
    for needle in ("bad JSON", "no assistant turn", "has no `role`", "empty conversation",
                   "empty line", "unknown role 'wizard'", "no `messages`", "invalid UTF-8"):
        assert needle in reasons
    assert "line " in warn["message"]
    freq = torch.load(rd.out_dir("prepare") / "token_freq.pt", weights_only=True)
    assert isinstance(freq, dict) and sum(freq.values()) == summary["supervised_tokens"]


def test_prepare_zero_usable_rows_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(BROKEN) + "\n")
    code, rd, evs = run_body(tmp_path, "prepare", prepare.body,
                             render({"data": {"path": str(bad)}}))
    assert code == 1
    err = [e for e in evs if e["type"] == "error"][-1]
    assert "no usable rows" in err["message"] and "messages" in err["hint"]
    assert not (rd.out_dir("prepare") / "data").exists()


def test_prepare_masks_only_assistant_text(tmp_path, tok):
    code, rd, _ = run_body(tmp_path, "prepare", prepare.body,
                           render({"data": {"max_samples": 30}}))
    assert code == 0
    from datasets import load_from_disk
    ds = load_from_disk(str(rd.out_dir("prepare") / "data"))
    assert len(ds) == 30 and set(ds.column_names) == {"input_ids", "loss_mask", "seq_len"}
    answers = {m["content"] for line in conversations_path().read_text().splitlines()[:30]
               for m in json.loads(line)["messages"] if m["role"] == "assistant"}
    for row in ds:
        ids, mask = row["input_ids"], row["loss_mask"].bool()
        assert int(row["seq_len"]) == len(ids)
        supervised = tok.decode(ids[mask]).split("<|eot_id|>")
        assert supervised[-1] == ""
        assert all(s in answers for s in supervised[:-1])
        assert "<|start_header_id|>" not in tok.decode(ids[mask])


def test_prepare_reads_sharegpt_tokenized_and_datasets_folders(tmp_path, tok):
    from datasets import Dataset
    rows = [json.loads(x) for x in conversations_path().read_text().splitlines()[:12]]
    ds_dir = tmp_path / "ds"
    Dataset.from_list([{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(
        m["role"], m["role"]), "value": m["content"]} for m in r["messages"]]} for r in rows]
    ).save_to_disk(str(ds_dir))
    code, rd, evs = run_body(tmp_path, "prepare", prepare.body,
                             render({"data": {"path": str(ds_dir)}}))
    assert code == 0 and finished(evs)["summary"]["samples"] == 12
    tokd = tmp_path / "tok.jsonl"
    tokd.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}) + "\n")
    code, rd, evs = run_body(tmp_path, "prepare", prepare.body,
                             render({"data": {"path": str(tokd), "format": "tokenized"}}),
                             run="r2")
    assert code == 0 and finished(evs)["summary"]["supervised_tokens"] == 2


def test_prepare_resumes_at_the_first_unfinished_chunk(tmp_path):
    code, rd, _ = run_body(tmp_path, "prepare", prepare.body, "")
    chunks = sorted((rd.out_dir("prepare") / ".chunks").glob("chunk_*.pt"))
    assert len(chunks) == 2
    mtime = chunks[0].stat().st_mtime_ns
    chunks[1].unlink()
    shutil.rmtree(rd.out_dir("prepare") / "data")
    code, rd, evs = run_body(tmp_path, "prepare", prepare.body, "")
    assert code == 0 and chunks[0].stat().st_mtime_ns == mtime and chunks[1].exists()
    assert finished(evs)["summary"]["samples"] == 400


def test_boundary_method_on_a_template_that_rewrites_history(tok):
    import copy
    t = copy.copy(tok)
    # Like reasoning templates: earlier assistant turns are shortened when a
    # later turn exists, so renders are not prefixes of each other.
    t.chat_template = NOT_PREFIX_STABLE
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "second one"}]
    rows = LocalRenderer(t).rows(msgs)
    assert len(rows) == 2  # one row per assistant turn
    texts = [t.decode([i for i, m in zip(r.input_ids, r.loss_mask, strict=True) if m]) for r in rows]
    assert texts == ["first answer<|eot_id|>", "second one<|eot_id|>"]
    stable = LocalRenderer(tok).rows(msgs)
    assert len(stable) == 1


def test_a_long_conversation_is_rendered_only_up_to_the_cut(tok):
    """An agent trace of 400 turns, cut at 96 tokens: the same rows once cut
    as rendering every turn gives, from a number of renders set by the cut,
    not by the trace (2,000 turns take no more)."""
    import copy

    from pipeline.stages.prepare import process_chunk

    class Counting(LocalRenderer):
        renders = 0

        def text(self, msgs, gen, tools=None):
            Counting.renders += 1
            return super().text(msgs, gen, tools)

    def trace(turns):
        return {"messages": [{"role": ("user", "assistant")[i % 2], "content": f"step {i} ok"}
                             for i in range(turns)]}
    everything = process_chunk([(0, trace(400))], LocalRenderer(tok), 10**9, "auto")
    want = [(ids[:96], mask[:96]) for ids, mask in zip(everything["input_ids"],
                                                        everything["loss_mask"], strict=True)]
    counts = []
    for turns in (400, 2000):
        Counting.renders = 0
        got = process_chunk([(0, trace(turns))], Counting(tok), 96, "auto")
        assert list(zip(got["input_ids"], got["loss_mask"], strict=True)) == want
        counts.append(Counting.renders)
    assert counts[0] == counts[1] < 60, counts
    # a template that is not prefix-stable: one row per turn, those past the cut left out
    t = copy.copy(tok)
    t.chat_template = NOT_PREFIX_STABLE
    every = [(r.input_ids[:96], r.loss_mask[:96]) for r in
             LocalRenderer(t).rows(normalize(trace(200))[1]) if sum(r.loss_mask[:96])]
    Counting.renders = 0
    cut = process_chunk([(0, trace(2000))], Counting(t), 96, "auto")
    assert list(zip(cut["input_ids"], cut["loss_mask"], strict=True)) == every and every
    assert Counting.renders < 100, Counting.renders


def test_normalize_rejects_and_accepts():
    assert normalize({"messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}
                     )[1][1]["content"] == "a"
    with pytest.raises(RowError, match="no `conversations`"):
        normalize({"messages": []}, "sharegpt")
    with pytest.raises(RowError, match="same length"):
        normalize({"input_ids": [1, 2], "loss_mask": [1]})


def supervised_texts(tok, data_dir) -> list[str]:
    from datasets import load_from_disk
    ds = load_from_disk(str(data_dir)).with_format(None)
    return [tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m])
            for r in ds]


def test_prepare_on_the_datasets_people_have(tmp_path, tok):
    """tests/data_corpus.py: BOM, `developer`, agentic tool turns, the
    assistant first, ShareGPT tool roles, content parts, long lines, NULs:
    accepted and supervised as the template renders them; the rest skipped
    by line number."""
    from tests import data_corpus
    accepted, skipped = data_corpus.write(tmp_path / "corpus.jsonl")
    code, rd, evs = run_body(tmp_path, "prepare", prepare.body,
                             render({"data": {"path": "corpus.jsonl"}}))
    assert code == 0
    summary = finished(evs)["summary"]
    warn = [e for e in evs if e["type"] == "warning"][0]
    listed = {r["line"]: r["reason"] for r in warn["rows"]}
    assert sorted(listed) == skipped, listed
    assert summary["samples"] == len(accepted) and summary["skipped_rows"] == len(skipped)
    texts = supervised_texts(tok, rd.out_dir("prepare") / "data")
    everything = "\n".join(texts)
    # the assistant's tool calls are its tokens (speculators supervises them too)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
        in everything
    assert '"arguments": {"city": "Oslo"}' in everything   # a JSON-string argument, parsed
    assert "Welcome back! Shall we go on?" in everything    # the opening assistant turn
    # tool results, the developer prompt and the tools list are context, not supervised
    assert "light rain, 12 C" not in everything and "Be terse." not in everything
    assert "Weather for a city" not in everything
    reasons = " | ".join(listed.values())
    for needle in ("bad JSON", "invalid UTF-8", "empty line", "not a JSON object",
                   "unknown role 'narrator'", "no assistant turn", "no text `content`",
                   "arguments is not valid JSON", "without a function name",
                   "no assistant tokens within seq_length", "same length"):
        assert needle in reasons, needle


def test_a_template_without_tool_support_skips_tool_call_rows(tok):
    """A template that drops `tool_calls` would train the draft on an empty
    answer: such a conversation is skipped, with the reason."""
    import copy
    t = copy.copy(tok)
    t.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                       "<|end_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
                       "{% if add_generation_prompt %}<|start_header_id|>assistant"
                       "<|end_header_id|>{% endif %}")
    from tests.data_corpus import AGENTIC
    _, msgs, tools = normalize(AGENTIC)
    with pytest.raises(RowError, match="does not render tool calls"):
        LocalRenderer(t).rows(msgs, tools)
    strict = copy.copy(tok)   # a template that raises on roles it does not know
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                            "{{ raise_exception('tool role not supported') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    with pytest.raises(RowError, match="cannot render it .tool role not supported"):
        LocalRenderer(strict).rows(msgs, tools)


def test_prepare_an_empty_file_and_a_wrong_datasets_folder(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    code, _, evs = run_body(tmp_path, "prepare", prepare.body,
                            render({"data": {"path": "empty.jsonl"}}), run="empty")
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "empty.jsonl is empty" in err["message"]
    from datasets import Dataset
    Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}).save_to_disk(str(tmp_path / "ds"))
    code, _, evs = run_body(tmp_path, "prepare", prepare.body, render({"data": {"path": "ds"}}),
                            run="wrong-schema")
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "no usable rows" in err["message"] and "2x no `messages`" in err["message"]


class RenderStandIn(http.server.BaseHTTPRequestHandler):
    """STAND-IN for vLLM's /v1/chat/completions/render (no vLLM here): renders
    with the same tokenizer's chat template and answers token ids."""
    tokenizer = None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions/render":
            self.send_response(404)
            self.end_headers()
            return
        text = self.tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"),
                                                  tokenize=False,
                                                  add_generation_prompt=body["add_generation_prompt"])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        out = json.dumps({"token_ids": ids}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


def test_prepare_through_a_render_endpoint_matches_the_local_template(tmp_path, tok):
    RenderStandIn.tokenizer = tok
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RenderStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        base = {"data": {"max_samples": 40}}
        code, rd_local, _ = run_body(tmp_path, "prepare", prepare.body, render(base), run="local")
        code2, rd_ep, _ = run_body(tmp_path, "prepare", prepare.body, render(merged(
            base, {"stages": {"prepare": {"render_endpoint": url}}})), run="ep")
    finally:
        server.shutdown()
    assert code == code2 == 0
    from datasets import load_from_disk
    a = load_from_disk(str(rd_local.out_dir("prepare") / "data")).with_format(None)
    b = load_from_disk(str(rd_ep.out_dir("prepare") / "data")).with_format(None)
    assert len(a) == 40
    assert list(a["input_ids"]) == list(b["input_ids"])
    assert list(a["loss_mask"]) == list(b["loss_mask"])


def test_prepare_unreachable_endpoint_says_what_to_do(tmp_path):
    code, _, evs = run_body(tmp_path, "prepare", prepare.body, render({"stages": {"prepare": {
        "render_endpoint": "http://127.0.0.1:9", "render_timeout_s": 2.0}}}))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "render endpoint unusable" in err["message"]
    assert 'render_endpoint = ""' in err["hint"]


def test_prepare_needs_trust_remote_code_for_custom_tokenizers(tmp_path):
    src, model = ensure_built(), tmp_path / "custom-model"
    model.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(src / f, model / f)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc.update(auto_map={"AutoTokenizer": ["custom_tok.CustomTokenizer", None]},
              tokenizer_class="CustomTokenizer")
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    (model / "custom_tok.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    code, _, evs = run_body(tmp_path, "prepare", prepare.body, render(
        {"model": {"target": str(model)}, "data": {"max_samples": 5}}))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "trust_remote_code = true" in err["hint"]
    code, _, evs = run_body(tmp_path, "prepare", prepare.body, render(
        {"model": {"target": str(model), "trust_remote_code": True}, "data": {"max_samples": 5}}),
        run="r2")
    assert code == 0 and finished(evs)["summary"]["samples"] == 5


# -- extract --------------------------------------------------------------------

def test_layer_ids_are_validated():
    assert validate_layer_ids([1, 2, 3], 4) == [1, 2, 3, 4]
    assert validate_layer_ids([], 61) == [2, 30, 58, 61]
    with pytest.raises(ValueError, match="is the last layer"):
        validate_layer_ids([1, 4], 4)
    with pytest.raises(ValueError, match=r"out of range .* 0\.\.3"):
        validate_layer_ids([1, 9], 4)
    with pytest.raises(ValueError, match="not in increasing order.*e.g. \\[1, 2, 3\\]"):
        validate_layer_ids([3, 1, 2], 4)
    # every problem at once: the repeat and the id out of range
    with pytest.raises(ValueError, match=r"99 is out of range.*lists layer 1 twice.*e\.g\. \[1\]"):
        validate_layer_ids([1, 1, 99], 4)
    with pytest.raises(ValueError, match="too few"):
        validate_layer_ids([], 4)


def test_length_batches_bound_padded_tokens():
    lengths = [10, 200, 30, 190, 5, 100]
    batches = extract_hf.length_batches(list(range(6)), lengths, 400)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(lengths[b[0]] * len(b) <= 400 or len(b) == 1 for b in batches)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prepared")
    code, rd, _ = run_body(tmp, "prepare", prepare.body, render(
        {"data": {"max_samples": 24}, "stages": {"extract": {"layer_ids": [1, 2, 3]}}}))
    assert code == 0
    return tmp, rd


def test_extract_bad_layer_id_and_disk_guard(prepared):
    tmp, rd = prepared
    code, _, evs = run_body(tmp, "extract", extract.body, render(
        {"data": {"max_samples": 24}, "stages": {"extract": {"layer_ids": [1, 9]}}}))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "layer id 9 is out of range" in err["message"]
    code, _, evs = run_body(tmp, "extract", extract.body, render(
        {"data": {"max_samples": 24},
         "stages": {"extract": {"layer_ids": [1, 2, 3], "min_free_gb": 100000.0}}}))
    warn = [e for e in evs if e["type"] == "warning"]
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "disk forecast" in warn[0]["message"]
    assert "stopped before the disk fills" in err["message"] and "resume" in err["hint"]
    assert not list((rd.out_dir("extract") / "hidden_states").glob("*"))


def test_extract_validation_detects_damage_and_workers_agree(prepared):
    from safetensors.torch import load_file, save_file
    tmp, rd = prepared
    tables = {"data": {"max_samples": 24},
              "stages": {"extract": {"layer_ids": [1, 2, 3], "batch_tokens": 600}}}
    cfg = render(tables)
    code, _, _ = run_body(tmp, "extract", extract.body, cfg)
    assert code == 0
    hs = rd.out_dir("extract") / "hidden_states"
    # Copies: safetensors maps files, and this test rewrites some in place.
    ref = {i: {k: v.clone() for k, v in load_file(str(hs / f"hs_{i}.safetensors")).items()}
           for i in range(24)}
    from datasets import load_from_disk
    ids = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)[0]["input_ids"]
    ok = hsfile.validate_file(hs / "hs_0.safetensors", ids, 4, 128, torch.float32)
    assert ok is None
    # Damage three files three ways; a resume must find and redo exactly those.
    (hs / "hs_1.safetensors").write_bytes((hs / "hs_1.safetensors").read_bytes()[:500])
    bad = dict(ref[2])
    bad["hidden_states"] = bad["hidden_states"].clone()
    bad["hidden_states"][0, 0, 0] = float("nan")
    save_file(bad, str(hs / "hs_2.safetensors"))
    wrong = dict(ref[3])
    wrong["token_ids"] = wrong["token_ids"] + 1
    save_file(wrong, str(hs / "hs_3.safetensors"))
    assert "non-finite" in hsfile.validate_file(hs / "hs_2.safetensors",
                                                ref[2]["token_ids"].tolist(), 4, 128, torch.float32)
    code, _, evs = run_body(tmp, "extract", extract.body, cfg)
    summary = finished(evs)["summary"]
    assert code == 0 and summary["computed"] == 3 and summary["reused"] == 21
    # Two CPU worker processes write the same files as one process.
    shutil.rmtree(hs)
    code, _, _ = run_body(tmp, "extract", extract.body,
                          render(merged(tables, {"stages": {"extract": {"workers": 2}}})))
    assert code == 0
    for i in range(24):
        got = load_file(str(hs / f"hs_{i}.safetensors"))
        assert torch.equal(got["token_ids"], ref[i]["token_ids"])
        torch.testing.assert_close(got["hidden_states"], ref[i]["hidden_states"],
                                   atol=1e-5, rtol=1e-4)


# -- vocab and train choices ----------------------------------------------------

def test_vocab_rejects_a_draft_vocab_larger_than_the_target(prepared):
    tmp, _ = prepared
    code, _, evs = run_body(tmp, "vocab", vocab.body, render(
        {"data": {"max_samples": 24}, "stages": {"vocab": {"draft_vocab_size": 5000}}}))
    err = [e for e in evs if e["type"] == "error"][-1]
    assert code == 1 and "larger than the target's vocabulary (1024)" in err["message"]


def test_vocab_runs_speculators_own_mapping_without_its_model_registry():
    """The stage's mapping is speculators' train/vocab_mapping.py itself,
    loaded without the package __init__ (every model it knows, 5-10 s):
    the same file, and the same mapping as the package's import gives."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from pipeline.stages.vocab import speculators_vocab_mapping\n"
            "m = speculators_vocab_mapping()\n"
            "alone = 'speculators.models' not in sys.modules\n"
            "freq = {5: 9, 2: 7, 11: 3, 0: 1}\n"
            "d2t, t2d = m.build_vocab_mappings_from_distribution(freq, 3, 16)\n"
            "from speculators.train import vocab_mapping as pkg\n"
            "same = m.__file__ == pkg.__file__\n"
            "want = pkg.build_vocab_mappings_from_distribution(freq, 3, 16)\n"
            "print(alone, same, torch.equal(d2t, want[0]) and torch.equal(t2d, want[1]),\n"
            "      (torch.arange(3) + d2t).tolist())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split(maxsplit=3) == ["True", "True", "True", "[2, 5, 11]\n"], p.stdout

def test_loss_and_attention_choices():
    assert train.choose_loss("auto", "cpu", "2.13.0") == ("eager", None)
    loss, why = train.choose_loss("fused", "cpu", "2.13.0")
    assert loss == "eager" and "GPU" in why
    loss, why = train.choose_loss("auto", "cuda", "2.11.0+cu130")
    assert loss == "eager" and ("2.11" in why or "triton" in why)
    assert train.choose_attention("auto", "cpu") == "sdpa"
    assert train.choose_attention("auto", "cuda") == "simple_flex_attention"
    with pytest.raises(Exception, match="no CPU backward"):
        train.choose_attention("flex", "cpu")


def test_acceptance_length_estimate():   # (every algorithm's: tests/unit/test_algorithms.py)
    val = {"full_acc_0": 0.8, "full_acc_1": 0.6, "full_acc_2": 0.4}
    from pipeline.train.val_metrics import acceptance_length
    assert acceptance_length(val, 3) == pytest.approx(2.8)
    assert acceptance_length({"full_acc_0": 0.5}, 3) is None


def test_tiny_model_is_deterministic(tmp_path, monkeypatch):
    """Two builds, byte for byte the same files: the same procedure as the
    real build (seeded data order, fixed threads, deterministic kernels),
    30 of its 300 steps each (a whole build takes minutes on 2 cores)."""
    from pipeline.builtin import tiny_model
    monkeypatch.setitem(tiny_model.TRAIN, "steps", 30)
    built = []
    for name in ("a", "b"):
        monkeypatch.setenv("EAGLE_PANEL_CACHE", str(tmp_path / name))
        built.append(tiny_model.ensure_built())
        assert built[-1].parent.parent == tmp_path / name
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (built[0] / name).read_bytes() == (built[1] / name).read_bytes(), name


class _Forward:
    """A stand-in model output: a NaN at one position of one sample."""
    device = torch.device("cpu")

    def __init__(self, nan_at):
        self.nan_at = nan_at

    def forward(self, batch):
        longest = max(len(r) for r in batch)
        hs = torch.ones(len(batch), longest, 2, 4)
        for b, r in enumerate(batch):
            if r[0] == self.nan_at[0]:
                hs[b, self.nan_at[1]] = float("nan")
        return hs


def shard_job(folder, rows, lengths):
    """The ExtractJob for extract_hf.extract_shard on two hand-made rows."""
    from types import SimpleNamespace

    from pipeline.extract.job import DiskGuard, ExtractJob
    return ExtractJob(target=None, layer_ids=[1, 2], dtype=torch.float32, hidden=4,
                      trust_remote_code=False, rows=rows, lengths=lengths, todo=[0, 1],
                      folder=folder, bytes_per_token=40, disk=DiskGuard(folder, 0),
                      section=SimpleNamespace(batch_tokens=100, tensor_parallel=1, workers=0),
                      devices=[], log_dir=folder)


def test_non_finite_hidden_states_stop_the_stage_but_padding_does_not(tmp_path):
    from pipeline.stage_error import StageError
    rows = [[1] * 5, [2] * 3]          # sample 1 is padded to 5 positions
    lengths = [5, 3]
    # NaN in sample 1's padding (position 4): not part of any file, not an error.
    done = extract_hf.extract_shard(_Forward((2, 4)), shard_job(tmp_path, rows, lengths))
    assert done.samples == 2 and len(list(tmp_path.glob("hs_*.safetensors"))) == 2
    for f in tmp_path.glob("hs_*"):
        f.unlink()
    with pytest.raises(StageError, match="sample 1: the target produced non-finite"):
        extract_hf.extract_shard(_Forward((2, 1)), shard_job(tmp_path, rows, lengths))
    assert not (tmp_path / "hs_1.safetensors").exists()


def test_regenerate_answers_where_the_assistant_answered_in_text():
    """The target answers after user and tool turns where the recorded
    assistant answered in text (and after a final user turn); recorded tool
    calls and an opening assistant turn stay as context. (A double stands
    for the server here; tests/vllm/test_vllm_pipeline.py runs the real one.)"""
    from types import SimpleNamespace

    from pipeline.stages.regenerate import regenerate_one
    from tests.data_corpus import AGENTIC

    class Server:
        shared = False      # its own server: regenerate asks nothing of a capture

        def __init__(self):
            self.prompts = []

        def post(self, path, body, timeout):
            self.prompts.append([m["role"] for m in body["messages"]])
            assert body.get("tool_choice") == ("none" if body.get("tools") else None)
            return {"prompt_token_ids": [1, 2], "choices": [
                {"token_ids": [3], "message": {"content": f"answer {len(self.prompts)}"}}]}

    sec = SimpleNamespace(max_tokens=8, temperature=0.0, seed=0, request_timeout_s=5)
    _, msgs, tools = normalize(AGENTIC)
    s = Server()
    rows = regenerate_one(s, "m", {"messages": msgs, "tools": tools}, sec, 512)
    assert s.prompts == [["user", "assistant", "tool"]]    # the recorded call is context
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "answer 1"}
    opening = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"},
               {"role": "assistant", "content": "a"}, {"role": "user", "content": "more?"}]
    s = Server()
    rows = regenerate_one(s, "m", {"messages": opening, "tools": None}, sec, 512)
    assert s.prompts == [["assistant", "user"], ["assistant", "user", "assistant", "user"]]
    assert rows[1]["messages"][2]["content"] == "answer 1"   # its own earlier answer
    assert [len(r["messages"]) for r in rows] == [3, 5]   # each row its own conversation
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert [r["loss_mask"] for r in rows] == [[0, 0, 1], [0, 0, 1]]


def test_a_resume_asks_again_what_the_server_refused(tmp_path, capsys):
    """A saved chunk keeps its answers; the conversations the server refused (an
    HTTP error of the server's state: a wrong key, an overloaded server) are asked
    again on resume, while a conversation's own fault (a 400) is not. Another
    chunk size keeps its chunks apart (chunk k is a range of that size)."""
    import urllib.error
    from types import SimpleNamespace

    from pipeline.stages.regenerate import DEFAULT_CHUNK, REFUSED, retryable, split_chunks
    ctx = SimpleNamespace(out=tmp_path, section=SimpleNamespace(chunk_size=2))
    chunks = split_chunks(ctx, list(range(5)))
    assert chunks.parts == [[0, 1], [2, 3], [4]] and chunks.todo == [0, 1, 2]
    saved = {0: [[0, f"{REFUSED} (HTTP Error 401: Unauthorized)"]],
             1: [[2, "row 2: no user turn to answer"]]}
    for k, failed in saved.items():
        chunks.path(k).write_text(json.dumps({"rows": [], "failed": failed}))
    assert chunks.folder.name == ".chunks-2"
    assert split_chunks(ctx, list(range(5))).todo == [0, 2]
    assert "1 saved chunk(s) asked again: the server refused 1" in capsys.readouterr().out
    ctx.section.chunk_size = DEFAULT_CHUNK
    assert split_chunks(ctx, list(range(5))).folder.name == ".chunks"
    http = [urllib.error.HTTPError("u", code, "", None, None) for code in (401, 429, 503, 400)]
    assert [retryable(e) for e in http] == [True, True, True, False]
    assert retryable(ConnectionRefusedError())


def test_a_builtin_targets_build_says_how_far_its_training_is(capsys):
    """Building a built-in target trains it for a minute or more (inside
    install.sh, or the first stage that needs it): a line at each quarter."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.builtin import tiny_model
    from pipeline.builtin.build import fit
    tok = AutoTokenizer.from_pretrained(tiny_model.ensure_built())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=8))
    fit(model, tok, dict(steps=8, window=16, batch=2, lr=1e-3, warmup=2), 0, "tiny-test")
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(",")[0] for ln in lines] == [
        f"built-in target tiny-test: training step {n}/8" for n in (2, 4, 6)], lines


def test_a_killed_writers_temp_files_are_removed_and_nothing_else(tmp_path):
    """What a SIGKILL mid-write leaves in hidden_states/: our `.hs_N....tmp`
    and safetensors' own `.tmp` + 6 characters (its Rust writer goes through
    one: seen left by a killed extract); finished files and others stay."""
    import threading
    t = {"a": torch.zeros(50_000_000)}
    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            seen.update(p.name for p in tmp_path.iterdir())
    w = threading.Thread(target=watch)
    w.start()
    from safetensors.torch import save_file
    save_file(t, str(tmp_path / ".hs_0.safetensors.1.2.tmp"))
    done.set()
    w.join()
    assert any(hsfile.SAFETENSORS_TEMP.fullmatch(n) for n in seen), seen   # its own temp name
    for name in (".hs_1.safetensors.9.9.tmp", ".tmpAb12Cd", "hs_2.safetensors", ".tmpnotours",
                 "keep.tmpx"):
        (tmp_path / name).write_bytes(b"x")
    assert hsfile.remove_leftovers(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmpnotours", "hs_2.safetensors",
                                                          "keep.tmpx"]


def test_a_sample_is_published_once_and_never_replaced(tmp_path):
    """A second writer of the same sample (a node cut off mid-write whose
    write goes through after another node wrote the file) does not replace
    it: the first file stays, inode and bytes, and no temp file is left."""
    from safetensors.torch import load_file
    final = hsfile.hs_path(tmp_path, 0)
    ids = torch.arange(4)
    hsfile.write_sample(final, torch.ones(4, 2, 3), ids)
    first = final.stat().st_ino
    hsfile.write_sample(final, torch.full((4, 2, 3), 7.0), ids)   # the stale writer
    assert final.stat().st_ino == first
    assert float(load_file(str(final))["hidden_states"].max()) == 1.0
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    # two writers of one process and thread never share a temp name (nor two nodes' writers
    # with the same pid and thread id: pid namespaces)
    assert hsfile.temp_path(final) != hsfile.temp_path(final)


def test_a_filesystem_without_hard_links_gets_the_plain_rename(tmp_path, monkeypatch):
    """Where os.link is refused (EPERM: vfat, some FUSE and object-store mounts)
    the file is still written, by a plain rename; a name already taken is kept."""
    import errno

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(hsfile.os, "link", no_links)
    final = hsfile.hs_path(tmp_path, 3)
    hsfile.write_sample(final, torch.ones(2, 2, 3), torch.arange(2))
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    first = final.stat().st_ino
    hsfile.write_sample(final, torch.zeros(2, 2, 3), torch.arange(2))   # taken: kept
    assert final.stat().st_ino == first and [p.name for p in tmp_path.iterdir()] == [final.name]
