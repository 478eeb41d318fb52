"""Counting decisions, and collecting them for ``fa2_inductor.explain`` while it runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

from torch._dynamo.utils import counters

from .rewrite import mask_value_in_op_layout
from .refusals import Refusal
from .site import AttentionSite

COUNTER_GROUP = "fa2_inductor"


@dataclass
class SiteRecord:
    description: str
    rewritten: bool
    reason: Optional[Refusal]
    detail: str
    graph_kind: str  # "inference" or "training"

    def __str__(self) -> str:
        verdict = "rewritten" if self.rewritten else f"refused: {self.reason}"
        detail = f" ({self.detail})" if self.detail else ""
        return f"[{self.graph_kind}] {self.description}: {verdict}{detail}"


@dataclass
class OtherSoftmax:
    """A softmax the pass saw over no q·kᵀ scores (so no site), and why."""

    description: str
    why: str
    graph_kind: str

    def __str__(self) -> str:
        return f"[{self.graph_kind}] {self.description}: {self.why}"


class Records(list):
    """The sites decided while collecting (the list), and the softmaxes over no q·kᵀ scores."""

    def __init__(self):
        super().__init__()
        self.other_softmaxes: list[OtherSoftmax] = []


_collectors: list[Records] = []


@contextlib.contextmanager
def collecting() -> Iterator[Records]:
    records = Records()
    _collectors.append(records)
    try:
        yield records
    finally:
        _collectors.remove(records)


def rewrite_form(site: AttentionSite) -> str:
    """Which kernel form the site runs, e.g. "is_causal", "is_causal+window+key_mask", "mask", "no_mask".

    A mask costs a pre-pass and a read of its partial blocks: "key_mask" is one row per batch (or head),
    shared by every query (key padding: cheap), "mask" one with rows of its own."""
    parts = []
    if site.is_causal:
        parts.append("is_causal")
    if site.window_left >= 0:
        parts.append("window")
    if site.has_mask():
        mask = mask_value_in_op_layout(site)
        parts.append("key_mask" if mask.dim() >= 2 and mask.shape[-2] == 1 else "mask")
    return "+".join(parts) or "no_mask"


def record(site: AttentionSite, graph_kind: str) -> None:
    if site.refusal is None:
        counters[COUNTER_GROUP]["rewrites"] += 1
        counters[COUNTER_GROUP]["rewrites:" + rewrite_form(site)] += 1
    else:
        counters[COUNTER_GROUP]["refused:" + site.refusal.value] += 1
    for records in _collectors:
        records.append(SiteRecord(site.describe(), site.refusal is None, site.refusal, site.detail, graph_kind))


def record_other_softmax(description: str, why: str, graph_kind: str) -> None:
    """Only for explain's report: such softmaxes are not counted (a model may have many, routers say)."""
    for records in _collectors:
        records.other_softmaxes.append(OtherSoftmax(description, why, graph_kind))
