"""What one pass of the prompts through a server measured, typed: a
checkpoint's draft (acceptance from vLLM's /metrics, per position and
category, with the checkpoint's identity and train's estimate) or none (the
baseline: decode speed alone). Written as evaluate/out/checkpoints/<name>.json
and baseline.json, and inside results.json; `from_json` reads what any
release of this project wrote (a key it lacks is None)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DRAFT = ("drafts", "draft_tokens", "accepted_tokens", "acceptance_length", "acceptance_rate",
         "per_position", "generated_tokens", "per_request", "requests_measured",
         "per_category", "worst_prompts")
CHECKPOINT = ("served", "checkpoint", "estimate")


@dataclass(frozen=True)
class Measurement:
    # the load (pipeline.evaluate.load.Generation)
    completion_tokens: int
    requests: int
    seconds: float
    decode_tokens_per_s: float
    # how it was served: the command that serves it from the start, and how it got the draft
    vllm_command: str
    prompts: int
    served_by: str
    # with a draft (DRAFT): what /metrics counted between the reads before and after
    # (pipeline.vllm.metrics.acceptance), and per request, category and worst prompt
    drafts: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_length: float | None = None   # None: nothing was drafted
    acceptance_rate: float | None = None
    per_position: list | None = None
    generated_tokens: int | None = None
    per_request: str | None = None           # where each request's figures came from
    requests_measured: list | None = None
    per_category: dict | None = None
    worst_prompts: list | None = None
    # a checkpoint's (CHECKPOINT): the folder vLLM loaded, what identifies the
    # checkpoint's contents (choice.checkpoint_id), train's estimate for it
    served: str | None = None
    checkpoint: dict | None = None
    estimate: float | None = None

    @property
    def with_draft(self) -> bool:
        return self.drafts is not None

    def to_json(self) -> dict:
        """The file's form: the baseline without the draft's keys, a pass not
        yet tied to a checkpoint without the checkpoint's."""
        out = dataclasses.asdict(self)
        drop = (() if self.with_draft else DRAFT) + (() if self.checkpoint else CHECKPOINT)
        return {k: v for k, v in out.items() if k not in drop}

    @classmethod
    def from_json(cls, d: dict) -> Measurement:
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})

    def tracker_values(self) -> dict:
        """Its figures as tracker scalars."""
        values = {"acceptance_length": self.acceptance_length,
                  "decode_tokens_per_s": self.decode_tokens_per_s,
                  **{f"accept_rate_{k}": r for k, r in enumerate(self.per_position or [])
                     if r is not None}}
        if self.estimate is not None:
            values["acceptance_estimate"] = self.estimate
        return values
