"""Acceptance per request, per category and per draft position, the way
the field reports it.

vLLM 0.32 returns each request's speculative-decoding statistics in the
response when the server runs with `--per-request-spec-decode-metrics
summary` (`metrics.speculative_decoding`: the histogram of accepted draft
tokens per verify step, the steps, the proposed and accepted tokens). A vLLM
without that flag is measured one request at a time by reading /metrics
before and after it (pipeline.vllm.metrics). Either way each request becomes
one record; this module turns records into the figures: the mean acceptance
length (1 + accepted / verify steps, weighted by steps), the acceptance rate
at each draft position (the share of steps that accepted at least k+1
tokens), per category, and the prompts where the draft does worst.
"""

from __future__ import annotations


def from_response(resp: dict) -> dict | None:
    """A request's figures from vLLM's per-request metrics, or None when the
    response has none (an older vLLM, or the flag off)."""
    spec = ((resp.get("metrics") or {}).get("speculative_decoding")) or None
    if not spec or "acceptance_histogram" not in spec:
        return None
    hist = [int(x) for x in spec["acceptance_histogram"]]
    return {"steps": int(spec.get("num_spec_steps", sum(hist))), "histogram": hist,
            "accepted": int(spec.get("num_accepted_draft_tokens",
                                     sum(j * c for j, c in enumerate(hist)))),
            "draft_tokens": int(spec.get("num_draft_tokens", 0))}


def from_counters(before: dict, after: dict, k: int) -> dict:
    """The same figures from two reads of /metrics around one request (the
    per-position counters give the histogram back: accepted at position p
    counts the steps that accepted more than p tokens)."""
    steps = int(after["drafts"] - before["drafts"])
    at_least = [int(after["per_position"].get(p, 0) - before["per_position"].get(p, 0))
                for p in range(k)] + [0]
    hist = [max(0, (steps if j == 0 else at_least[j - 1]) - at_least[j]) for j in range(k + 1)]
    return {"steps": steps, "histogram": hist,
            "accepted": int(after["accepted"] - before["accepted"]),
            "draft_tokens": int(after["draft_tokens"] - before["draft_tokens"])}


def summarize(records: list[dict], k: int) -> dict:
    """acceptance length, rate, drafts and per-position rates over records."""
    steps = sum(r["steps"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    proposed = sum(r["draft_tokens"] for r in records)
    hist = [sum((r["histogram"] + [0] * (k + 1))[j] for r in records) for j in range(k + 1)]
    per_pos = [sum(hist[j] for j in range(p + 1, k + 1)) / steps if steps else None
               for p in range(k)]
    return {"acceptance_length": 1 + accepted / steps if steps else None,
            "acceptance_rate": accepted / proposed if proposed else None,
            "drafts": steps, "accepted_tokens": accepted, "per_position": per_pos,
            "requests": len(records)}


def by_category(records: list[dict], k: int) -> dict[str, dict]:
    cats: dict[str, list[dict]] = {}
    for r in records:
        cats.setdefault(r.get("category") or "all", []).append(r)
    return {c: summarize(rs, k) for c, rs in sorted(cats.items())}


def worst_prompts(records: list[dict], k: int, n: int = 5) -> list[dict]:
    """The prompts (all their turns together) with the lowest acceptance."""
    prompts: dict[str, list[dict]] = {}
    for r in records:
        prompts.setdefault(str(r.get("prompt_id")), []).append(r)
    rows = []
    for pid, rs in prompts.items():
        s = summarize(rs, k)
        if s["acceptance_length"] is None:
            continue
        rows.append({"prompt_id": pid, "category": rs[0].get("category"),
                     "acceptance_length": round(s["acceptance_length"], 4),
                     "drafts": s["drafts"], "text": (rs[0].get("text") or "")[:200]})
    rows.sort(key=lambda r: (r["acceptance_length"], -r["drafts"]))
    return rows[:n]
