"""Assistant-only loss masks from any chat template, by the boundary method.

For assistant turn j, the conversation rendered up to turn j with the
generation prompt ends where the assistant's text begins, and rendered up to
turn j+1 ends where it stops: the tokens between are supervised. This is
how speculators 0.9 masks through vLLM's render endpoint; here it runs with
the tokenizer's own `apply_chat_template` as well, so it works for templates
without `{% generation %}` tags and without a server.

Templates that rewrite earlier turns (some drop past reasoning) are not
prefix-stable; such a conversation becomes one row per assistant turn.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

ROLE_ALIASES = {
    "system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
    "human": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
}


class RowError(ValueError):
    """A malformed row: skipped and counted, never fatal on its own."""


@dataclass
class Row:
    input_ids: list[int]
    loss_mask: list[int]


def normalize(obj, fmt: str = "auto"):
    """A raw row -> ("messages", [{role, content}]) or ("tokenized", ids, mask)."""
    if not isinstance(obj, dict):
        raise RowError("not a JSON object")
    if fmt in ("auto", "tokenized") and "input_ids" in obj:
        ids, mask = obj.get("input_ids"), obj.get("loss_mask")
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            raise RowError("input_ids and loss_mask must be lists of the same length")
        if not ids:
            raise RowError("empty input_ids")
        try:
            return "tokenized", [int(x) for x in ids], [1 if x else 0 for x in mask]
        except (TypeError, ValueError):
            raise RowError("input_ids must be integers") from None
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
    msgs = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"turn {i} is not an object")
        if role_key not in turn:
            raise RowError(f"turn {i} has no `{role_key}`")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise RowError(f"turn {i} has unknown role {turn[role_key]!r}")
        content = turn.get(text_key)
        if isinstance(content, list):  # OpenAI content parts: keep the text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise RowError(f"turn {i} has no text `{text_key}`")
        msgs.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in msgs):
        raise RowError("no assistant turn")
    return "messages", msgs


class LocalRenderer:
    """Renders with the tokenizer's chat template; token boundaries from
    character offsets, so BPE merges across a turn boundary do not matter."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")

    def text(self, msgs, gen: bool) -> str:
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def rows(self, msgs) -> list[Row]:
        full = self.text(msgs, False)
        spans, stable = [], True
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            pre = self.text(msgs[:j], True) if j else self._empty_prompt()
            upto = self.text(msgs[:j + 1], False)
            if pre is None or not (upto.startswith(pre) and full.startswith(upto)):
                stable = False
            spans.append((j, len(pre or ""), len(upto)))
        if stable:
            return [self._row(full, [(a, b) for _, a, b in spans])]
        # Not prefix-stable: one row per assistant turn, each rendered alone.
        rows = []
        for j, _, _ in spans:
            pre = self.text(msgs[:j], True) if j else self._empty_prompt()
            upto = self.text(msgs[:j + 1], False)
            if pre is not None and upto.startswith(pre):
                rows.append(self._row(upto, [(len(pre), len(upto))]))
        return rows

    def _empty_prompt(self):
        try:
            return self.text([], True)
        except Exception:  # noqa: BLE001 - many templates reject an empty list
            return None

    def _row(self, text: str, spans) -> Row:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        mask = [0] * len(ids)
        for a, b in spans:
            for i, (s, _e) in enumerate(offsets):
                if a <= s < b:
                    mask[i] = 1
        return Row(list(ids), mask)


class EndpointRenderer:
    """Renders through a running vLLM server's /v1/chat/completions/render
    (token ids), with the same boundary method on token ids."""

    def __init__(self, endpoint: str, timeout: float = 30.0):
        self.url = endpoint.rstrip("/") + "/v1/chat/completions/render"
        self.timeout = timeout

    def ids(self, msgs, gen: bool) -> list[int]:
        body = json.dumps({"messages": msgs, "add_generation_prompt": gen}).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise ConnectionError(f"{self.url} answered {e.code}: {e.read()[:200]!r}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ConnectionError(f"{self.url}: {getattr(e, 'reason', e)}") from None
        if "token_ids" not in data:
            raise ConnectionError(f"{self.url}: response has no token_ids")
        return data["token_ids"]

    def rows(self, msgs) -> list[Row]:
        full = self.ids(msgs, False)
        spans, per_turn, stable = [], [], True
        for j, m in enumerate(msgs):
            if m["role"] != "assistant" or j == 0:
                continue
            pre, upto = self.ids(msgs[:j], True), self.ids(msgs[:j + 1], False)
            if upto[:len(pre)] != pre or full[:len(upto)] != upto:
                stable = False
            spans.append((len(pre), len(upto)))
            per_turn.append((pre, upto))
        if stable:
            mask = [0] * len(full)
            for a, b in spans:
                mask[a:b] = [1] * (b - a)
            return [Row(full, mask)]
        rows = []
        for pre, upto in per_turn:
            common = 0
            while common < min(len(pre), len(upto)) and pre[common] == upto[common]:
                common += 1
            rows.append(Row(upto, [0] * common + [1] * (len(upto) - common)))
        return rows
