"""Counting decisions, and collecting them for ``fa2_inductor.explain`` while it runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

from torch._dynamo.utils import counters

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


_collectors: list[list[SiteRecord]] = []


@contextlib.contextmanager
def collecting() -> Iterator[list[SiteRecord]]:
    records: list[SiteRecord] = []
    _collectors.append(records)
    try:
        yield records
    finally:
        _collectors.remove(records)


def record(site: AttentionSite, graph_kind: str) -> None:
    if site.refusal is None:
        counters[COUNTER_GROUP]["rewrites"] += 1
        # Which kernel the site will run: the masked one costs a pre-pass and reads the mask.
        form = "is_causal" if site.is_causal else ("mask" if site.mask is not None else "no_mask")
        counters[COUNTER_GROUP]["rewrites:" + form] += 1
    else:
        counters[COUNTER_GROUP]["refused:" + site.refusal.value] += 1
    for records in _collectors:
        records.append(SiteRecord(site.describe(), site.refusal is None, site.refusal, site.detail, graph_kind))
