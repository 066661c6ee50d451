"""Assistant-only loss masks from any chat template, by the boundary method.

For assistant turn j, the conversation rendered up to turn j with the
generation prompt ends where the assistant's text begins, and rendered up to
turn j+1 ends where it stops: the tokens between are supervised. This is
how speculators 0.9 masks through vLLM's render endpoint; here it runs with
the tokenizer's own `apply_chat_template` as well, so it works for templates
without `{% generation %}` tags and without a server.

Templates that rewrite earlier turns (some drop past reasoning) are not
prefix-stable; such a conversation becomes one row per assistant turn.

Rendering through turn j for every j costs the square of the turns; with
`limit` (prepare's seq_length, where rows are cut) a renderer stops at the
first assistant turn that begins past it: what it would supervise is cut
anyway, so the rows are the same once cut, and a 10,000-turn agent trace
costs what its first `limit` tokens do.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

from pipeline.vllm.contract_strings import ROUTE_CHAT_RENDER

ROLE_ALIASES = {
    "system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
    # OpenAI's newer name for the system role; its older one for tool results
    "developer": "system", "function": "tool",
    "human": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    # ShareGPT tool datasets (LLaMA-Factory's names): the call is the
    # assistant's text, the observation is the tool's answer
    "function_call": "assistant", "observation": "tool",
}


class RowError(ValueError):
    """A malformed row: skipped and counted, never fatal on its own."""


@dataclass
class Row:
    input_ids: list[int]
    loss_mask: list[int]


def normalize(obj, fmt: str = "auto"):
    """A raw row -> ("messages", [{role, content, ...}], tools or None) or
    ("tokenized", ids, mask). Assistant tool calls (`tool_calls`, content
    null) and tool turns are kept for the chat template to render; a row's
    `tools` (OpenAI function definitions) go to the template as well."""
    if not isinstance(obj, dict):
        raise RowError("not a JSON object")
    if fmt in ("auto", "tokenized") and "input_ids" in obj:
        ids, mask = obj.get("input_ids"), obj.get("loss_mask")
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            raise RowError("input_ids and loss_mask must be lists of the same length")
        if not ids:
            raise RowError("empty input_ids")
        # a token id is a whole number >= 0 (1.0 from a float column is one; 1.5, "7", true are not)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
                   and float(x).is_integer() for x in ids):
            raise RowError("input_ids must be integers >= 0")
        return "tokenized", [int(x) for x in ids], [1 if x else 0 for x in mask]
    if fmt in ("auto", "messages") and "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    elif fmt in ("auto", "sharegpt") and "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    else:
        want = {"auto": "`messages`, `conversations` or `input_ids`+`loss_mask`",
                "messages": "`messages`", "sharegpt": "`conversations`",
                "tokenized": "`input_ids` and `loss_mask`"}[fmt]
        raise RowError(f"no {want} field")
    if not isinstance(turns, list) or not turns:
        raise RowError("empty conversation")
    msgs = [_turn(i, turn, role_key, text_key) for i, turn in enumerate(turns)]
    if not any(m["role"] == "assistant" for m in msgs):
        raise RowError("no assistant turn")
    return "messages", msgs, _json_field(obj.get("tools"), "tools", list)


def _turn(i: int, turn, role_key: str, text_key: str) -> dict:
    if not isinstance(turn, dict):
        raise RowError(f"turn {i} is not an object")
    if role_key not in turn:
        raise RowError(f"turn {i} has no `{role_key}`")
    role = ROLE_ALIASES.get(str(turn[role_key]).lower())
    if role is None:
        raise RowError(f"turn {i} has unknown role {turn[role_key]!r}")
    content = turn.get(text_key)
    if isinstance(content, list):  # OpenAI content parts: keep the text
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts):   # {"text": 42}: a bad row, not a crash
            raise RowError(f"turn {i} has a content part whose `text` is not a string")
        content = "".join(texts)
    calls = _json_field(turn.get("tool_calls"), f"turn {i} tool_calls", list) \
        if role == "assistant" else None
    if content is None and (calls or role == "tool"):
        content = ""
    if not isinstance(content, str):
        raise RowError(f"turn {i} has no text `{text_key}`")
    msg = {"role": role, "content": content}
    if calls:
        msg["tool_calls"] = [_tool_call(i, c) for c in calls]
    if role == "tool":
        msg.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
    return msg


def _tool_call(i: int, call) -> dict:
    """An OpenAI tool call with its arguments as a mapping, the form chat
    templates expect (datasets often store them as a JSON string)."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RowError(f"turn {i} has a tool call without a function name")
    args = _json_field(fn.get("arguments", {}), f"turn {i} tool call arguments", dict)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args or {}}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def wire_messages(msgs: list[dict]) -> list[dict]:
    """Messages as the OpenAI API takes them (vLLM validates it): tool call
    arguments as JSON text. vLLM parses them back into a mapping for the chat
    template, so the server renders what LocalRenderer renders."""
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[
                dict(c, function=dict(c["function"], arguments=json.dumps(c["function"]["arguments"])))
                for c in m["tool_calls"]])
        out.append(m)
    return out


