"""vLLM's own validation of a server's command line, without a server:
`python -m pipeline.vllm.validate OUT.json < servers.json`, run with vLLM's
interpreter (pipeline.vllm.validation starts it).

Each server's argv goes through `vllm serve` itself — vLLM's parser, its
`serve` subcommand's checks, and the engine arguments it builds — up to the
moment vLLM has its whole engine config (`EngineArgs.create_engine_config`,
where ModelConfig, SchedulerConfig, the speculative config and VllmConfig
validate what they were given). There it stops: no engine process, no
weights loaded. So a refusal is vLLM's, in vLLM's words, for this release
on this platform, where reading the source only sees names move.

Input: a JSON list of {"name", "argv"} (argv: what follows `vllm serve`).
Output (OUT.json, written once all are done): {"import_s", "results":
[{"name", "ok", "error", "seconds"}]}. Standard library and vLLM only.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time


class Validated(BaseException):
    """Raised once vLLM has built and checked its engine config: the server
    goes no further (BaseException, so that no `except Exception` in vLLM's
    serve path takes it for a failure)."""


class Tail(io.TextIOBase):
    """stderr, passed on and its last characters kept: argparse says what it
    refuses there before it exits."""

    def __init__(self, inner, keep: int = 4000):
        self.inner, self.keep, self.text = inner, keep, ""

    def write(self, s: str) -> int:
        self.text = (self.text + s)[-self.keep:]
        return self.inner.write(s)

    def flush(self) -> None:
        self.inner.flush()


def stop_at_engine_config() -> None:
    """Wrap vLLM's EngineArgs.create_engine_config: build and validate the
    config as vLLM does, then stop the server there."""
    from vllm.engine.arg_utils import EngineArgs
    real = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise Validated()
    EngineArgs.create_engine_config = create_engine_config


def refusal(e: BaseException, stderr: Tail) -> str:
    """vLLM's words for a refusal: argparse's `error:` line, or the exception."""
    if isinstance(e, SystemExit):
        lines = [ln for ln in stderr.text.splitlines() if "error:" in ln]
        return lines[-1].strip() if lines else f"vllm serve exited with status {e.code}"
    if type(e).__name__ == "ValidationError":   # pydantic's, from vLLM's config classes
        return pydantic_words(str(e))
    return f"{type(e).__name__}: {e}".strip()


def pydantic_words(text: str) -> str:
    """"1 validation error for SchedulerConfig / Value error, <what> [type=...] /
    For further information ..." as "SchedulerConfig: <what>"."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    where = lines[0].rsplit(" for ", 1)[-1] if lines else "vLLM"
    said = [ln.split(" [type=")[0].removeprefix("Value error, ") for ln in lines[1:]
            if not ln.startswith("For further information")]
    return f"{where}: {' '.join(said)}"


def validate_one(argv: list[str], stderr: Tail) -> str | None:
    """None when vLLM accepts `vllm serve <argv>`, else its refusal."""
    from pipeline.vllm import launch
    stderr.text = ""
    try:
        launch.main(["serve", *argv])
    except Validated:
        return None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any refusal is vLLM's answer
        return refusal(e, stderr)
    return "vllm serve returned before building its engine config"


def main(out: str) -> None:
    servers = json.load(sys.stdin)
    t0 = time.monotonic()
    stop_at_engine_config()
    import_s = time.monotonic() - t0
    stderr = Tail(sys.stderr)
    sys.stderr = stderr
    results = []
    for s in servers:
        t = time.monotonic()
        error = validate_one(s["argv"], stderr)
        results.append({"name": s["name"], "ok": error is None, "error": error or "",
                         "seconds": round(time.monotonic() - t, 3)})
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump({"import_s": round(import_s, 3), "results": results}, f)
    os.replace(tmp, out)


if __name__ == "__main__":
    main(sys.argv[1])
