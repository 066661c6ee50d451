"""One server for every checkpoint evaluate measures: the target loaded once,
each further checkpoint's draft loaded into the running drafter.

On the user's target a server start is the expensive thing (a trillion-
parameter MoE over 8 GPUs: 10-20 minutes of loading, profiling and graph
capture); evaluate with `checkpoints = "all"` started one per checkpoint.
Now the first checkpoint's server stays up and the next ones are swapped in:

    POST /collective_rpc {"method": swap_worker.METHOD, "args": [folder]}
    POST /reset_prefix_cache        (the old draft's cached KV must not be reused)

The server starts with `--worker-extension-cls` (swap_worker.DraftSwap: the
load, inside each worker, through vLLM's own in-place reload) and with
vLLM's development routes on (VLLM_SERVER_DEV_MODE=1), which vLLM's own key
check leaves open: `--middleware` route_guard.require_key asks the run's
key of them, so only the run's owner reaches them.

Where a swap cannot give what a fresh server would (another architecture,
other tensor names, shapes or dtypes, a shared tensor that differs) or the
installed vLLM lacks what it needs (`unavailable`, read from its source:
doctor says the same before launch), evaluate restarts the server instead
and says why in its log and results. Standard library only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.model.info import tensor_specs
from pipeline.vllm import compat, contract
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.swap_worker import METHOD

EXTENSION = "pipeline.vllm.swap_worker.DraftSwap"
GUARD = "pipeline.vllm.route_guard.require_key"
SERVER_FLAGS = [vs.FLAG_WORKER_EXTENSION_CLS, EXTENSION, vs.FLAG_MIDDLEWARE, GUARD]
SERVER_ENV = {contract.ENV_SERVER_DEV_MODE: "1"}
RESET_TRIES = 20
RPC_MODULES = ("entrypoints.serve.dev.rpc.api_router", "entrypoints.openai.api_server")


class SwapFailed(Exception):
    """The running server could not take the checkpoint: restart instead."""


def unavailable(src, server_args: list[str]) -> str | None:
    """Why this vLLM cannot swap drafts (None: it can), from its source."""
    if src is None:
        return "the installed vLLM's source cannot be read"
    if any(a.split("=", 1)[0] == vs.FLAG_WORKER_EXTENSION_CLS for a in server_args):
        return f"server_args set a {vs.FLAG_WORKER_EXTENSION_CLS} of their own"
    if compat.v1_runner_removed(src):   # before the uses: V1's are gone, but that is not why
        return (f"vLLM {src.version} removed Model Runner V1, the only runner the swap is "
                "proven on (vLLM's CPU build, 0.32); under V2 (vllm/v1/worker/gpu/"
                "model_runner.py) it is unproven: its in-place reload places the weights on "
                "load_config.device or device_config.device, which only a GPU can check")
    uses = [u for u in contract.USES if "swap" in u.routes]
    runners = [u for u in uses if u.name.endswith(".get_draft_model")]   # V1's, V2's
    for u in uses:
        m = None if u in runners else contract.check_use(src, u, set())
        if m is not None:
            return f"vLLM {src.version}: {u.name} {m.what}"
    if all(contract.check_use(src, u, set()) for u in runners):
        return f"vLLM {src.version}: neither model runner has get_draft_model"
    if not any(vs.ROUTE_COLLECTIVE_RPC.strip("/") in (src.text(m) or "") for m in RPC_MODULES):
        return f"vLLM {src.version} has no {vs.ROUTE_COLLECTIVE_RPC} route"
    return None


def incompatible(started: Path, new: Path) -> str | None:
    """Why checkpoint folder `new` cannot be loaded into a server that
    started with `started` (None: it can): a fresh server would build
    another drafter from it."""
    try:
        a, b = (json.loads((Path(f) / "config.json").read_text()) for f in (started, new))
        ta, tb = tensor_specs(Path(started)), tensor_specs(Path(new))
    except (OSError, ValueError) as e:
        return f"cannot read the checkpoint ({e})"
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        return f"its config.json differs from the served one's in {', '.join(diff[:5])}"
    if ta.keys() != tb.keys():
        names = sorted(ta.keys() ^ tb.keys())
        return f"its tensors differ by name ({', '.join(names[:5])})"
    other = sorted(n for n in ta if ta[n] != tb[n])
    if other:
        n = other[0]
        return f"{n} is {tb[n][0]} {list(tb[n][1])}, the served one {ta[n][0]} {list(ta[n][1])}"
    return None


def swap(server, folder: Path, timeout: float) -> dict:
    """Load `folder` into the running server's drafter (every worker) and
    drop its prefix cache. Returns the first worker's report."""
    try:
        r = server.post(vs.ROUTE_COLLECTIVE_RPC, {"method": METHOD, "args": [str(folder)]},
                        timeout)
    except OSError as e:
        raise SwapFailed(f"{vs.ROUTE_COLLECTIVE_RPC} failed ({e})") from None
    results = r.get("results") or [{"error": f"no answer from the workers: {r}"}]
    errors = [x["error"] for x in results if isinstance(x, dict) and x.get("error")]
    if errors or not all(isinstance(x, dict) for x in results):
        raise SwapFailed(errors[0] if errors else f"unexpected answer {results}")
    # {"success": false} while blocks are still held (vLLM: "callers may retry")
    for _ in range(RESET_TRIES):
        try:
            r = server.post(vs.ROUTE_RESET_PREFIX_CACHE, {}, timeout)
        except OSError as e:
            raise SwapFailed(f"{vs.ROUTE_RESET_PREFIX_CACHE} failed ({e})") from None
        if r.get("success", True):
            return results[0]
        time.sleep(0.5)
    raise SwapFailed(f"{vs.ROUTE_RESET_PREFIX_CACHE} refused {RESET_TRIES} times "
                     "(blocks still held)")
