"""docs/benchmarks.md's measured sections from benchmark records
(bench/results.py): what a section says, where it goes, and what a bad
record or a missing part says. Running the scripts: tests/bench/test_bench.py."""

import importlib.util
import json

import pytest

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "results.py")
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)

DOC = """# Benchmarks

### a.py

What a.py measures.

### b.py

What b.py measures.

<!-- measured: b.py -->
old figures
<!-- /measured: b.py -->

More about b.

## Elsewhere
"""


def record(script, **kw):
    return {"script": script, "started_at": 1_796_000_000, "commit": "0123456789abcdef+dirty",
            "machine": {"cpu": "Xeon", "cores": 2, "memory_gib": 23.5, "gpus": []},
            "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "vllm": "0.32.0 (CPU build)"},
            "skipped": None, "command": ["python", f"bench/{script}"], "exit_code": 0,
            "wall_s": 12.3, "output": ["progress", "", "ratio: 1.5x"], "figures": None, **kw}


def test_a_section_says_where_and_with_what_it_was_measured():
    text = results.section(record("a.py", figures={"ratio": 1.5, "rows": [1, 2], "ok": True}))
    assert text.startswith("Measured by `python bench/run_all.py` on 2026-11-30, commit "
                           "`0123456789ab+dirty`; Xeon, 2 cores, 23.5 GiB, no GPU; Python 3.11.7, "
                           "torch 2.13.0+cpu, vllm 0.32.0 (CPU build).")
    assert "`python bench/a.py`: exit 0 in 12 s:\n\n```text\nprogress\nratio: 1.5x\n```" in text
    # the script's own figures: top-level values only (a list is in its file)
    assert "| `ratio` | 1.5 |\n| `ok` | True |" in text and "rows" not in text
    skipped = results.section(record("a.py", skipped="needs a GPU"))
    assert skipped.endswith("Not run there: needs a GPU.") and "```" not in skipped


def test_a_long_output_shows_its_last_lines_and_says_so():
    out = [f"line {i}" for i in range(results.SHOWN_LINES + 5)]
    text = results.section(record("a.py", output=out))
    assert f"(its last {results.SHOWN_LINES} of {results.SHOWN_LINES + 5} lines)" in text
    assert "line 4\n" not in text and f"line {results.SHOWN_LINES + 4}" in text


def test_sections_are_rewritten_in_place_or_added_at_the_end_of_their_part():
    doc = results.rewrite(DOC, {"a.py": record("a.py"), "b.py": record("b.py")})
    assert "old figures" not in doc
    a_part = doc[doc.index("### a.py"):doc.index("### b.py")]
    assert a_part.startswith("### a.py\n\nWhat a.py measures.\n\n<!-- measured: a.py -->\n")
    assert a_part.endswith("<!-- /measured: a.py -->\n\n")
    assert doc.index("<!-- /measured: b.py -->\n\nMore about b.") > doc.index("What b.py")
    assert doc.endswith("More about b.\n\n## Elsewhere\n")
    assert results.rewrite(doc, {"a.py": record("a.py"), "b.py": record("b.py")}) == doc


def test_a_skipped_or_failed_record_never_replaces_figures():
    """A CPU machine's run keeps the section a GPU measured; a failed script
    is run_all's exit code, not a lost figure. Where there is no section yet,
    either says what happened."""
    skipped, failed = record("b.py", skipped="needs a GPU"), record("b.py", exit_code=1)
    assert results.rewrite(DOC, {"b.py": skipped}) == DOC
    assert results.rewrite(DOC, {"b.py": failed}) == DOC
    doc = results.rewrite(DOC, {"a.py": skipped | {"script": "a.py"}})
    assert "Not run there: needs a GPU." in doc[doc.index("### a.py"):doc.index("### b.py")]
    assert "exit 1 in 12 s" in results.rewrite(DOC, {"a.py": failed | {"script": "a.py"}})


def test_a_record_without_its_part_a_damaged_one_or_broken_markers_are_named(tmp_path):
    with pytest.raises(results.RecordError, match=r"no '### c.py' part"):
        results.rewrite(DOC, {"c.py": record("c.py")})
    for broken in (DOC.replace("<!-- /measured: b.py -->\n", ""),
                   DOC + "<!-- measured: b.py -->\n<!-- /measured: b.py -->\n"):
        with pytest.raises(results.RecordError, match=r"markers for b.py .*mend them"):
            results.rewrite(broken, {"b.py": record("b.py")})
    (tmp_path / "a.json").write_text(json.dumps(record("a.py")))
    (tmp_path / "b.json").write_text('{"script": "b.py", "mach')
    with pytest.raises(results.RecordError, match=r"b.json: not a benchmark record .*--only b.py"):
        results.read_all(tmp_path)
    with pytest.raises(results.RecordError, match=r"no such folder of records"):
        results.read_all(tmp_path / "typo")
