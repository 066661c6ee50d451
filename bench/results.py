"""What a benchmark measured, kept as one JSON file a script (bench/run_all.py
writes them), and docs/benchmarks.md's measured sections made from those files.

A figure is worth what its conditions say: each file holds the machine (CPU
model, cores, memory, GPUs), the versions that change a result, the commit,
the command and its exit code beside the script's own output and, where the
script writes one (`--json`), its figures. The docs' sections between
`<!-- measured: NAME -->` markers are rewritten from the files, never by
hand, so a figure there is one that a file backs."""

from __future__ import annotations

import ast
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHOWN_LINES = 60        # a section shows at most this many of a script's last output lines
MARK = "<!-- measured: {} -->"
END = "<!-- /measured: {} -->"


# -- the scripts -----------------------------------------------------------------------------

def is_script(path: Path) -> bool:
    """A script has a `if __name__ == "__main__":` block; a helper module has none."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def needs(path: Path) -> tuple[str, ...]:
    """What a script needs to run at its defaults, from its module-level
    `NEEDS = ("gpu",)` / `("vllm",)` (read, not imported: importing a script
    imports torch)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["NEEDS"]:
            return tuple(ast.literal_eval(node.value))
    return ()


def writes_json(path: Path) -> bool:
    """Whether the script takes `--json PATH` (its figures as a file)."""
    return '"--json"' in path.read_text()


# -- the conditions --------------------------------------------------------------------------

def machine() -> dict:
    """The machine a figure was measured on; every part read tolerantly."""
    cpu = None
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                    if ln.startswith("model name")), None)
    except OSError:
        pass
    mem_gib = None
    try:
        kib = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
        mem_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu": cpu or platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)), "memory_gib": mem_gib, "gpus": gpus(),
            "hostname": platform.node()}


def gpus() -> list[str]:
    """The GPUs NVML sees (none without a driver)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
        return [n.decode() if isinstance(n, bytes) else n for n in names]
    except Exception:   # noqa: BLE001 (no library, no driver, no device: no GPU to measure on)
        return []


def versions(vllm_python: str | None) -> dict:
    """The packages whose versions change a result (provenance.MATTER), and the
    vLLM the benchmarks serve with (its own virtual environment)."""
    from pipeline.envprobe import probe
    from pipeline.run.provenance import MATTER
    packages = probe(quick=True)["packages"]
    out = {"python": platform.python_version(), **{k: packages.get(k) for k in MATTER}}
    if vllm_python:
        from pipeline.vllm.environment import probe as probe_vllm
        env = probe_vllm(vllm_python)
        out["vllm"] = f"{env.version}{' (CPU build)' if env.cpu_build else ''}"
    return out


def vllm_unusable() -> str | None:
    """Why this machine's real vLLM (.venv-vllm) cannot serve here; None when
    it can. The bench tier skips on it, run_all records it."""
    from pipeline.paths import VLLM_VENV
    py = vllm_python()
    if not Path(py).exists():
        return f"no real vLLM in {VLLM_VENV} (scripts/install.sh makes it)"
    from pipeline.vllm.environment import probe
    why = probe(py).unusable([])
    return f"the vLLM in {VLLM_VENV} is unusable here: {why}" if why else None


def vllm_python() -> str:
    """The interpreter of this machine's real vLLM (.venv-vllm)."""
    from pipeline.paths import VLLM_VENV
    return str(VLLM_VENV / "bin" / "python")


def commit() -> str:
    from pipeline.run.provenance import eagle_panel_commit
    return eagle_panel_commit()


# -- one file a script -----------------------------------------------------------------------

