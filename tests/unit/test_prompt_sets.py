"""The prompt files evaluate reads, and the one it writes (prompts.jsonl, which
an export ships): every kind of prompt read back as itself; a bad row named
by file and line."""

import json

import pytest

from pipeline.data.prompt_sets import Prompt, as_row, from_jsonl, from_token_ids
from pipeline.stage_error import StageError

PROMPTS = [Prompt("81", "writing", ["Write a poem.", "Now shorter."], "turns"),
           Prompt("2", "all", [[{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"}]], "messages"),
           Prompt("3", "all", ["Once upon a time"], "text"),
           *from_token_ids([[1, 2, 3], [7]])]


def test_as_row_reads_back_as_the_same_prompt(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(as_row(p)) + "\n" for p in PROMPTS))
    assert from_jsonl(path) == PROMPTS


@pytest.mark.parametrize("row, says", [
    ({"prompt": [1, "2"]}, "line 2: no `turns`, `messages` list or `prompt` (text or token ids)"),
    ({"prompt": [True]}, "line 2: no `turns`"),
    ({"prompt": []}, "line 2: no `turns`"),
    ({"turns": []}, "line 2: no `turns`"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, row, says):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(StageError) as e:
        from_jsonl(path)
    assert str(path) in str(e.value) and says in str(e.value)
