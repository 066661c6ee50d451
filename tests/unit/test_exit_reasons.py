"""Saying why a process failed: the lines of its log a person needs, each
short enough to read (vLLM logs its whole engine config in one error line)."""

from pipeline.run.exit_reasons import LINE_MAX, PLAIN, explain_exit, quote_error
from pipeline.vllm.log_shape import VLLM


def test_the_explaining_line_is_kept_and_a_config_dump_is_cut():
    dump = "(EngineCore pid=7) ERROR 12-01 03:00:00 [core.py:9] EngineCore failed to start " \
        "with config: " + ", ".join(f"key_{i}=value_{i}" for i in range(400))
    log = [
        "(EngineCore pid=7) INFO 12-01 03:00:00 [core.py:1] starting",
        dump,
        "Traceback (most recent call last):",
        '  File "/x/vllm/v1/attention/backends/mla/common.py", line 9, in check',
        "    raise ValueError(msg)",
        "(EngineCore pid=7) ValueError: Head dimension 48 is not supported by MLA.",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    quoted = quote_error(log, shape=VLLM)
    assert "ValueError: Head dimension 48 is not supported by MLA." in quoted
    assert "root cause above" not in quoted        # a wrapper that only points elsewhere
    assert all(len(line) <= LINE_MAX + 40 for line in quoted.splitlines())
    cut = [line for line in quoted.splitlines() if "characters cut" in line]
    assert len(dump) > 5000 and cut and cut[0].startswith(dump[:100])
    assert cut[0].endswith(dump[-40:])


def test_deaths_by_signal_are_named():
    assert explain_exit(-4).startswith("was killed by SIGILL: this build uses CPU instructions")
    assert explain_exit(1) == "exited with code 1" and explain_exit(None) == "is still running"


def test_a_logs_shape_is_handed_down_by_who_knows_it():
    """run/ knows no program's log lines: without vLLM's shape (pipeline.vllm
    hands it down; the driver passes it to each stage's supervisor:
    tests/integration/test_runner.py) a line behind vLLM's prefix is not read
    as the error, and its wrapper error is not known for a pointer."""
    from tests.fakes.stagekit import VLLM_CRASH as log
    assert quote_error(log, shape=VLLM) == log[1]
    assert quote_error(log, shape=PLAIN) == "\n".join(log)   # nothing read as the cause
