"""A serving vLLM's /metrics and /v1/models, read as `watch` needs them: one
request at a time (a slow server is never sent another before the last one
answered), a timeout of the interval (1 to 10 s), the API key from the environment
(never a command-line argument: `ps` shows those to every user). Every way a
read can fail is a NoAnswer: the panel says it and keeps the last figures."""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from pipeline.vllm import contract_strings as vs


class WatchInputError(ValueError):
    """Bad input to `watch` (exit 2): a URL it will not read, a key variable unset."""


class NoAnswer(OSError):
    """The server did not answer (unreachable, an HTTP error, a timeout)."""


@dataclass(frozen=True)
class Target:
    """Where to read, and the key to send (None: none)."""
    url: str          # scheme://host:port, no trailing slash, no path
    api_key: str | None = None

    def get(self, route: str, timeout: float) -> str:
        req = urllib.request.Request(self.url + route)
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read(8 << 20).decode("utf-8", "replace")   # /metrics: ~100 KB
        except urllib.error.HTTPError as e:
            raise NoAnswer(f"HTTP {e.code} from {self.url}{route}"
                           + (" (the server wants an API key: --api-key-env VAR)"
                              if e.code == 401 else "")) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
            raise NoAnswer(f"no answer from {self.url}{route}: {reason}") from None

    def metrics(self, timeout: float) -> str:
        return self.get(vs.ROUTE_METRICS, timeout)

    def served_model(self, timeout: float) -> str | None:
        """The model id /v1/models names (the target: vLLM names no draft there)."""
        try:
            data = json.loads(self.get(vs.ROUTE_MODELS, timeout))
            return str(data["data"][0]["id"])
        except (NoAnswer, ValueError, KeyError, IndexError, TypeError):
            return None


def target(url: str, api_key_env: str | None) -> Target:
    """The URL as typed, checked: http(s) with a host; a path is dropped to
    the server's root only when it is vLLM's own /metrics or /."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WatchInputError(f"watch reads an http(s) URL of a vLLM server, e.g. "
                              f"http://127.0.0.1:8000; got {url!r}")
    try:
        _ = parts.port   # (a port that is not a number raises here, not at the first read)
    except ValueError:
        raise WatchInputError(f"{url!r}: the port is not a number") from None
    if parts.path.rstrip("/") not in ("", vs.ROUTE_METRICS):
        raise WatchInputError(f"give the server's address without a path "
                              f"(http://{parts.netloc}), not {url!r}")
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise WatchInputError(f"--api-key-env {api_key_env}: that environment variable "
                                  "is not set (export it with the server's key)")
    return Target(f"{parts.scheme}://{parts.netloc}", key)
