"""What a stage's end says: one frozen dataclass per stage, each result key
spelled once, as a field.

A stage builds its summary (`TrainSummary(checkpoint=..., ...)`), the
stage_finished event carries it as JSON (`to_json`), and every reader — the
read model's `StageView.summary`, fmt, `status --json`, compare, export, the
panel — gets it back typed (`read(stage, json)`) and reads attributes.

Versioned: `to_json` writes `version`; `read` takes a summary an older
release wrote (no `version`) as it was meant: prepare's row count was
`skipped` (now `skipped_rows`; `skipped` is a skipped stage's reason). A
key this release does not know (a newer writer's, or a user's own stage
entry's) is kept in `extra`, and shown as a figure.

Standard library only, like pipeline/run/events.py, which checks each
stage_finished line with `valid` before any reader trusts it.
"""

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

VERSION = 2   # 2: typed summaries (prepare's row count is `skipped_rows`)


@dataclass(frozen=True)
class Summary:
    """What any stage's end may say, whatever it made: the figures the
    subclasses add are None where a stage did not say them."""
    error: str | None = None       # why it failed
    skipped: str | None = None     # why it did not run
    stopped: str | None = None     # why it stopped: on request, or train's budget's reason
    exit_code: int | None = None   # the supervisor's, when the stage wrote nothing
    signal: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)   # keys this release does not know

    def to_json(self) -> dict:
        """The event's `summary`: every figure said (None left out), `extra`
        as it came, and the version."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        out = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
               for k, v in out.items()}
        return {**self.extra, **out, "version": VERSION}

    def figures(self) -> dict[str, float]:
        """The numbers it says (the known and the extra ones), for a stage
        with no words of its own (fmt.summary_text)."""
        said = {**self.extra, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                 if f.name != "extra"}}
        return {k: v for k, v in said.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclass(frozen=True)
class RegenerateSummary(Summary):
    conversations: int | None = None     # read, unparseable rows included
    regenerated: int | None = None
    failed: int | None = None
    rows: int | None = None              # one per assistant answer
    generated_tokens: int | None = None
    rows_file: str | None = None


@dataclass(frozen=True)
class PrepareSummary(Summary):
    rows_in: int | None = None
    samples: int | None = None           # rows kept
    skipped_rows: int | None = None      # (before version 2: `skipped`)
    tokens: int | None = None
    supervised_tokens: int | None = None
    distinct_tokens: int | None = None
    max_seq_len: int | None = None
    data: str | None = None              # the Arrow dataset


@dataclass(frozen=True)
class ExtractSummary(Summary):
    samples: int | None = None           # every row
    computed: int | None = None          # files written by this attempt
    reused: int | None = None            # valid files kept from before
    tokens: int | None = None            # computed by this attempt
    bytes_written: int | None = None
    tokens_per_s: float | None = None
    gb_per_s: float | None = None
    layer_ids: list[int] | None = None
    hidden_states: str | None = None
    backend: str | None = None
    stored: str | None = None            # "fp8" or the dtype
    bytes_per_token: int | None = None
    adaptations: list[str] | None = None


@dataclass(frozen=True)
class VocabSummary(Summary):
    draft_vocab_size: int | None = None
    target_vocab_size: int | None = None
    distinct_supervised_tokens: int | None = None
    coverage: float | None = None        # a share, 0..1
    d2t: str | None = None
    t2d: str | None = None


@dataclass(frozen=True)
class TrainSummary(Summary):
    checkpoint: str | None = None        # the draft train names (its folder)
    acceptance_length: float | None = None   # train's estimate
    val_loss: float | None = None
    train_argv: str | None = None
    draft_layer: str | None = None       # "llama", "mla" or "own"
    draft_layer_reason: str | None = None
    algorithm: str | None = None
    estimate_from: str | None = None
    checkpoint_chosen_by: str | None = None
    epochs_trained: int | None = None
    epochs_planned: int | None = None
    total_seq_len: int | None = None
    steps_planned: int | None = None
    budget: str | None = None            # why that plan
    estimates: list[float] | None = None   # per epoch
    trackers: list[str] | None = None
    vllm_draft: str | None = None        # the MLA draft as vLLM loads it
    draft_config: str | None = None
    first_train_loss: float | None = None
    last_train_loss: float | None = None
    data_wait_share: float | None = None
    mode: str | None = None              # online / hybrid
    buffer_peak_bytes: int | None = None
    server_restarts: int | None = None
    from_disk: int | None = None
    from_servers: int | None = None
    kept_bytes: int | None = None
    resume_checkpoint: str | None = None   # cancelled: where a resume continues
    checkpoint_step: int | None = None
    resume: str | None = None


@dataclass(frozen=True)
class WorstCategory:
    category: str
    acceptance_length: float | None


@dataclass(frozen=True)
class EvaluateSummary(Summary):
    checkpoint: str | None = None        # the measured draft's folder name
    acceptance_length: float | None = None   # vLLM's measurement
    acceptance_estimate: float | None = None  # train's, for that checkpoint
    per_position: list[float] | None = None
    per_category: dict[str, float] | None = None
    worst_category: WorstCategory | None = None
    decode_tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    speedup: float | None = None
    prompts: int | None = None
    target_loads: int | None = None
    measured: int | None = None          # checkpoints measured
    drafts_swapped: int | None = None
    results: str | None = None
    checkpoint_path: str | None = None
    checkpoint_chosen_by: str | None = None
    trackers: list[str] | None = None


BY_STAGE: dict[str, type[Summary]] = {
    "regenerate": RegenerateSummary, "prepare": PrepareSummary, "extract": ExtractSummary,
    "vocab": VocabSummary, "train": TrainSummary, "evaluate": EvaluateSummary}


def read(stage: str, data: Mapping | None) -> Summary:
    """A stage's summary from its event's JSON (any version; {} or None: an
    empty one); a stage with no class of its own gets the common fields. A
    known key of another type than its field's (a user's own stage entry's
    `"stopped": true`) is kept in `extra`, so that an attribute is always
    its type or None."""
    cls = BY_STAGE.get(stage, Summary)
    d = _upgraded(dict(data or {}))
    d.pop("version", None)
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    known = {k: v for k, v in d.items() if k in names and _is(v, KEY_TYPES[k])}
    if known.get("worst_category") is not None:
        w = known["worst_category"]
        known["worst_category"] = WorstCategory(w["category"], w.get("acceptance_length"))
    return cls(**known, extra={k: v for k, v in d.items() if k not in known})


def _upgraded(d: dict) -> dict:
    """A summary written before version 2, in version 2's keys: prepare's
    row count was `skipped`; a cancelled train's resume point was
    `checkpoint` (before `resume_checkpoint`, beside `checkpoint_step`)."""
    if "version" in d:
        return d
    if isinstance(d.get("skipped"), (int, float)) and not isinstance(d["skipped"], bool):
        d["skipped_rows"] = d.pop("skipped")
    if "checkpoint_step" in d and "checkpoint" in d and "resume_checkpoint" not in d:
        d["resume_checkpoint"] = d.pop("checkpoint")
    return d


# -- what a reader may trust -------------------------------------------------------

def _key_types() -> dict[str, Any]:
    """Every key any stage's summary has, and its one type (a key means the
    same in every stage: tests/unit/test_summaries.py holds that)."""
    out: dict[str, Any] = {}
    for cls in (Summary, *BY_STAGE.values()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name != "extra":
                out.setdefault(f.name, hints[f.name])
    return out


KEY_TYPES = _key_types()


# The keys a reader formats as numbers, and the two it formats item by item: a
# value of another type there is damage (the line is skipped, as a half-written
# one); any other key of the wrong type is only set aside (`read`).
NUMBERS = frozenset(k for k, tp in KEY_TYPES.items()
                    if {a for a in typing.get_args(tp) if a is not type(None)} <= {int, float})


def valid(data: Mapping) -> bool:
    """Whether a stage_finished summary read back may be trusted: each number
    a number (`"speedup": "fast"` is damage), `per_position` numbers, and
    `worst_category` nothing or a category's acceptance (a number)."""
    d = _upgraded(dict(data))
    worst = d.get("worst_category")
    return all(_is(d[k], KEY_TYPES[k]) for k in NUMBERS if k in d) and \
        _is(d.get("per_position"), KEY_TYPES["per_position"]) and \
        (not worst or (isinstance(worst, Mapping) and _is(worst.get("acceptance_length"), float)))


def _is(value, tp) -> bool:
    """`value` as JSON holds it against a field's type: an int may stand for
    a float (JSON does not tell 3 from 3.0 across writers), a float may be
    null (NaN and infinities are written as null)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_is(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp in (int, float):
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
    if tp in (str, bool):
        return isinstance(value, tp)
    if origin is list:
        return isinstance(value, list) and all(_is(v, typing.get_args(tp)[0]) for v in value)
    if origin is dict:
        return isinstance(value, Mapping) and all(_is(v, typing.get_args(tp)[1])
                                                  for v in value.values())
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return isinstance(value, Mapping) and all(
            _is(value.get(f.name), hints[f.name]) for f in dataclasses.fields(tp))
    return False