def _json_field(value, what: str, kind):
    """A field that datasets store either as JSON text or as the value."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError(f"{what} is not valid JSON") from None
    if not isinstance(value, kind):
        raise RowError(f"{what} must be a {'list' if kind is list else 'mapping'}")
    return value


class LocalRenderer:
    """Renders with the tokenizer's chat template; token boundaries from
    character offsets, so BPE merges across a turn boundary do not matter."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")

    def text(self, msgs, gen: bool, tools=None) -> str:
        try:
            return self.tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 - a template's own raise_exception, jinja errors
            raise RowError(f"the target's chat template cannot render it "
                           f"({str(e).splitlines()[0][:120]})") from None

    def rows(self, msgs, tools=None, limit: int | None = None) -> list[Row]:
        full = self.text(msgs, False, tools)
        full, cut = self._window(full, limit)
        spans, stable = [], True
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            upto = self.text(msgs[:j + 1], False, tools)
            start = self._start(msgs[:j], m, upto, tools)
            if start is not None and cut is not None and start >= cut:
                break   # this turn and every later one begin past the cut
            if start is None or not full.startswith(upto):
                stable = False
            spans.append((j, start, len(upto)))
        if stable:
            for j, a, b in spans:
                _check_calls_rendered(msgs[j], full[a:b])
            return [self._row(full, [(a, b) for _, a, b in spans])]
        # Not prefix-stable: one row per assistant turn (up to the cut), each rendered alone.
        rows = []
        for j, _, _ in spans:
            upto = self.text(msgs[:j + 1], False, tools)
            start = self._start(msgs[:j], msgs[j], upto, tools)
            if start is not None:
                _check_calls_rendered(msgs[j], upto[start:])
                rows.append(self._row(upto, [(start, len(upto))]))
        return rows

    SPARE = 16   # tokens past the cut in the window: a window's last tokens may split
    # differently from the whole text's, never those this far before its end

    def _window(self, full: str, limit: int | None) -> tuple[str, int | None]:
        """(the text rows are made of, where token `limit` begins in it): the
        shortest head of `full` that holds `limit` + SPARE tokens, grown by
        doubling, so that a long trace is never tokenized whole; (full, None)
        without a limit or when all of it fits."""
        if limit is None:
            return full, None
        n = 4 * (limit + self.SPARE)
        while True:
            offsets = self.tok(full[:n], add_special_tokens=False,
                               return_offsets_mapping=True)["offset_mapping"]
            if len(offsets) > limit + self.SPARE:
                return full[:n], offsets[limit][0]
            if n >= len(full):
                return full, None
            n *= 2

    def _start(self, before, msg, upto: str, tools) -> int | None:
        """Where assistant turn `msg` begins in `upto` (the conversation
        rendered through it): after the generation prompt of what came
        before. A conversation may open with the assistant, and most
        templates refuse to render an empty one; then the assistant's part
        is what follows a placeholder user turn's generation prompt, found at
        the end of `upto`."""
        if before:
            pre = self.text(before, True, tools)
            return len(pre) if upto.startswith(pre) else None
        probe = [{"role": "user", "content": "."}]
        try:
            pre = self.text(probe, True, tools)
            own = self.text(probe + [msg], False, tools)
        except RowError:
            return None
        if not own.startswith(pre) or not upto.endswith(own[len(pre):]):
            return None
        return len(upto) - (len(own) - len(pre))

    def _row(self, text: str, spans) -> Row:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        mask = [0] * len(ids)
        for a, b in spans:
            for i, (s, _e) in enumerate(offsets):
                if a <= s < b:
                    mask[i] = 1
        return Row(list(ids), mask)


