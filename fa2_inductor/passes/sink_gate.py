"""Attention sinks applied after P @ V: ``(P @ V) * sigmoid(logsumexp(scores) - sinks)`` (Granite SWA).

With ``Σ`` a row's ``Σ exp(scores)``, ``sigmoid(log Σ - s) = Σ / (Σ + exp(s))``: the scaled output is the
softmax over the keys and one more logit ``s`` per query head that carries no value, i.e. the op's ``sinks``.
A row whose scores all hold an absorbing fill gets ``sigmoid(fill - s) = 0``, the op's zero for such a row
with sinks.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from . import op_table as ops
from .fx_utils import forward_users, same_shape, same_size, tensor_val
from .views import strip_views


def sink_gate(scores: fx.Node, dim: int, attention: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(the gated output, the [H] sinks) when the one user of the [B, H, M, D] ``attention`` multiplies it by
    ``sigmoid(logsumexp(scores, dim) - sinks)`` broadcast over D, with ``scores`` the softmax's [B, H, M, K]
    input (read before a widening cast, maybe); None otherwise."""
    users = forward_users(attention)
    scores_shape, out_shape = tensor_val(scores).shape, tensor_val(attention).shape
    if len(users) != 1 or len(scores_shape) != 4 or dim != 3 or len(out_shape) != 4:
        return None
    gated = users[0]
    if not ops.calls(gated, *ops.MUL) or not same_shape(tensor_val(gated).shape, out_shape):
        return None
    factor = ops.arg(gated, "other") if ops.arg(gated, "self") is attention else ops.arg(gated, "self")
    if factor is attention or not isinstance(factor, fx.Node):
        return None
    difference = _sigmoid_argument(factor, out_shape)
    if difference is None:
        return None
    lse = _strip_float_casts(ops.arg(difference, "self"))
    sinks = _per_head(ops.arg(difference, "other"), scores_shape[1])
    if sinks is None or not _is_logsumexp(lse, scores, dim):
        return None
    return gated, sinks


def _dtype(node: fx.Node):
    return tensor_val(node).dtype


def _strip_float_casts(node):
    while ops.calls(node, *ops.CAST) and _dtype(node.args[0]).is_floating_point and _dtype(node).is_floating_point:
        node = node.args[0]  # a rounding of the gate: eager's imprecision, which the op does not copy
    return node


def _sigmoid_argument(factor: fx.Node, out_shape) -> Optional[fx.Node]:
    """``a - b`` of a factor ``sigmoid(a - b)`` of shape [B, H, M] unsqueezed to [B, H, M, 1] (casts anywhere)."""
    node = _strip_float_casts(factor)
    if not (ops.calls(node, *ops.UNSQUEEZE) and ops.arg(node, "dim") % 4 == 3):
        return None
    if not same_shape(tensor_val(node).shape, [*out_shape[:3], 1]):
        return None
    node = _strip_float_casts(node.args[0])
    if not ops.calls(node, *ops.SIGMOID):
        return None
    node = _strip_float_casts(node.args[0])
    return node if ops.calls(node, *ops.SUB) and isinstance(ops.arg(node, "other"), fx.Node) else None


def _per_head(node: fx.Node, heads) -> Optional[fx.Node]:
    """The floating [H] tensor that ``node`` views as [1, H, 1]."""
    value = tensor_val(node)
    if value is None or not same_shape(value.shape, [1, heads, 1]):
        return None
    source, _ = strip_views(node)  # [1, H, 1] of an [H] tensor: only size-1 dims added, the order kept
    value = tensor_val(source)
    if value is None or value.dim() != 1 or not same_size(value.shape[0], heads) or not value.dtype.is_floating_point:
        return None
    return source


def _is_logsumexp(node: fx.Node, scores: fx.Node, dim: int) -> bool:
    """``logsumexp(x, [dim])`` (keepdim False), whole or as decomposed, of the scores ``x``."""
    if ops.calls(node, *ops.LOGSUMEXP):
        return _reads(node.args[0], scores) and _dims(node, "dim") == [dim]  # keepdim False: op_table pins it
    # log(sum(exp(x - m), dim)) + squeeze(m, dim) with m the row max (its infinities replaced by 0)
    if not ops.calls(node, *ops.ADD) or ops.arg(node, "alpha") != 1:
        return False
    log, squeezed = ops.arg(node, "self"), ops.arg(node, "other")
    if not (ops.calls(log, *ops.LOG) and ops.calls(log.args[0], *ops.SUM) and ops.calls(squeezed, *ops.SQUEEZE)):
        return False
    total = log.args[0]
    if ops.arg(total, "keepdim") or _dims(total, "dim") != [dim] or not ops.calls(total.args[0], *ops.EXP):
        return False
    shifted = total.args[0].args[0]
    if not ops.calls(shifted, *ops.SUB):
        return False
    x, row_max = ops.arg(shifted, "self"), ops.arg(shifted, "other")
    return _reads(x, scores) and squeezed.args[0] is row_max and _dims(squeezed, "dim") == [dim] \
        and _is_finite_row_max(row_max, x, dim)


def _is_finite_row_max(node, x: fx.Node, dim: int) -> bool:
    """``amax(x, [dim], keepdim=True)``, or ``where(|that| == inf, 0, that)``."""
    if ops.calls(node, *ops.WHERE):
        condition, zero, row_max = (ops.arg(node, n) for n in ("condition", "self", "other"))
        if not (_is_zero(zero) and ops.calls(condition, *ops.EQ) and ops.arg(condition, "other") == float("inf")):
            return False
        magnitude = ops.arg(condition, "self")
        if not (ops.calls(magnitude, *ops.ABS) and magnitude.args[0] is row_max):
            return False
        node = row_max
    return ops.calls(node, *ops.AMAX) and node.args[0] is x and _dims(node, "dim") == [dim]


def _is_zero(arg) -> bool:
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return arg == 0
    return ops.calls(arg, *ops.FILL) and ops.arguments(arg).get("s", ops.arguments(arg).get("fill_value")) == 0


def _dims(node: fx.Node, name: str) -> Optional[list]:
    dims = ops.arg(node, name)
    rank = tensor_val(node.args[0]).dim()
    if isinstance(dims, int):
        dims = [dims]
    return None if dims is None else [d % rank for d in dims]


def _reads(x: fx.Node, scores: fx.Node) -> bool:
    """``x`` and the scores are one tensor, each maybe widened (upcast for the softmax, or for the lse)."""
    return _before_widening(x) is _before_widening(scores)


def _before_widening(node: fx.Node) -> fx.Node:
    while ops.calls(node, *ops.CAST) and ops.widens(_dtype(node.args[0]), _dtype(node)):
        node = node.args[0]
    return node
