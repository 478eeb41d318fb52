"""Keeping Inductor's own attention fusion away from softmaxes over a non-last dim.

Inductor's attention patterns ignore the softmax dim (pytorch issue 196468), so
``softmax(q @ kᵀ, dim=-2) @ v`` is silently rewritten as attention over the last dim. Computing such
a softmax over the last dim of a transposed view gives the same values and no longer looks like
any of Inductor's patterns.
"""

from __future__ import annotations

import torch.fx as fx

from .fx_utils import aten, insert_call, tensor_val
from .match_softmax import Softmax


def move_softmax_to_last_dim(graph: fx.Graph, softmax: Softmax) -> None:
    rank = tensor_val(softmax.input).dim()
    swap = list(range(rank))
    swap[softmax.dim], swap[-1] = swap[-1], swap[softmax.dim]
    with graph.inserting_before(softmax.output):
        x = insert_call(graph, aten.permute.default, (softmax.input, swap))
        row_max = insert_call(graph, aten.amax.default, (x, [-1], True))
        exp = insert_call(graph, aten.exp.default, (insert_call(graph, aten.sub.Tensor, (x, row_max)),))
        total = insert_call(graph, aten.sum.dim_IntList, (exp, [-1], True))
        probs = insert_call(graph, aten.div.Tensor, (exp, total))
        result = insert_call(graph, aten.permute.default, (probs, swap))  # a swap is its own inverse
    softmax.output.replace_all_uses_with(result)
