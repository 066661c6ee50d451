"""Each draft algorithm speculators trains, on the same target, data, hidden
states and seed, measured by the same vLLM: the table a user would make to
choose one (pipeline/train/algorithms.py).

    python bench/algorithms.py [--target builtin:tiny-llama] [--samples 0]
                               [--algorithms eagle3,eagle3.1,peagle,dflash,dspark,dflash2]
                               [--budget-s 240 | --steps N] [--eval-prompts 20]
                               [--skip-checks] [--json PATH] [--keep DIR]
    python bench/algorithms.py --samples 16 --steps 3 --algorithms eagle3,dspark \
                               --eval-prompts 2 --max-tokens 8    # the smallest (CI)

prepare, extract and vocab run once (`eagle-panel run --stage ...`); each
algorithm then gets a copy of that run (the hidden states hard-linked, not
copied) and `eagle-panel run --wait` trains and evaluates it, so only the
algorithm differs. The budget is the same for all:
  --budget-s S (the default): equal wall time in training. The algorithms'
    steps cost very different amounts (DFlash's block of 16 against EAGLE-3's
    3 TTT steps), so an equal step count would compare a converged draft with
    an undertrained one. Each first trains a few steps (`max_steps`, evaluate
    off) to time a step; then max_steps = S / that time, under the budget rule
    (its plateau stop can end one sooner).
  --steps N: the same optimizer steps for all (the smallest size: the path, not
    the figures).
An algorithm the installed vLLM cannot serve (DSpark, DFlash2 on the CPU build) is
trained and reported with evaluate's reason in place of a measurement; one
doctor blocks (an own-layer draft beside an MLA target on the CPU build) is
reported with doctor's reason, or with --skip-checks trained anyway and
evaluate's own failure quoted.
The figures per run come from `eagle-panel compare` (the runs' own records).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("vllm",)   # to run at its defaults (bench/run_all.py): acceptance is vLLM's
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_speculators import run, tail  # noqa: E402

from pipeline.paths import VLLM_VENV  # noqa: E402
from tests.configs import tiny_pipeline, write  # noqa: E402

PROBE_STEPS = 6   # steps timed per algorithm for --budget-s (the first is left out: warm-up)


def config(a, train: dict | None = None, evaluate: bool = True) -> dict:
    """The built-in target's pipeline as the bundled config.toml runs it
    (tests.configs.tiny_pipeline at its seq_length, vocabulary and the
    budget rule), the same for every algorithm but `train`."""
    return tiny_pipeline("bench", a.samples, **{
        "model": {"target": a.target, "trust_remote_code": "kimi" in a.target.lower()},
        "runtime": {"vllm_python": a.vllm_python},
        "stages": {
            "regenerate": {"enabled": False},
            "prepare": {"seq_length": 256},
            "vocab": {"draft_vocab_size": 224},
            # epochs and total_seq_len 0: the budget rule, as by default
            "train": {"epochs": 0, "total_seq_len": 0, "seed": 0, **(train or {})},
            "evaluate": {"enabled": evaluate, "max_prompts": a.eval_prompts,
                         "max_tokens": a.max_tokens, "num_speculative_tokens": a.k,
                         "baseline": a.baseline}}})


class Blocked(Exception):
    """Doctor's launch checks refused the algorithm here (its BLOCK lines)."""


def cli(args: list[str], d: Path, a, what: str) -> float:
    if a.skip_checks and args[0] == "run":
        args = [*args, "--skip-checks"]
    rc, wall = run([sys.executable, "-m", "app.cli", *args], d / "run.log", d, a.timeout)
    log = (d / "run.log").read_text(errors="replace")
    if rc == 2 and "blocking problem(s)" in log:
        raise Blocked(" ".join(ln.split("]", 1)[1].strip() for ln in log.splitlines()
                               if ln.startswith("[ BLOCK ]")))
    if rc != 0:
        raise SystemExit(f"{what}: `eagle-panel {' '.join(args)}` exited {rc}:\n"
                         f"{tail(d / 'run.log')}")
    return wall


def copy_run(base: Path, dest: Path) -> None:
    """The base project (its run with prepare, extract and vocab done) for one
    algorithm: extract's hidden states hard-linked (train only reads them),
    everything else copied: a linked config, log or events file written in
    place would be every algorithm's."""
    def link_or_copy(src, dst):
        if f"{os.sep}extract{os.sep}out{os.sep}" in src:
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)
    shutil.copytree(base, dest, copy_function=link_or_copy, symlinks=True)
    (dest / "run.log").unlink(missing_ok=True)


def train_events(rd: Path) -> list[dict]:
    return [json.loads(x) for x in (rd / "train/events.jsonl").read_text().splitlines() if x]


def seconds_per_step(rd: Path) -> float:
    """From the train metric events of a probe: the mean time between steps
    after the first (which holds the model's and the data's loading)."""
    steps = [(e["step"], e["t"]) for e in train_events(rd)
             if e["type"] == "metric" and e.get("split") == "train" and e.get("step") is not None]
    if len(steps) < 3:
        raise SystemExit(f"{rd}: the probe logged {len(steps)} steps; cannot time a step")
    (s0, t0), (s1, t1) = steps[1], steps[-1]
    return (t1 - t0) / max(s1 - s0, 1)