def write(path: Path, record: dict) -> None:
    """Atomically: a reader (the docs' rewrite) never sees half a record."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class RecordError(Exception):
    """A record or the docs cannot be used as they are; the message says what to do."""


def read_all(folder: Path) -> dict[str, dict]:
    """The records in a folder by script name; an unreadable one is named."""
    if not Path(folder).is_dir():
        raise RecordError(f"{folder}: no such folder of records; run bench/run_all.py "
                          f"--json {folder} first")
    out = {}
    for p in sorted(Path(folder).glob("*.json")):
        try:
            rec = json.loads(p.read_text())
            out[rec["script"]] = rec
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RecordError(f"{p}: not a benchmark record ({e}); run bench/run_all.py "
                              f"--only {p.stem}.py again") from None
    return out


# -- docs/benchmarks.md ----------------------------------------------------------------------

def section(rec: dict) -> str:
    """A record as the docs show it: the conditions, then what the script printed
    (its last lines), then its own figures' top-level values."""
    when = time.strftime("%Y-%m-%d", time.gmtime(rec["started_at"]))
    m = rec["machine"]
    hw = f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
    hw += f", {len(m['gpus'])} x {m['gpus'][0]}" if m["gpus"] else ", no GPU"
    v = rec["versions"]
    pkgs = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "speculators", "vllm")
                     if v.get(k))
    c = rec["commit"]
    short = c[:12] + ("+dirty" if c.endswith("+dirty") else "")
    head = (f"Measured by `python bench/run_all.py` on {when}, commit `{short}`; "
            f"{hw}; Python {v['python']}, {pkgs}.")
    if rec.get("skipped"):
        return f"{head}\n\nNot run there: {rec['skipped']}."
    cmd = " ".join(rec["command"][1:])
    lines = [ln for ln in rec["output"] if ln.strip()]
    shown = lines[-SHOWN_LINES:]
    cut = f" (its last {len(shown)} of {len(lines)} lines)" if len(shown) < len(lines) else ""
    out = [head, "", f"`python {cmd}`: exit {rec['exit_code']} in {rec['wall_s']:.0f} s"
           f"{cut}:", "", "```text", *shown, "```"]
    scalars = {k: v for k, v in (rec.get("figures") or {}).items()
               if isinstance(v, (int, float, str, bool)) or v is None} \
        if isinstance(rec.get("figures"), dict) else {}
    if scalars:
        out += ["", "| figure (its `--json`) | value |", "| --- | ---: |",
                *(f"| `{k}` | {_fmt(v)} |" for k, v in scalars.items())]
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v).replace("|", "\\|")


def rewrite(doc: str, records: dict[str, dict]) -> str:
    """docs/benchmarks.md with each recorded script's measured section
    rewritten. A section without markers gets them at the end of the
    script's `### NAME` part; a script with no part there is an error. A
    record of a script not run here, or that failed, never replaces a section
    there is: a CPU machine's run keeps a GPU's figures, and a broken script
    is run_all's exit code, not a lost figure."""
    for name, rec in records.items():
        mark, end = MARK.format(name), END.format(name)
        if doc.count(mark) > 1 or doc.count(mark) != doc.count(end) or \
                (mark in doc and doc.index(end) < doc.index(mark)):
            raise RecordError(f"the docs' markers for {name} are not one '{mark}' followed by "
                              f"one '{end}': mend them by hand, then rewrite")
        block = f"{mark}\n{section(rec)}\n{end}"
        if mark in doc:
            if rec.get("skipped") or rec.get("exit_code") != 0:
                continue
            start, stop = doc.index(mark), doc.index(end) + len(end)
            doc = doc[:start] + block + doc[stop:]
            continue
        head = re.search(rf"^### {re.escape(name)}\n", doc, re.M)
        if head is None:
            raise RecordError(f"the docs have no '### {name}' part for its figures: add one "
                              "(what the script measures, how to run it)")
        nxt = re.compile(r"^#{1,3} ", re.M).search(doc, head.end())
        at = nxt.start() if nxt else len(doc)
        doc = doc[:at].rstrip("\n") + "\n\n" + block + "\n\n" + doc[at:]
    return doc
