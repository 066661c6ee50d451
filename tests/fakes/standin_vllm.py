"""STAND-IN for `vllm serve`, for what a real vLLM on a CPU cannot show
(several GPU servers in data parallel, a GPU-only connector generation,
deaths that cannot be caused for real): an HTTP server with the same
command line subset, endpoints and file protocols as vLLM >= 0.17 running
the `extract_hidden_states` method — with vLLM's stock
ExampleHiddenStatesConnector (a file per request id) or with eagle-panel's
connector (pipeline.vllm.connector: hs_{i}.safetensors, tmp + rename) —
used only by the tests. The real vLLM's tests are tests/vllm/test_vllm_real.py.

- /health: 200 once "loaded"; /metrics: vllm:kv_cache_usage_perc etc.
- /v1/completions with a token-id prompt: computes the hidden states with a
  real transformers forward of the target (the hf backend's hooks, so the
  vLLM layer convention holds), writes `<storage>/<req_id>.safetensors`
  (`hidden_states [tokens, layers, hidden]` bf16, `token_ids`) and answers
  with `kv_transfer_params.hidden_states_path`. With --standin-version >=
  0.22 the write happens after the answer, under an exclusive flock on
  `<file>.lock`, as the real connector does.
- Prints vLLM's KV-cache log lines (0.22's format strings).
- /v1/* answers 401 without its API key (VLLM_API_KEY, or `--api-key`).
- Failure switches: --standin-fail-start (dies while loading, with an
  error in its log), --standin-die-after N (exits after N requests),
  --standin-sigill (dies by SIGILL while starting, as a wrong-ISA build does).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--no-enable-chunked-prefill", action="store_true")
    ap.add_argument("--speculative-config", required=True)
    ap.add_argument("--kv-transfer-config", required=True)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--standin-version", default="0.22.0")
    ap.add_argument("--standin-fail-start", action="store_true")
    ap.add_argument("--standin-die-after", type=int, default=0)
    ap.add_argument("--standin-worker", action="store_true",
                    help="also start a child process, as vLLM's workers are")
    ap.add_argument("--standin-sigill", action="store_true")
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))   # as vLLM does
    a, _ignored = ap.parse_known_args()   # --enforce-eager and the like
    spec = json.loads(a.speculative_config)
    kv = json.loads(a.kv_transfer_config)
    assert spec["method"] == "extract_hidden_states", spec
    own = kv["kv_connector"] == "HiddenStatesConnector"
    assert own or kv["kv_connector"] == "ExampleHiddenStatesConnector", kv
    if own:
        assert kv["kv_connector_module_path"] == "pipeline.vllm.connector", kv
    layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    storage = Path(kv["kv_connector_extra_config"]["shared_storage_path"])
    print(f"INFO [api_server.py:1] STAND-IN vLLM {a.standin_version} args: {vars(a)}", flush=True)
    if a.standin_worker:
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    if a.standin_sigill:
        import signal
        print("INFO [core.py:1] loading the model (STAND-IN, about to die by SIGILL)", flush=True)
        os.kill(os.getpid(), signal.SIGILL)
    if a.standin_fail_start:
        time.sleep(0.5)
        print("ERROR [core.py:1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
              "1.50 GiB (STAND-IN)", flush=True)
        sys.exit(1)

    import torch
    from safetensors.torch import save_file

    from pipeline.extract.hf import HFBackend
    from pipeline.model.hsfile import write_sample
    backend = HFBackend.load(Path(a.model), layer_ids, "cpu", torch.float32,
                             a.trust_remote_code)
    dtype = getattr(torch, a.dtype)
    print("INFO [gpu_worker.py:467] Available KV cache memory: 12.50 GiB", flush=True)
    print("INFO [kv_cache_utils.py:1733] GPU KV cache size: 116,480 tokens", flush=True)
    print(f"INFO [kv_cache_utils.py:1735] Maximum concurrency for {a.max_model_len:,} tokens "
          f"per request: {116480 / a.max_model_len:.2f}x", flush=True)
    async_write = tuple(map(int, a.standin_version.split(".")[:2])) >= (0, 22)
    state = {"served": 0, "running": 0}
    lock = threading.Lock()
    forward_lock = threading.Lock()

    def write(path: Path, tensors: dict, lock_fd):
        try:
            time.sleep(0.05)  # the real connector writes from a thread pool, later
            if own:
                write_sample(path, tensors["hidden_states"], tensors["token_ids"])
            else:
                save_file(tensors, str(path))
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body: bytes, ctype="application/json"):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                with lock:
                    running = state["running"]
                text = (f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {running * 0.01}\n'
                        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
                        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0\n')
                self._send(200, text.encode(), "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.headers.get("Authorization") != f"Bearer {a.api_key}":
                self._send(401, b'{"error": "Unauthorized"}')
                return
            ids = req["prompt"]
            assert req["max_tokens"] == 1 and isinstance(ids, list)
            with lock:
                state["running"] += 1
            try:
                with forward_lock:
                    hs = backend.forward([ids])[0].to(dtype).contiguous()
                req_id = f"cmpl-{uuid.uuid4().hex}-0"
                print(f"INFO [logger.py:1] Received request {req_id}: prompt of {len(ids)} "
                      f"tokens (STAND-IN, CUDA_VISIBLE_DEVICES="
                      f"{os.environ.get('CUDA_VISIBLE_DEVICES')})", flush=True)
                index = (req.get("kv_transfer_params") or {}).get("eagle_panel_index")
                path = storage / (f"hs_{index}.safetensors" if own else f"{req_id}.safetensors")
                tensors = {"hidden_states": hs, "token_ids": torch.tensor(ids, dtype=torch.long)}
                if async_write:
                    fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    threading.Thread(target=write, args=(path, tensors, fd)).start()
                else:
                    save_file(tensors, str(path))
                body = {"id": req_id, "object": "text_completion", "model": req["model"],
                        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                        "kv_transfer_params": {"hidden_states_path": str(path)}}
                self._send(200, json.dumps(body).encode())
            finally:
                with lock:
                    state["running"] -= 1
                    state["served"] += 1
                    served = state["served"]
            if a.standin_die_after and served >= a.standin_die_after:
                print("ERROR [core.py:1] EngineCore died (STAND-IN --standin-die-after)",
                      flush=True)
                os._exit(3)

    ThreadingHTTPServer((a.host, a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
