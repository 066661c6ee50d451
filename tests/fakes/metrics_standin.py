"""A LABELLED STAND-IN for a serving vLLM's /metrics, for what a real server
cannot show on cue: its counters going back to zero between two reads (a
restart), a read that fails in the middle of a watch, a server that is not
vLLM. Each GET /metrics answers the next body of `bodies` (None: HTTP 503),
the last one again once they run out; /v1/models names `model`; with `key`,
every route wants `Authorization: Bearer <key>`. The real server's counters
are read by tests/vllm/test_vllm_pipeline.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MetricsStandIn:
    def __init__(self, bodies: list[str | None], model: str = "stand-in", key: str | None = None):
        self.bodies, self.model, self.key = list(bodies), model, key
        self.reads = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):   # quiet
                pass

            def do_GET(self):
                if owner.key and self.headers.get("Authorization") != f"Bearer {owner.key}":
                    return self._send(401, "unauthorized")
                if self.path == "/v1/models":
                    return self._send(200, json.dumps({"data": [{"id": owner.model}]}))
                if self.path != "/metrics":
                    return self._send(404, "no")
                body = owner.bodies[min(owner.reads, len(owner.bodies) - 1)]
                owner.reads += 1
                return self._send(503, "starting") if body is None else self._send(200, body)

            def _send(self, code, text):
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
