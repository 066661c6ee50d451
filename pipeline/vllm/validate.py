"""vLLM's own validation of a server's command line, without a server:
`python -m pipeline.vllm.validate OUT.json < servers.json`, run with vLLM's
interpreter (pipeline.vllm.validation starts it).

Each server's argv goes through `vllm serve` itself — vLLM's parser, its
`serve` subcommand's checks, and the engine arguments it builds — up to the
moment vLLM has its whole engine config (`EngineArgs.create_engine_config`,
where ModelConfig, SchedulerConfig, the speculative config and VllmConfig
validate what they were given). Then the model is built from that config by
vLLM's own loader (`initialize_model`) on the meta device: each layer picks
its kernels as it is made (a quantized MoE its backend: "No WNA16 MoE backend
supports the deployment configuration" on the CPU build for Kimi-K2.5's
INT4 experts), and no weight is read or allocated. There it stops: no engine
process. So a refusal is vLLM's, in vLLM's words, for this release on this
platform, where reading the source only sees names move. What happens only
with real weights (processing them after loading, a kernel's first call) is
not asked.

Input: a JSON list of {"name", "argv"} (argv: what follows `vllm serve`).
Output (OUT.json, written once all are done): {"import_s", "results":
[{"name", "ok", "error", "step", "seconds"}]} (step: how far vLLM went,
"config" or "model"). It imports the standard library, vLLM (and its torch),
pipeline.vllm.launch and pipeline.vllm.contract: nothing else of ours.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time


class Validated(BaseException):
    """Raised once vLLM has built and checked its engine config and the model
    on the meta device: the server goes no further (BaseException, so that no
    `except Exception` in vLLM's serve path takes it for a failure)."""


class ModelRefused(BaseException):
    """The engine config was accepted; building the model from it was not."""

    def __init__(self, error: BaseException):
        super().__init__(error)
        self.error = error


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
    config as vLLM does, build the model from it on the meta device, then
    stop the server there."""
    from vllm.engine.arg_utils import EngineArgs
    real = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = real(self, *args, **kwargs)
        try:
            build_on_meta(config)
        except Exception as e:  # noqa: BLE001 - the model's refusal, whatever its type
            raise ModelRefused(e) from None
        raise Validated()
    EngineArgs.create_engine_config = create_engine_config


def symbol(name: str):
    """A vLLM function from the first module the contract declares it in
    (pipeline/vllm/contract.py: vLLM moves them one at a time)."""
    import importlib

    from pipeline.vllm import contract
    modules = contract.by_name(name).modules
    for module in modules:
        try:
            found = getattr(importlib.import_module(f"vllm.{module}"), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise ImportError(f"{name} is in none of vllm.{', vllm.'.join(modules)}")


_groups_made = False


def build_on_meta(config) -> None:
    """The model vLLM's loader would build for `config`, on the meta device:
    one process's distributed groups first (gloo, made once), as a worker
    has them, for the layers that ask for their rank."""
    global _groups_made
    import socket

    import torch
    with symbol("set_current_vllm_config")(config):
        if not _groups_made:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            symbol("init_distributed_environment")(
                world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0, backend="gloo")
            symbol("initialize_model_parallel")(tensor_model_parallel_size=1,
                                                pipeline_model_parallel_size=1)
            _groups_made = True
        with symbol("set_default_torch_dtype")(config.model_config.dtype), torch.device("meta"):
            symbol("initialize_model")(vllm_config=config)


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


# A model that cannot be built on the meta device at all (one that moves its
# tensors in its constructor: "Cannot copy out of meta tensor") says nothing
# about this server: its engine config stands, the model is not asked.
META_ONLY = ("meta tensor", "meta device")


def validate_one(argv: list[str], stderr: Tail) -> tuple[str | None, str]:
    """(None when vLLM accepts `vllm serve <argv>`, else its refusal; how far
    vLLM went: "config" or "model")."""
    from pipeline.vllm import launch
    stderr.text = ""
    try:
        launch.main(["serve", *argv])
    except Validated:
        return None, "model"
    except ModelRefused as e:
        said = refusal(e.error, stderr)
        return (None, "config") if any(m in said for m in META_ONLY) else (said, "model")
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any refusal is vLLM's answer
        return refusal(e, stderr), "config"
    return "vllm serve returned before building its engine config", "config"


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
        error, step = validate_one(s["argv"], stderr)
        results.append({"name": s["name"], "ok": error is None, "error": error or "",
                        "step": step, "seconds": round(time.monotonic() - t, 3)})
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump({"import_s": round(import_s, 3), "results": results}, f)
    os.replace(tmp, out)


if __name__ == "__main__":
    main(sys.argv[1])
