"""Target loads: evaluate's checkpoints on a server each (before) against all
on one server, each next draft loaded into it (after: `one_server = true`,
pipeline/vllm/draft_swap.py), on the same trained run, prompts and settings.

    python bench/target_loads.py [--samples 48] [--epochs 3] [--prompts 12]
    python bench/target_loads.py --run-dir RUN --config CONFIG   # a trained run's checkpoints
    python bench/target_loads.py --regenerate [--samples 48] [--max-tokens 128]

--regenerate: what sharing one server between regenerate and extract costs
(`[stages.regenerate] share_server`, pipeline/extract/shared_server.py): the
same regeneration (the bundled conversations, greedy, regenerate's own client)
on a plain server and on extract's capture server, which generates with every
decode step through the speculative verify path and the aux hidden states
copied aside: generation time and tokens/s each way, the server starts, and
whether the answers are the same token for token. Not run in CI (two server
starts); tests/unit/test_shared_server.py checks the shared path itself.

Without --run-dir it first trains one on the built-in target (prepare,
extract through vLLM, vocab, train: `epochs` checkpoints). Then the
evaluate stage twice, `checkpoints = "all"`, no baseline: reported per way,
the server starts and the seconds spent in them (the stage's own `server`
events), the stage's wall time and the acceptance per checkpoint; and
whether the two agree request by request (greedy: a swapped-in draft must
accept exactly what a fresh server with it accepts). CI runs it on
tests/vllm/test_vllm_pipeline.py's trained run (its smallest size there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("vllm",)   # to run at its defaults (bench/run_all.py): evaluate's servers
sys.path.insert(0, str(ROOT))

import stage_process  # noqa: E402

from tests.configs import merged, render, tiny_pipeline, write  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def server_starts(events: Path, since: float) -> list[float]:
    """Seconds each server took to come up in evaluate's attempt from `since`."""
    out, phase = [], {}
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("t", 0) < since or e.get("type") != "server":
            continue
        key = e.get("server")
        if e.get("phase") == "ready" and phase.get(key) != "ready":   # (said again: one start)
            out.append(float(e.get("elapsed_s") or 0.0))
        phase[key] = e.get("phase")
    return out


def one_way(run: Path, base: dict, one_server: bool, folder: Path) -> dict:
    """evaluate with every checkpoint, on one server or a server each."""
    cfg = merged(base, {"stages": {"evaluate": {"checkpoints": "all", "baseline": False,
                                                "one_server": one_server}}})
    config = folder / ("after.toml" if one_server else "before.toml")
    config.write_text(render(cfg))
    shutil.rmtree(run / "evaluate" / "out", ignore_errors=True)   # measure again, all of it
    t0 = time.time()
    wall = stage_process.run(run, config, "evaluate")
    results = json.loads((run / "evaluate" / "out" / "results.json").read_text())
    starts = server_starts(run / "evaluate" / "events.jsonl", t0)
    return {"wall_s": wall, "starts": len(starts), "start_s": sum(starts),
            "checkpoints": results["checkpoints"], "servers": results.get("servers")}


def per_request(m: dict) -> list[tuple]:
    return [(r["prompt_id"], r["turn"], r["steps"], r["accepted"], r["completion_tokens"])
            for r in m["requests_measured"]]


def train_a_run(folder: Path, samples: int, epochs: int, prompts: int) -> tuple[Path, dict]:
    """The built-in target's pipeline up to train, `epochs` checkpoints."""
    cfg = tiny_pipeline("bench", samples, stages={
        "train": {"epochs": epochs}, "evaluate": {"max_prompts": prompts}})
    cfg = merged(cfg, {"run": {"runs_dir": str(folder / "runs")}})
    config = folder / "config.toml"
    config.write_text(render(cfg))
    run = folder / "runs" / "bench"
    for name in ("prepare", "extract", "vocab", "train"):
        print(f"  {name}: {stage_process.run(run, config, name):.0f} s", flush=True)
    return run, cfg


