"""Judge a vLLM release the day it lands: fetch its source from the package
index pip uses (the newest by default), read it as doctor reads an installed
vLLM, and print what eagle-panel would do with it.

    python scripts/check_vllm_release.py            # the newest release on the index
    python scripts/check_vllm_release.py 0.34.0     # one release
    python scripts/check_vllm_release.py --json out.json 0.34.0

Printed, each read from the release's source (never a version table):
- the contract (pipeline/vllm/contract.py): each declared use it breaks,
  by route, and the adaptations that fire;
- each algorithm of pipeline/train/algorithms.py: served by its speculative
  config, or refused in vLLM's words (on a CUDA build with Triton, no
  VLLM_USE_V2_MODEL_RUNNER set);
- EAGLE-3 on the families users train for (Llama, Qwen3-MoE, DeepSeek-V3,
  Kimi-K2.5, Kimi-K3);
- evaluate's draft swap, the share of each GPU a server takes by default,
  and whether the release is one the tests read (compat.READ_RELEASES).

Exit codes: 0 nothing blocks the server route; 1 the server route's contract
breaks (doctor would block every vLLM launch); 2 bad usage or a --json file
that cannot be written; 3 the index
cannot be reached or has no such release.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The architectures users train drafts for (docs/vllm.md's families).
FAMILIES = ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
            "KimiK25ForConditionalGeneration", "KimiK3ForConditionalGeneration")


def algorithms_served(src) -> dict[str, str | None]:
    """{algorithm: None where vLLM serves its drafts, else why not}."""
    from pipeline.train.algorithms import ALGORITHMS
    from pipeline.vllm import compat
    return {a.name: compat.draft_method_unservable(src, a.vllm_method, True, {},
                                                    a.architectures, tuple(a.vllm_extra),
                                                    a.speculator_type)
            for a in ALGORITHMS.values()}


def report(src) -> dict:
    """Everything the script prints, as data."""
    from pipeline.vllm import compat, draft_swap
    from pipeline.vllm.memory_fraction import default_fraction
    adaptations = compat.plan(src)
    cuda, other = default_fraction(src, cuda=True), default_fraction(src, cuda=False)
    newest_read = compat.READ_RELEASES[-1]
    return {
        "version": src.version,
        "read_by_the_tests": src.version in compat.READ_RELEASES,
        "newest_read": newest_read,
        "contract_breaks": [{"route": a.route, "line": a.detail}
                            for a in adaptations if a.blocking],
        "adaptations": [{"key": a.key, "route": a.route, "detail": a.detail}
                        for a in adaptations if a.fires and not a.blocking],
        "algorithms": algorithms_served(src),
        "eagle3": {arch: {"supported": not (e := compat.eagle3_support(src, arch)).fires,
                          "detail": e.detail} for arch in FAMILIES},
        "draft_swap": draft_swap.unavailable(src, []),
        "memory_fraction": {"cuda": [cuda.fraction, cuda.why], "other": [other.fraction, other.why]},
    }


def as_text(r: dict) -> str:
    v = r["version"]
    out = [f"vLLM {v}: " + ("read by the tests (compat.READ_RELEASES)" if r["read_by_the_tests"]
                            else f"NOT read by the tests yet (newest read: {r['newest_read']}): "
                                 "add it to compat.READ_RELEASES and run "
                                 "tests/unit/test_vllm_sources.py")]
    out.append("contract:")
    out += [f"  [ BLOCK ] {b['route']}: {b['line']}" for b in r["contract_breaks"]] or \
        ["  [  ok   ] every declared use holds"]
    out += [f"  [ adapt ] {a['route']}: {a['detail']}" for a in r["adaptations"]]
    out.append("algorithms (evaluate serves the trained draft):")
    for name, why in r["algorithms"].items():
        out.append(f"  [  ok   ] {name}" if why is None else f"  [ no    ] {name}: {why}")
    out.append("EAGLE-3 targets:")
    out += [f"  [{'  ok   ' if e['supported'] else ' no    '}] {e['detail']}"
            for e in r["eagle3"].values()]
    out.append("evaluate's draft swap: " + ("available" if r["draft_swap"] is None
                                           else f"off: {r['draft_swap']}"))
    (fc, wc), (fo, wo) = r["memory_fraction"]["cuda"], r["memory_fraction"]["other"]
    out.append(f"default share of each GPU a server takes: {fc:.0%} on CUDA ({wc}); "
               f"{fo:.0%} elsewhere ({wo})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="exit codes: 0 ok, 1 the server route's contract breaks, "
                                       "2 usage, 3 index unreachable or no such release")
    p.add_argument("version", nargs="?", help="a vLLM release (default: the newest on the index)")
    p.add_argument("--json", type=Path, help="also write the report here")
    a = p.parse_args(argv)
    from pipeline.vllm import releases
    try:
        version = a.version or releases.newest()
        src = releases.release_source(version)
    except releases.Unreachable as e:
        what = "" if a.version and a.version in str(e) else f"vllm {a.version or '(newest)'}: "
        print(f"check_vllm_release: {what}{e}", file=sys.stderr)
        return 3
    r = report(src)
    print(as_text(r))
    if a.json:
        try:
            a.json.write_text(json.dumps(r, indent=1))
        except OSError as e:
            print(f"check_vllm_release: --json {a.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 1 if any(b["route"] == "server" for b in r["contract_breaks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
