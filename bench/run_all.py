"""Every benchmark at its default size, one after the other, each in its own
process and working folder; one JSON file a script (bench/results.py: the
machine, versions, commit, command, exit code, output and the script's own
`--json` figures). With `--docs`, docs/benchmarks.md's measured sections are
rewritten from the files.

    python bench/run_all.py [--only NAME ...] [--skip NAME ...] [--json DIR]
                            [--docs [PATH]] [--docs-only] [--timeout S]

A script that needs what this machine lacks (its `NEEDS`: "gpu", "vllm") is
not run; its file says why. At the defaults every script takes about 80 minutes
on 2 idle CPU cores (the records of docs/bench-records/: algorithms.py 28 min,
bench_fp8.py 11, vs_speculators.py 10, bench_watch.py 10, chaos.py 5, the rest
under 4 each); `--only` measures some. Each script
runs with the scripts' defaults: the figures in the docs are what a user's
`python bench/NAME.py` gives.

Exit: 0 every script that ran exited 0 (skipped ones included); 1 one did
not, or ran past --timeout (exit 124; its file holds its exit code, output and the end of
its stderr; DIR/NAME.log all of its stderr); 2 bad arguments, or records or docs that
cannot be used as they are (the message says which and what to do)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results

BENCH = Path(__file__).resolve().parent
DOCS = results.ROOT / "docs" / "benchmarks.md"
STOP_GRACE_S = (30, 10)   # after --timeout: SIGTERM, then SIGKILL, each waited on this long


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if results.is_script(p) and p.name != "run_all.py")


def unmet(path: Path, no_vllm: str | None) -> str | None:
    """Why a script cannot run at its defaults here (None: it can);
    no_vllm: why the real vLLM cannot (results.vllm_unusable)."""
    need = results.needs(path)
    if "gpu" in need and not results.gpus():
        return "needs a GPU (its defaults run on CUDA); NVML sees none here"
    if "vllm" in need and no_vllm:
        return f"needs the real vLLM: {no_vllm}"
    return None


def _run(argv: list[str], cwd: Path, out, err, timeout: float) -> int:
    """The script in a session of its own: at its timeout the whole group (its
    stages, its vLLM servers) is stopped, and the exit is 124 as timeout(1) says."""
    p = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        err.write(f"\nrun_all: stopped after --timeout {timeout:.0f} s\n")
        return _stop(p)
    except BaseException:   # ^C: the script goes with run_all
        _stop(p)
        raise


def _stop(p: subprocess.Popen) -> int:
    for sig, grace in zip((signal.SIGTERM, signal.SIGKILL), STOP_GRACE_S, strict=True):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    return 124


def _figures(path: Path):
    """The script's own --json; None without one or with a torn one (a script
    killed while writing it: its output says what happened)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_one(path: Path, out_dir: Path, base: dict, no_vllm: str | None,
            timeout: float) -> dict:
    """One script at its defaults in a working folder of its own (removed
    after: a default-size run leaves gigabytes), its record written."""
    record = {"script": path.name, **base, "started_at": time.time(), "skipped": None}
    why = unmet(path, no_vllm)
    if why:
        record["skipped"] = why
        (out_dir / f"{path.stem}.log").unlink(missing_ok=True)   # an earlier run's
        results.write(out_dir / f"{path.stem}.json", record)
        print(f"{path.name:24} skipped: {why}", flush=True)
        return record
    work = Path(tempfile.mkdtemp(prefix=f"bench-{path.stem}-"))
    figures = work / "figures.json"
    args = ["--json", str(figures)] if results.writes_json(path) else []
    out, log = work / "stdout", out_dir / f"{path.stem}.log"
    t0 = time.monotonic()
    try:
        # its report on stdout; libraries' warnings, progress bars and logging on
        # stderr, kept whole in NAME.log, in the record only where the script failed
        with open(out, "w") as o, open(log, "w") as e:
            rc = _run([sys.executable, str(path), *args], work, o, e, timeout)
        shown = ["python", f"bench/{path.name}", *(["--json", "FILE"] if args else [])]
        errors = log.read_text(errors="replace").splitlines()[-40:] if rc else []
        record.update(command=shown, exit_code=rc, wall_s=round(time.monotonic() - t0, 1),
                      output=out.read_text(errors="replace").splitlines(), stderr_tail=errors,
                      figures=_figures(figures))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results.write(out_dir / f"{path.stem}.json", record)
    print(f"{path.name:24} exit {rc} in {record['wall_s']:.0f} s", flush=True)
    return record


def rewrite_docs(out_dir: Path, doc: Path) -> None:
    if not doc.is_file():
        raise results.RecordError(f"{doc}: no such file to rewrite (--docs PATH)")
    recs = results.read_all(out_dir)
    text = results.rewrite(doc.read_text(), recs)
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)
    print(f"{doc}: {len(recs)} measured sections rewritten from {out_dir}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME",
                    help="these scripts (bench_events or bench_events.py)")
    ap.add_argument("--skip", nargs="+", default=[], metavar="NAME")
    ap.add_argument("--json", type=Path, default=Path("bench-results"), metavar="DIR",
                    help="where the records go (default: bench-results/)")
    ap.add_argument("--docs", nargs="?", const=DOCS, type=Path, metavar="PATH",
                    help=f"rewrite the measured sections of PATH (default {DOCS.name}) "
                         "from every record in DIR")
    ap.add_argument("--docs-only", action="store_true", help="run nothing: only --docs")
    ap.add_argument("--timeout", type=float, default=7200, metavar="S",
                    help="stop a script after S seconds (default 7200; its exit is then 124)")
    a = ap.parse_args()
    known = {p.stem: p for p in scripts()}
    chosen = list(dict.fromkeys(n.removesuffix(".py") for n in a.only)) or list(known)
    bad = [n for n in [*chosen, *(s.removesuffix(".py") for s in a.skip)] if n not in known]
    if bad:
        ap.error(f"no bench/ script {', '.join(bad)}; there are: {', '.join(known)}")
    if a.docs_only and a.docs is None:
        a.docs = DOCS
    if not a.docs_only:
        a.json.mkdir(parents=True, exist_ok=True)
    failed = []
    if not a.docs_only:
        no_vllm = results.vllm_unusable()
        base = {"commit": results.commit(), "machine": results.machine(),
                "versions": results.versions(None if no_vllm else results.vllm_python())}
        for name in chosen:
            if name in {s.removesuffix(".py") for s in a.skip}:
                continue
            rec = run_one(known[name], a.json, base, no_vllm, a.timeout)
            if not rec["skipped"] and rec["exit_code"] != 0:
                failed.append(f"{name}.py (exit {rec['exit_code']}: {a.json / name}.log)")
    if a.docs is not None:
        try:
            rewrite_docs(a.json, a.docs)
        except results.RecordError as e:
            print(f"run_all: {e}", file=sys.stderr)
            return 2
    if failed:
        print(f"failed: {'; '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
