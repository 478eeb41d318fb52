"""Keeping Inductor's own attention fusion away from the chains it would rewrite wrongly.

Inductor's fuse_attention patterns run after this pass, on the sites it leaves alone, and
- ignore the softmax dim (pytorch issue 196468): ``softmax(q @ kᵀ, dim=-2) @ v`` becomes attention
  over the last dim;
- ignore add's alpha: ``softmax(torch.add(s, mask, alpha=a)) @ v`` becomes ``softmax(s + mask) @ v``.
Such chains are rewritten here into the same values in a form none of its patterns matches.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import op_table as ops
from .fx_utils import insert_call, is_backward_node, tensor_val
from .match_softmax import Softmax, attention_shaped, softmax_at

# How far above a softmax an add with alpha is looked for (the scores' scale, mask and cast steps).
_SCORE_STEPS = 8


def shield_attention_chains(graph: fx.Graph) -> bool:
    """Rewrites the chains Inductor would fuse wrongly; True if the graph changed."""
    changed = False
    for node in list(graph.nodes):
        softmax = softmax_at(node) if node.op == "call_function" and not is_backward_node(node) else None
        if softmax is None or not attention_shaped(softmax):
            continue
        if softmax.dim != tensor_val(softmax.input).dim() - 1:
            _move_softmax_to_last_dim(graph, softmax)
            changed = True
        changed |= _fold_alphas(graph, softmax.input)
    return changed


def _move_softmax_to_last_dim(graph: fx.Graph, softmax: Softmax) -> None:
    """The same softmax over the last dim of a transposed view."""
    rank = tensor_val(softmax.input).dim()
    swap = list(range(rank))
    swap[softmax.dim], swap[-1] = swap[-1], swap[softmax.dim]
    aten = torch.ops.aten
    with graph.inserting_before(softmax.output):
        x = insert_call(graph, aten.permute.default, (softmax.input, swap))
        row_max = insert_call(graph, aten.amax.default, (x, [-1], True))
        exp = insert_call(graph, aten.exp.default, (insert_call(graph, aten.sub.Tensor, (x, row_max)),))
        total = insert_call(graph, aten.sum.dim_IntList, (exp, [-1], True))
        probs = insert_call(graph, aten.div.Tensor, (exp, total))
        result = insert_call(graph, aten.permute.default, (probs, swap))  # a swap is its own inverse
    softmax.output.replace_all_uses_with(result)


def _fold_alphas(graph: fx.Graph, scores: fx.Node) -> bool:
    """``add(x, y, alpha=a)`` above the softmax becomes ``add(x, y * a)``."""
    changed, frontier, seen = False, [scores], set()
    for _ in range(_SCORE_STEPS):
        frontier = [n for n in frontier if isinstance(n, fx.Node) and n not in seen and n.op == "call_function"]
        seen.update(frontier)
        for node in frontier:
            alpha = ops.arg(node, "alpha") if ops.calls(node, *ops.ADD) else 1
            if alpha != 1 and isinstance(alpha, (int, float)) and not isinstance(alpha, bool):
                with graph.inserting_before(node):
                    scaled = insert_call(graph, torch.ops.aten.mul.Tensor, (node.args[1], alpha))
                if "partitioner_tag" in node.meta:
                    scaled.meta["partitioner_tag"] = node.meta["partitioner_tag"]
                node.args, node.kwargs = (node.args[0], scaled), {}
                changed = True
        frontier = [a for n in frontier for a in n.all_input_nodes]
    return changed
