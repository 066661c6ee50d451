"""Extraction through the real vLLM server: the capture's overhead, and the
hf backend beside it (same prepared samples, same machine).

    python bench/bench_vllm_extract.py [--samples 0] [--inflight 16] [--rounds 2]
                                       [--hidden 512 --layers 8]
    python bench/bench_vllm_extract.py --samples 16 --rounds 1 --inflight 4   # the smallest (CI)

1. capture: the extract stage with backend "vllm-server" (a real `vllm serve`
   of the tiny target with `extract_hidden_states` and eagle-panel's connector
   writing and the stage validating every file); tokens/s from the server being
   ready to the last file checked (the stage's own summary).
2. no capture: the same server command without the speculative and KV-transfer
   configs, answering the same prompt-only requests (max_tokens 1) with the
   same concurrency: what vLLM does anyway. Ratio capture / no capture: the
   capture's cost (target >= 0.9x).
3. hf: the extract stage with backend "hf" on the same samples.
--hidden/--layers: a random Llama of that size (the built-in tokenizer) instead
of the built-in 128-wide, 4-layer target, whose forward is so cheap that
copying 4 layers of its hidden states costs about as much as computing them.
Uses .venv-vllm (scripts/install.sh); on a GPU server set VLLM_PYTHON=... and
the same script measures there.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("vllm",)   # to run at its defaults (bench/run_all.py): extraction through vLLM
sys.path.insert(0, str(ROOT))

from pipeline.paths import VLLM_VENV, pythonpath_with_project  # noqa: E402
from pipeline.vllm import contract_strings as vs  # noqa: E402
from tests.configs import write  # noqa: E402


def random_target(tmp: Path, hidden: int, layers: int) -> Path:
    """A random Llama of the given size with the built-in tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.builtin.tiny_model import ensure_built
    out = tmp / f"llama-{hidden}x{layers}"
    tok = AutoTokenizer.from_pretrained(str(ensure_built()))
    tok.save_pretrained(out)
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def stage(tmp: Path, name: str, backend: str, a) -> dict:
    from pipeline.run.events import read_events
    layer_ids = [1, a.layers // 2, a.layers - 2] if a.layers else [1, 2, 3]
    write(tmp / "config.toml", {
        "run": {"name": "bench", "runs_dir": "runs"}, "model": {"target": a.target},
        "runtime": {"vllm_python": a.vllm_python}, "data": {"max_samples": a.samples},
        "stages": {"extract": {"backend": backend, "layer_ids": layer_ids,
                               "max_inflight": a.inflight}}})
    env = dict(os.environ, PYTHONPATH=pythonpath_with_project(os.environ.get("PYTHONPATH")))
    subprocess.run([sys.executable, "-m", f"pipeline.stages.{name}", "--run-dir",
                    str(tmp / "runs/bench"), "--config", str(tmp / "config.toml")],
                   env=env, check=True, capture_output=True)
    ev = [e for e in read_events(tmp / "runs/bench" / name / "events.jsonl")
          if e["type"] == "stage_finished"][-1]
    return ev["summary"]


def no_capture(tmp: Path, a) -> float:
    """The same server and requests, without the extraction flags: tokens/s."""
    from pipeline.builtin.tiny_model import ensure_built
    from pipeline.extract.job import RowIds
    from pipeline.vllm.environment import probe, process_env
    from pipeline.vllm.kv_plan import cpu_kv_space_gib
    from pipeline.vllm.server import VllmServer, free_port, serve_argv
    env = probe(a.vllm_python)
    rows = RowIds(tmp / "runs/bench/prepare/out/data")
    lengths = rows.lengths()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    port, key = free_port(), secrets.token_hex(8)
    max_len = max(lengths) + 8
    target = ensure_built() if a.target.startswith("builtin:") else Path(a.target)
    argv = serve_argv(env.python, "", target, port, 1, "float32", max_len, False,
                      [vs.FLAG_NO_CHUNKED_PREFILL], eager=env.cpu_build)
    server = VllmServer(0, argv, port, key, [], tmp / "plain.log",
                        process_env(env, [], cpu_kv_space_gib(a.inflight * max_len, 1 << 16)))
    server.start()
    try:
        server.wait_ready(600, lambda: False)
        todo = list(order)
        lock = threading.Lock()
        tokens = [0]

        def client():
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                ids = rows[i]
                server.post(vs.ROUTE_COMPLETIONS, {"model": str(target), "prompt": ids,
                                                   "max_tokens": 1, "temperature": 0.0}, 600)
                with lock:
                    tokens[0] += len(ids)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(a.inflight)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return tokens[0] / (time.perf_counter() - t0)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=0, help="rows of the bundled data (0 = all)")
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON",
                                                            str(VLLM_VENV / "bin" / "python")))
    ap.add_argument("--hidden", type=int, default=0, help="a random target this wide")
    ap.add_argument("--layers", type=int, default=0, help="... with this many layers")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    a.target = str(random_target(tmp, a.hidden, a.layers)) if a.hidden else "builtin:tiny-llama"
    try:
        stage(tmp, "prepare", "hf", a)
        hs = tmp / "runs/bench/extract/out/hidden_states"
        results = {"capture": [], "no capture": [], "hf": []}
        for r in range(a.rounds):
            for backend, label in (("vllm-server", "capture"), ("hf", "hf")):
                shutil.rmtree(hs, ignore_errors=True)
                s = stage(tmp, "extract", backend, a)
                results[label].append(s["tokens_per_s"])
                print(f"round {r}: {label:10} {s['tokens_per_s']:9,.0f} tokens/s "
                      f"({s['tokens']:,} tokens, {s['computed']} samples)", flush=True)
            tps = no_capture(tmp, a)
            results["no capture"].append(tps)
            print(f"round {r}: {'no capture':10} {tps:9,.0f} tokens/s", flush=True)
        best = {k: max(v) for k, v in results.items()}
        print(f"\nbest of {a.rounds}: capture {best['capture']:,.0f}, no capture "
              f"{best['no capture']:,.0f}, hf {best['hf']:,.0f} tokens/s")
        print(f"capture / no capture: {best['capture'] / best['no capture']:.2f}x "
              f"(target >= 0.9x); capture / hf: {best['capture'] / best['hf']:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
