"""One row per family × attention implementation, its status, and a family's verdict over its rows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Optional


class Status(str, Enum):
    def __new__(cls, value: str, meaning: str, defect: bool):
        member = str.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        member.defect = defect
        return member

    def __str__(self) -> str:
        return self.value

    # Worst first: a family's verdict is its worst row (build failures only where nothing built).
    LOGITS_DIFFER = "logits_differ", "the compiled model's output differs from the uncompiled model's", True
    CRASHED = "crashed", "compiling or running the compiled model raised", True
    NO_ATTENTION = "no_attention", "the model computes softmax or SDPA, but the pass recognised no site", True
    TIMED_OUT = "timed_out", "built, but compiling and running it took longer than the time limit", False
    PARTIAL = "partial", "some recognised sites were refused", False
    BEYOND_OP = ("beyond_op", "every refused site is a call the op's own input checks reject (e.g. a head dim above "
                 "256): attention the op cannot compute (not counted)", False)
    FULL = "full", "every recognised site rewritten, output equal to the uncompiled model's", False
    SOFTMAX_ONLY = ("softmax_only", "the model's softmax calls are over no q·kᵀ scores: the pass saw each and "
                    "found no product of two tensors computing its input (not counted)", False)
    ATTENTION_FREE = "attention_free", "the model calls no softmax and no SDPA: nothing to rewrite (not counted)", False
    BUILD_FAILED = "build_failed", "the sweep could not make the model or its inputs (not counted)", False
    NOT_SUPPORTED = "not_supported", "the model class does not offer this attention implementation", False


NOT_COUNTED = (Status.BEYOND_OP, Status.SOFTMAX_ONLY, Status.ATTENTION_FREE, Status.BUILD_FAILED, Status.NOT_SUPPORTED)
COUNTED = [status for status in Status if status not in NOT_COUNTED]


# The compiled output counts as equal to the uncompiled model's within these (float32 throughout; a NaN
# where the uncompiled model has one too is equal: random weights can overflow).
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4, "equal_nan": True}


@dataclass
class Row:
    family: str
    implementation: str
    status: Status
    model_class: str = ""
    sites_rewritten: int = 0
    sites_total: int = 0  # sites the pass recognised: rewritten + refused
    refusals: dict = field(default_factory=dict)  # reason -> count
    refusal_details: list = field(default_factory=list)  # "reason: detail", each once
    other_softmaxes: list = field(default_factory=list)  # why each softmax seen is over no q·kᵀ scores, once each
    max_abs_diff: Optional[float] = None
    error: str = ""  # build or run failure, one line
    note: str = ""  # what else was seen (e.g. SDPA calls the pass did not recognise)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "status": self.status.value}

    @classmethod
    def from_json(cls, data: dict) -> "Row":
        return cls(**{**data, "status": Status(data["status"])})

    def why(self) -> str:
        """Why the row is not FULL, in a few words ("" when it is)."""
        if self.status in (Status.FULL, Status.NOT_SUPPORTED):
            return ""
        if self.status in (Status.PARTIAL, Status.BEYOND_OP):
            return ", ".join(f"{reason} ×{count}" for reason, count in sorted(self.refusals.items()))
        if self.status is Status.LOGITS_DIFFER:
            return f"max |diff| {self.max_abs_diff:.3g}" + (f"; {self.note}" if self.note else "")
        if self.status is Status.SOFTMAX_ONLY:
            return "softmax over no q·kᵀ scores: " + "; ".join(self.other_softmaxes)
        if self.status is Status.NO_ATTENTION:
            return "no attention found" + (f" ({self.note})" if self.note else "")
        if self.status is Status.TIMED_OUT:
            return "timed out"
        if self.status is Status.CRASHED:
            return f"crashed: {self.error}" + (f"; {self.note}" if self.note else "")
        if self.status is Status.ATTENTION_FREE:
            return "no softmax or SDPA in the model"
        return f"{self.status.value.replace('_', ' ')}: {self.error}"


def family_status(rows: list[Row]) -> Status:
    """The family's verdict: the worst status of its implementations (so a family is FULL only where every
    implementation that built is); not_supported only where no implementation is supported."""
    order = list(Status)
    return min((row.status for row in rows), key=order.index)


def by_family(rows: list[Row]) -> dict[str, list[Row]]:
    grouped: dict[str, list[Row]] = {}
    for row in rows:
        grouped.setdefault(row.family, []).append(row)
    return grouped