def regenerate_both_ways(samples: int, max_tokens: int, concurrency: int) -> None:
    """Regenerate's generation on a plain server and on the shared one."""
    from types import SimpleNamespace

    from pipeline.config import load as load_config
    from pipeline.extract.server_flags import extraction_flags
    from pipeline.model.info import kv_bytes_per_token, read_model, validate_layer_ids
    from pipeline.paths import VLLM_VENV
    from pipeline.stages.regenerate import conversations, run_chunk
    from pipeline.vllm.environment import probe
    from pipeline.vllm.server import make_server, serving
    folder = Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    try:
        write(folder / "config.toml", {"data": {"max_samples": samples}})
        cfg = load_config(folder / "config.toml")
        target, m = cfg.target_path(), read_model(cfg.target_path())
        env = probe(str(VLLM_VENV / "bin" / "python"))
        items = list(conversations(SimpleNamespace(cfg=cfg)))
        sec = SimpleNamespace(max_tokens=max_tokens, temperature=0.0, seed=0,
                              request_timeout_s=600, concurrency=concurrency)
        limit, out = cfg.stages.prepare.seq_length, {}
        max_len, layers = limit + max_tokens + 8, validate_layer_ids([1, 2, 3], m.layers)
        for way in ("plain", "shared"):
            storage = folder / way
            flags = extraction_flags(layers, storage, True) if way == "shared" else []
            per_token = kv_bytes_per_token(m, 1, 4) + (len(layers) * m.hidden * 4
                                                       if flags else 0)
            server = make_server(0, env, target, [], folder / f"{way}.log", "float32", max_len,
                                 False, flags, "", concurrency * max_len, per_token)
            server.shared = way == "shared"   # (regenerate's requests then carry the skip key)
            t0 = time.time()
            with serving(server, 900, lambda: False):
                start = time.time() - t0
                t1 = time.time()
                res = run_chunk(server, str(target), items, sec, limit, lambda: False)
                gen = time.time() - t1
            tokens = sum(sum(r["loss_mask"]) for r in res["rows"])
            out[way] = {"start_s": start, "gen_s": gen, "tokens": tokens,
                        "files": len(list(storage.iterdir())) if storage.exists() else 0,
                        "ids": [r["input_ids"] for r in res["rows"]]}
            print(f"{way:7} server start {start:.1f} s; {len(res['rows'])} answers, {tokens} "
                  f"tokens in {gen:.2f} s: {tokens / gen:.0f} tokens/s; files written "
                  f"{out[way]['files']}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    plain, shared = out["plain"], out["shared"]
    slower = shared["gen_s"] / plain["gen_s"]
    print(f"generation on the shared (capture) server: {slower:.2f}x the plain server's time; "
          f"the same answers token for token: {plain['ids'] == shared['ids']}")
    print(f"sharing pays while regenerate's generation takes less than one start "
          f"/ {slower - 1:.2f}: here {plain['start_s'] / max(slower - 1, 1e-9):.0f} s "
          f"of generation (on a target that loads in 15 minutes: "
          f"{900 / max(slower - 1, 1e-9) / 60:.0f} minutes)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, help="a trained run (its train/out/checkpoints)")
    ap.add_argument("--config", type=Path, help="that run's config.toml")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12, help="[stages.evaluate] max_prompts")
    ap.add_argument("--regenerate", action="store_true",
                    help="regenerate's generation on a plain and on the shared server instead")
    ap.add_argument("--max-tokens", type=int, default=128, help="--regenerate: per answer")
    ap.add_argument("--concurrency", type=int, default=8, help="--regenerate: in flight")
    a = ap.parse_args()
    if a.regenerate:
        regenerate_both_ways(a.samples, a.max_tokens, a.concurrency)
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-loads-"))
    try:
        if a.run_dir:
            if not a.config:
                raise SystemExit("--run-dir needs --config (the run's config.toml)")
            run, base = a.run_dir, tomllib.loads(a.config.read_text())
            base = merged(base, {"stages": {"evaluate": {"max_prompts": a.prompts}}})
        else:
            print(f"training the built-in target's draft: {a.samples} samples, "
                  f"{a.epochs} epochs", flush=True)
            run, base = train_a_run(folder, a.samples, a.epochs, a.prompts)
        before = one_way(run, base, False, folder)
        after = one_way(run, base, True, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)   # (a run given: only the two configs)
    names = list(after["checkpoints"])
    print(f"\nevaluate over {len(names)} checkpoints, {a.prompts} prompts at most, no baseline:")
    for way, r in (("before", before), ("after", after)):
        acc = " ".join(f"{r['checkpoints'][n]['acceptance_length']:.4f}" for n in names)
        print(f"{way:7} server starts {r['starts']}, {r['start_s']:.1f} s in starts, "
              f"wall {r['wall_s']:.1f} s; acceptance per checkpoint {acc}")
    same = all(per_request(before["checkpoints"][n]) == per_request(after["checkpoints"][n])
               for n in names)
    swapped = sum(str(m.get("served_by", "")).startswith("swapped")
                  for m in after["checkpoints"].values())
    print(f"after / before: starts {after['starts']} / {before['starts']}, wall "
          f"{after['wall_s'] / before['wall_s']:.2f}x; drafts swapped in: {swapped}")
    print(f"identical per request (greedy): {same}")
    if not same:
        raise SystemExit("a swapped-in draft measured differently from a fresh server")


if __name__ == "__main__":
    main()
