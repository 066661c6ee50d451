"""The run's key on every route of a vLLM server that vLLM leaves open:
`--middleware pipeline.vllm.route_guard.require_key`, on the servers that
start with vLLM's development routes on (VLLM_SERVER_DEV_MODE=1: evaluate's,
which swaps drafts through /collective_rpc and /reset_prefix_cache).

vLLM's own key check (VLLM_API_KEY) guards only paths under /v1, /v2,
/inference and /cohere (entrypoints/serve/middleware/authenticate.py), so
with development mode on, /collective_rpc — which calls any method of the
workers — would be open to every local user of a shared machine. This
middleware runs in the API server's process and asks the same key, from
the same variable, of every other path, except the read-only ones the
project and monitoring read without it. No key in the environment: every
guarded request is refused (closed, not open). Standard library and
starlette (vLLM's own dependency) only.
"""

from __future__ import annotations

import hmac
import os

from pipeline.vllm import contract_strings as vs
from pipeline.vllm.contract import ENV_API_KEY

# read-only routes left open: the health check and Prometheus (the project reads both)
OPEN = {("GET", vs.ROUTE_HEALTH), ("GET", vs.ROUTE_METRICS)}


def allowed(method: str, path: str, authorization: str, key: str) -> bool:
    """Whether a request may pass: an open or vLLM-guarded route, or the key."""
    if (method, path) in OPEN or path.startswith(vs.KEYED_BY_VLLM):
        return True
    return bool(key) and hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())


async def require_key(request, call_next):
    """The ASGI middleware vLLM adds with app.middleware("http")."""
    if allowed(request.method, request.url.path, request.headers.get("authorization", ""),
               os.environ.get(ENV_API_KEY, "")):
        return await call_next(request)
    from starlette.responses import JSONResponse
    return JSONResponse({"error": "this route needs the run's key (Authorization: Bearer)"},
                        status_code=401)
