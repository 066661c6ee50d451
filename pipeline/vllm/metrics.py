"""A vLLM server's Prometheus /metrics, read: every sample as (name, labels,
value), and the speculative-decoding counters turned into the numbers users
judge a draft by.

    vllm:spec_decode_num_drafts_total                       drafts proposed
    vllm:spec_decode_num_draft_tokens_total                 tokens proposed
    vllm:spec_decode_num_accepted_tokens_total              tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}
    vllm:generation_tokens_total                            tokens generated
Counters are summed over engines (data-parallel ranks); a measurement is the
difference of two reads, so a server that served other requests before is
measured right. Acceptance length = 1 + accepted / drafts (each verify step
yields the accepted tokens plus one from the target).
"""

from __future__ import annotations

import re

from pipeline.vllm import contract_strings as vs

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+([-+\d.eE]+|NaN|[+-]Inf)\s*$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

DRAFTS, DRAFT_TOKENS, ACCEPTED = (vs.METRIC_SPEC_DRAFTS, vs.METRIC_SPEC_DRAFT_TOKENS,
                                  vs.METRIC_SPEC_ACCEPTED)
PER_POSITION, GENERATED = vs.METRIC_SPEC_PER_POSITION, vs.METRIC_GENERATION_TOKENS


def samples(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and m.group(4) not in ("NaN", "+Inf", "-Inf"):
            try:
                value = float(m.group(4))
            except ValueError:   # "1.2.3": not a sample (a line the pattern half-matches)
                continue
            out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), value))
    return out


def spec_counters(text: str) -> dict:
    """The counters above, summed over engines; per position as {k: n}."""
    c = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "generated": 0.0,
         "per_position": {}}
    key = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted",
           GENERATED: "generated"}
    for name, labels, value in samples(text):
        if name in key:
            c[key[name]] += value
        elif name == PER_POSITION and labels.get("position", "").isdigit():
            k = int(labels["position"])
            c["per_position"][k] = c["per_position"].get(k, 0.0) + value
    return c


def acceptance(before: dict, after: dict) -> dict:
    """What happened between two reads of spec_counters."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    proposed = after["draft_tokens"] - before["draft_tokens"]
    positions = sorted(after["per_position"])
    per_pos = [(after["per_position"][k] - before["per_position"].get(k, 0.0)) / drafts
               if drafts else None for k in positions]
    return {"drafts": int(drafts), "draft_tokens": int(proposed), "accepted_tokens": int(accepted),
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / proposed if proposed else None,
            "per_position": per_pos,
            "generated_tokens": int(after["generated"] - before["generated"])}
