"""A server's command line rewritten for another start of the same server:
some flags dropped with their values, the speculative config's draft named
anew. evaluate records each measured command as a fresh server with that
draft would start (the draft swap's flags dropped, a swapped-in draft
named); export writes the one a user runs (the panel's address dropped, the
exported folder named). Standard library only: the CLI imports it.
"""

from __future__ import annotations

import json

from pipeline.vllm import contract_strings as vs


def rewritten(argv: list[str], drop: dict[str, tuple | None],
              model: str | None = None) -> list[str]:
    """`argv` without each flag of `drop` and its value (only those values,
    where a tuple is given), its `--speculative-config` "model" set to
    `model` when given."""
    out, i = [], 0
    while i < len(argv):
        a, value = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        if value is not None and a in drop and (drop[a] is None or value in drop[a]):
            i += 2
            continue
        if value is not None and a == vs.FLAG_SPECULATIVE_CONFIG and model is not None:
            out += [a, json.dumps({**json.loads(value), "model": model})]
            i += 2
            continue
        out.append(a)
        i += 1
    return out