def train_one(a, base: Path, work: Path, name: str) -> dict:
    """One algorithm from train on: probed and sized (--budget-s) or at --steps."""
    d = work / name
    copy_run(base, d)
    info: dict = {"algorithm": name}
    if a.steps:
        steps = a.steps
    else:
        write(d / "config.toml", config(a, {"algorithm": name, "epochs": 1,
                                            "max_steps": PROBE_STEPS}, evaluate=False))
        cli(["run", "--wait", "--stage", "train"], d, a, f"{name} (timing probe)")
        per = seconds_per_step(d / "runs" / "bench")
        steps = max(PROBE_STEPS, int(a.budget_s / per))
        info.update(probe_s_per_step=round(per, 4))
    info["max_steps"] = steps
    write(d / "config.toml", config(a, {"algorithm": name, "max_steps": steps}))
    t0 = time.time()
    cli(["run", "--wait", "--stage", "train"], d, a, name)
    info["train_s"] = round(time.time() - t0, 1)
    try:   # a draft vLLM fails to serve is a row that says why, not the end of the bench
        cli(["run", "--wait", "--stage", "evaluate"], d, a, name)
    except (SystemExit, Blocked) as e:   # (doctor blocking evaluate only: the row stays)
        info["evaluate_failed"] = str(e).splitlines()[0]
    info["train_and_evaluate_s"] = round(time.time() - t0, 1)
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="builtin:tiny-llama")
    p.add_argument("--samples", type=int, default=0, help="conversations (0: all bundled)")
    p.add_argument("--algorithms", default="eagle3,eagle3.1,peagle,dflash,dspark,dflash2")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="training wall time per algorithm (default 240)")
    p.add_argument("--steps", type=int, default=0, help="the same optimizer steps for all "
                                                        "instead of a wall-time budget")
    p.add_argument("--eval-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--baseline", action="store_true", help="measure decode without a draft too")
    p.add_argument("--vllm-python", default=str(VLLM_VENV / "bin" / "python"))
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--skip-checks", action="store_true",
                   help="launch what doctor blocks, to see what vLLM itself says of it")
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", type=Path, help="keep the runs here (default: a temp folder)")
    a = p.parse_args()
    names = [n.strip() for n in a.algorithms.split(",") if n.strip()]
    from pipeline.train.algorithms import ALGORITHMS
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        p.error(f"--algorithms: {unknown} not among {list(ALGORITHMS)}")

    if a.keep and a.keep.exists() and any(a.keep.iterdir()):
        p.error(f"--keep {a.keep}: not empty (the runs go there: name a new folder)")
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-algorithms-"))
    try:
        measure(a, names, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def measure(a, names: list[str], work: Path) -> None:
    """The shared stages once, each algorithm on a copy, the table."""
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    base.mkdir()
    write(base / "config.toml", config(a, evaluate=False))
    t0 = time.time()
    for stage in ("prepare", "extract", "vocab"):
        cli(["run", "--wait", "--stage", stage], base, a, stage)
    shared_s = time.time() - t0
    print(f"shared   prepare + extract + vocab {shared_s:.1f} s, once for "
          f"{len(names)} algorithms", flush=True)

    runs = {}
    for name in names:
        try:
            runs[name] = train_one(a, base, work, name)
        except Blocked as e:   # e.g. an own-layer draft beside an MLA target on the CPU build
            runs[name] = {"algorithm": name, "blocked": str(e)}
            print(f"blocked  {name:<9} doctor: {e}", flush=True)
            continue
        print(f"trained  {name:<9} max_steps {runs[name]['max_steps']}"
              + (f" ({runs[name]['probe_s_per_step'] * 1000:.0f} ms a step)"
                 if "probe_s_per_step" in runs[name] else "")
              + f", train + evaluate {runs[name]['train_and_evaluate_s']:.1f} s", flush=True)

    from pipeline import compare
    from pipeline.run.rundir import RunDir
    # (each run is named "bench" in its own project folder: the rows by algorithm)
    rows = [dataclasses.replace(compare.row(RunDir(work / n / "runs" / "bench")), run=n)
            for n in names if "blocked" not in runs[n]]
    print(compare.table(rows))
    budget = f"{a.steps} steps each" if a.steps else f"{a.budget_s:.0f} s of training each"
    for r in rows:
        measured = (f"vLLM acceptance {r.acceptance:.3f}" if r.acceptance is not None
                    else "not measured: " + (r.not_measured or runs[r.run].get("evaluate_failed")
                                             or "see its evaluate log"))
        est = "-" if r.estimate is None else f"{r.estimate:.3f}"
        print(f"{r.algorithm:<9} {budget}: train {r.train_s or 0:.1f} s, "
              f"{(r.parameters or 0) / 1e6:.2f}M parameters, val loss "
              f"{r.val_loss if r.val_loss is not None else float('nan'):.3f}, "
              f"estimate {est}, {measured}")
    for n in names:
        if "blocked" in runs[n]:
            print(f"{n:<9} {budget}: not trained: doctor blocks it here: {runs[n]['blocked']}")
    if a.json:
        a.json.write_text(json.dumps({
            "target": a.target, "samples": a.samples, "budget": budget, "shared_s": shared_s,
            "runs": runs, "rows": json.loads(compare.as_json(rows))}, indent=1))


if __name__ == "__main__":
    main()