def _check_calls_rendered(msg: dict, rendered: str) -> None:
    """A template without tool support drops `tool_calls` silently: the turn
    would train on an empty answer. Such rows are skipped with the reason."""
    if not msg.get("tool_calls"):
        return
    missing = [c["function"]["name"] for c in msg["tool_calls"]
               if c["function"]["name"] not in rendered]
    if missing:
        raise RowError(f"the target's chat template does not render tool calls "
                       f"({missing[0]!r} is not in its text)")


class EndpointRenderer:
    """Renders through a running vLLM server's /v1/chat/completions/render
    (token ids), with the same boundary method on token ids."""

    def __init__(self, endpoint: str, timeout: float = 30.0, api_key: str | None = None):
        self.url = endpoint.rstrip("/") + ROUTE_CHAT_RENDER
        self.timeout = timeout
        # a server started with --api-key: the variable vLLM's own clients read
        self.api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")

    def ids(self, msgs, gen: bool, tools=None) -> list[int]:
        request = {"messages": wire_messages(msgs), "add_generation_prompt": gen}
        if tools:   # rendered into the prompt; "auto" would need a tool parser on the server
            request.update(tools=tools, tool_choice="none")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps(request).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code == 400:   # the server's template refuses this conversation
                raise RowError(f"the server's chat template cannot render it "
                               f"({e.read()[:120]!r})") from None
            raise ConnectionError(f"{self.url} answered {e.code}: {e.read()[:200]!r}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ConnectionError(f"{self.url}: {getattr(e, 'reason', e)}") from None
        if "token_ids" not in data:
            raise ConnectionError(f"{self.url}: response has no token_ids")
        return data["token_ids"]

    def _start(self, before, msg, upto: list[int], tools) -> tuple[int | None, bool]:
        """LocalRenderer._start on token ids, and whether the boundary is
        exact. A generation prompt that differs from how a finished turn is
        rendered (some templates add an empty think block) leaves the common
        prefix as the best boundary: supervised, but not prefix-stable."""
        if before:
            pre = self.ids(before, True, tools)
            common = 0
            while common < min(len(pre), len(upto)) and pre[common] == upto[common]:
                common += 1
            return common, common == len(pre)
        probe = [{"role": "user", "content": "."}]
        pre, own = self.ids(probe, True, tools), self.ids(probe + [msg], False, tools)
        tail = own[len(pre):]
        if own[:len(pre)] != pre or not tail or upto[-len(tail):] != tail:
            return None, False
        return len(upto) - len(tail), True

    def rows(self, msgs, tools=None, limit: int | None = None) -> list[Row]:
        full = self.ids(msgs, False, tools)
        spans, per_turn, stable = [], [], True
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            upto = self.ids(msgs[:j + 1], False, tools)
            start, exact = self._start(msgs[:j], m, upto, tools)
            if start is None:
                continue   # this turn's boundary cannot be found: not supervised
            if limit is not None and start >= limit:
                break   # this turn and every later one begin past the cut
            if not exact or full[:len(upto)] != upto:
                stable = False
            spans.append((start, len(upto)))
            per_turn.append((start, upto))
        if stable:
            mask = [0] * len(full)
            for a, b in spans:
                mask[a:b] = [1] * (b - a)
            return [Row(full, mask)]
        return [Row(upto, [0] * start + [1] * (len(upto) - start)) for start, upto in per_turn]
