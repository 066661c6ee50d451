"""The datasets people actually have, one JSONL line per case: a byte-order
mark, OpenAI's `developer` role, agentic turns (`tool_calls` with content
null, `tool` turns, a row's `tools`), a conversation the assistant opens,
ShareGPT with LLaMA-Factory's tool roles, content parts, very long lines,
NUL characters, invalid UTF-8, broken JSON, and rows nobody can use.

CASES is (label, the line's bytes, accepted?). tests/integration/test_stages.py runs
the real prepare stage on it with the built-in target and checks each
line's fate and what got supervised.
"""

from __future__ import annotations

import json

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _j(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def _chat(*turns) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


AGENTIC = {
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "user", "content": "Is it raining in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "light rain, 12 C"},
        {"role": "assistant", "content": "Yes, light rain and 12 degrees."},
    ]}
# OpenAI's wire form: arguments as a JSON string, tools as given by the API
AGENTIC_STRING_ARGS = {
    "tools": json.dumps([WEATHER_TOOL]),
    "messages": [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "content": "snow"},
        {"role": "assistant", "content": "Snow in Oslo."},
    ]}

CASES: list[tuple[str, bytes, bool]] = [
    ("byte-order mark on the first line",
     b"\xef\xbb\xbf" + _j(_chat(("user", "hello"), ("assistant", "Hi! How can I help?"))), True),
    ("developer role", _j(_chat(("developer", "Be terse."), ("user", "2+2?"),
                                ("assistant", "4"))), True),
    ("tool_calls with content null, tool turn, tools", _j(AGENTIC), True),
    ("tool call arguments and tools as JSON strings", _j(AGENTIC_STRING_ARGS), True),
    ("the assistant speaks first", _j(_chat(("assistant", "Welcome back! Shall we go on?"),
                                            ("user", "yes"), ("assistant", "Good."))), True),
    ("ShareGPT", _j({"conversations": [{"from": "human", "value": "name a colour"},
                                       {"from": "gpt", "value": "blue"}]}), True),
    ("ShareGPT with function_call / observation",
     _j({"conversations": [{"from": "human", "value": "weather in Rome"},
                           {"from": "function_call",
                            "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}"},
                           {"from": "observation", "value": "sunny"},
                           {"from": "gpt", "value": "Sunny in Rome."}]}), True),
    ("OpenAI content parts", _j({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "describe "},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}), True),
    ("very long line (a 300 KB answer, cut at seq_length)",
     _j(_chat(("user", "write a lot"), ("assistant", "word " * 60_000))), True),
    ("NUL characters inside the text (escaped)",
     _j(_chat(("user", "a\u0000b"), ("assistant", "c\u0000d"))), True),
    ("pre-tokenized row", _j({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}), True),
    ("mixed keys: a system turn in ShareGPT", _j({"conversations": [
        {"from": "system", "value": "be kind"}, {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"}]}), True),
    # rows nobody can use: skipped with their line numbers
    ("raw NUL bytes (not JSON)", b'{"messages": [\x00\x00]}', False),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', False),
    ("empty line", b"", False),
    ("truncated JSON", b'{"messages": [{"role": "user", "content": "hi"}', False),
    ("not an object", b"[1, 2, 3]", False),
    ("unknown role", _j(_chat(("narrator", "once upon a time"), ("assistant", "..."))), False),
    ("no assistant turn", _j(_chat(("user", "hello?"))), False),
    ("assistant content null without tool calls",
     _j({"messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "content": None}]}), False),
    ("tool call arguments that are not JSON", _j({"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{city: Rome"}}]}]}),
     False),
    ("tool call without a name", _j({"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]}), False),
    ("the assistant only after seq_length",
     _j(_chat(("user", "long " * 5_000), ("assistant", "short"))), False),
    ("tokenized row with mismatched lengths", _j({"input_ids": [1, 2], "loss_mask": [1]}), False),
]


def write(path) -> tuple[list[int], list[int]]:
    """Write the corpus; (accepted line numbers, skipped line numbers)."""
    with open(path, "wb") as f:
        for _, line, _ in CASES:
            f.write(line + b"\n")
    accepted = [n for n, (_, _, ok) in enumerate(CASES, 1) if ok]
    skipped = [n for n, (_, _, ok) in enumerate(CASES, 1) if not ok]
    return accepted, skipped
