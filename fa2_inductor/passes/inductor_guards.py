"""Keeping Inductor's own attention fusion away from the chains it would rewrite wrongly.

Inductor's fuse_attention patterns run after this pass, on the sites it leaves alone, and
- ignore the softmax dim (pytorch issue 196468): ``softmax(q @ kᵀ, dim=-2) @ v`` becomes attention
  over the last dim;
- ignore add's alpha: ``softmax(torch.add(s, mask, alpha=a)) @ v`` becomes ``softmax(s + mask) @ v``;
- (torch 2.11) take any number divisor of the scores for sqrt(head dim): ``softmax(q @ kᵀ / c + mask) @ v``
  becomes SDPA with its default scale (seen on CPU, the generated code calling SDPA without ``scale``).
Such chains are rewritten here into the same values in a form none of its patterns matches.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

from . import op_table as ops
from .fx_utils import insert_call, is_backward_node, tensor_val
from .match_softmax import Softmax, attention_shaped, softmax_at

# How far above a softmax the chain's steps are looked at (the scores' scale, mask and cast steps).
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
        steps = _score_steps(softmax.input)
        changed |= _fold_alphas(graph, steps)
        changed |= _divisors_as_reciprocals(graph, steps)
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


def _score_steps(scores: fx.Node) -> list[fx.Node]:
    """The calls within _SCORE_STEPS above the softmax's input, nearest first."""
    steps, frontier, seen = [], [scores], set()
    for _ in range(_SCORE_STEPS):
        frontier = [n for n in frontier if isinstance(n, fx.Node) and n not in seen and n.op == "call_function"]
        seen.update(frontier)
        steps += frontier
        frontier = [a for n in frontier for a in n.all_input_nodes]
    return steps


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scaled(graph: fx.Graph, node: fx.Node, x: fx.Node, factor: float) -> fx.Node:
    """``x * factor`` inserted before ``node``, in its partition."""
    with graph.inserting_before(node):
        scaled = insert_call(graph, torch.ops.aten.mul.Tensor, (x, factor))
    if "partitioner_tag" in node.meta:
        scaled.meta["partitioner_tag"] = node.meta["partitioner_tag"]
    return scaled


def _fold_alphas(graph: fx.Graph, steps: list[fx.Node]) -> bool:
    """``add(x, y, alpha=a)`` above the softmax becomes ``add(x, y * a)``."""
    changed = False
    for node in steps:
        alpha = ops.arg(node, "alpha") if ops.calls(node, *ops.ADD) else 1
        if alpha != 1 and _is_number(alpha):
            node.args, node.kwargs = (node.args[0], _scaled(graph, node, node.args[1], alpha)), {}
            changed = True
    return changed


def _head_dim(steps: list[fx.Node]) -> Optional[int]:
    """The inner size of the first q @ kᵀ product among the steps (baddbmm's is its second operand's)."""
    for node in steps:
        if ops.calls(node, *ops.BMM, *ops.BADDBMM):
            return tensor_val(node.args[1 if ops.calls(node, *ops.BADDBMM) else 0]).shape[-1]
    return None


def _divisors_as_reciprocals(graph: fx.Graph, steps: list[fx.Node]) -> bool:
    """``s / c`` above the softmax becomes ``s * (1 / c)`` unless c is sqrt(head dim) (the product's inner size),
    the one divisor Inductor's masked pattern means; equal up to the last bit of rounding."""
    head_dim = _head_dim(steps)
    changed = False
    for node in steps:
        if node.target is not torch.ops.aten.div.Tensor or node.kwargs or len(node.args) != 2:
            continue
        divisor = node.args[1]
        if _is_number(divisor) and divisor != 0 and (head_dim is None or divisor != math.sqrt(head_dim)):
            node.replace_all_uses_with(_scaled(graph, node, node.args[0], 1.0 / divisor))
            changed = True
    return changed
