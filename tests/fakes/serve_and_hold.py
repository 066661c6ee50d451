"""A test stage that starts a real `vllm serve` of the target the way every
stage does (pipeline.vllm.server.make_server: its own process group, the
stage's session, the attempt's token), writes `server-ready` in its stage
folder once the server answers, and then holds: a test kills it at a
point it controls (the server up), never in a race with the work.

    [stages.extract] entry = "tests.fakes.serve_and_hold"
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pipeline import config as config_mod
from pipeline.vllm.environment import probe
from pipeline.vllm.server import make_server, server_log, serving


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--config", required=True)
    a = ap.parse_args(argv)
    stage = os.environ.get("EAGLE_PANEL_STAGE", "extract")
    cfg = config_mod.load(a.config)
    folder = Path(a.run_dir) / stage
    env = probe(cfg.vllm_python())
    server = make_server(0, env, cfg.target_path(), [], server_log(folder, 0), "float32", 256,
                         False, [], kv_tokens=256, kv_bytes_per_token=1 << 16)
    with serving(server, 600.0, lambda: False):
        (folder / "server-ready").write_text(str(server.proc.pid))
        print("server up; holding", flush=True)
        while True:
            time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
