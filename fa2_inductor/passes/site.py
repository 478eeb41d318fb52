"""What the matchers found: one attention site, its inputs in their own layouts, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch.fx as fx

from ..reference import EmptyRows
from .refusals import Refusal, Refused

# The layout of q/k/v/out is the permutation that turns the tensor into the op's [B, H, S, D]:
# ``tensor.permute(layout)``; a 3-D one gives [B*H, S, D], which the op sees as [B*H, 1, S, D].
# BHSD is the op's own, FLAT bmm's; e.g. (0, 2, 1, 3) is HF's [B, S, H, D] before its transpose.
BHSD, FLAT = (0, 1, 2, 3), (0, 1, 2)


def is_flat(layout: tuple) -> bool:
    return len(layout) == 3


def inverse(layout: tuple) -> tuple:
    return tuple(sorted(range(len(layout)), key=layout.__getitem__))

ScaleFactor = Union[float, fx.Node]


@dataclass
class AttentionSite:
    kind: str  # "sdpa" or "matmul_softmax"
    anchor: fx.Node  # the attention output, in ``out_layout``
    q: Optional[fx.Node] = None
    k: Optional[fx.Node] = None
    v: Optional[fx.Node] = None
    layouts: dict = field(default_factory=dict)  # "q", "k", "v", "out" -> layout
    scale: float = 1.0
    symbolic_scale: list = field(default_factory=list)  # (node, divide) factors folded into q
    mask: Optional[fx.Node] = None
    mask_negated: bool = False  # the graph's mask marks the blocked positions
    extra_masks: list = field(default_factory=list)  # more additive masks, summed into ``mask``
    mask_terms: list = field(default_factory=list)  # (bool node, negated): the op's mask is their AND (``mask`` None)
    is_causal: bool = False
    window_left: int = -1  # with is_causal: keys before i - window_left hidden
    empty_rows: int = 0  # what rows with no visible key compute (reference.EmptyRows), from the mask's fill
    softcap: float = 0.0  # scores capped as softcap * tanh(scores / softcap) before the masks; 0: none
    sinks: Optional[fx.Node] = None  # [Hq] logits that join every row's softmax denominator
    n_rep: int = 1  # K/V heads repeated in the graph and mapped back to native GQA
    forward_nodes: set = field(default_factory=set)  # the nodes the rewrite makes dead
    replaces: Optional[fx.Node] = None  # a site rebuilt beside the graph's own nodes: the node its output replaces
    notes: list = field(default_factory=list)  # what the matcher recognised, for the report
    refusal: Optional[Refusal] = None
    detail: str = ""

    def refuse(self, reason: Refusal, detail: str = "") -> "AttentionSite":
        if not isinstance(reason, Refusal):
            raise TypeError(f"a refusal reason must be a Refusal, got {reason!r}")
        self.refusal = reason
        self.detail = detail
        return self

    def refuse_as(self, refused: Refused) -> "AttentionSite":
        return self.refuse(refused.reason, refused.detail)

    def describe(self) -> str:
        parts = [self.kind] + self.notes
        if self.n_rep > 1:
            parts.append(f"GQA x{self.n_rep} -> native")
        if self.is_causal:
            parts.append("is_causal" + (f" window {self.window_left + 1}" if self.window_left >= 0 else ""))
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.mask is not None or self.mask_terms:
            parts.append("mask")
        if self.empty_rows:
            parts.append(f"empty rows: {EmptyRows(self.empty_rows).name.lower()}")
        return ", ".join(parts)

    def has_mask(self) -> bool:
        return self.mask is not None or bool(self.mask_terms)
