"""Hand-written attention in ATen: ``softmax(scale * (q @ kᵀ) + mask, -1) @ v`` in all its spellings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .fx_utils import aten, forward_users, is_op, minus_infinity, prims, scalar_value, tensor_val
from .site import BHSD, BSHD, FLAT, AttentionSite
from .views import BatchedMatmul, Operand, batched_matmul, repeated_heads, strip_views

# Ops allowed between the softmax and the P @ V matmul: casts, dropout(p=0)'s clone, views.
_PROBS_PASSTHROUGH = (prims.convert_element_type, aten.clone, aten.alias, aten.expand, aten.view,
                      aten._unsafe_view, aten.reshape, aten.permute, aten.unsqueeze)
# Random number ops by name: some (prims.inductor_random) exist only once Inductor is loaded.
_RANDOM_OP_NAMES = frozenset({"rand", "rand_like", "randn", "bernoulli", "native_dropout", "inductor_random", "inductor_seeds"})
_LAYOUTS_QV = {(0, 1, 2, 3): BHSD, (0, 2, 1, 3): BSHD, (0, 1, 2): FLAT}
_LAYOUTS_KT = {(0, 1, 3, 2): BHSD, (0, 2, 3, 1): BSHD, (0, 2, 1): FLAT}


@dataclass
class Softmax:
    input: fx.Node
    output: fx.Node
    dim: int  # normalised to be non-negative


def softmax_at(node: fx.Node) -> Optional[Softmax]:
    """Recognises the softmax Inductor's decomposition leaves (amax, sub, exp, sum, div) or an undecomposed one."""
    if is_op(node, aten._softmax, aten._safe_softmax):
        x = node.args[0]
        return Softmax(x, node, node.args[1] % tensor_val(x).dim())
    if not is_op(node, aten.div) or not isinstance(node.args[1], fx.Node):
        return None
    exp, total = node.args
    if not (is_op(exp, aten.exp) and is_op(total, aten.sum) and total.args[0] is exp and is_op(exp.args[0], aten.sub)):
        return None
    x, row_max = exp.args[0].args
    if not (is_op(row_max, aten.amax) and row_max.args[0] is x):
        return None
    rank = tensor_val(x).dim()
    dims = {d % rank for d in row_max.args[1]}
    if len(dims) != 1 or {d % rank for d in total.args[1]} != dims:
        return None
    return Softmax(x, node, dims.pop())


def _scalar_factor(arg):
    """A number, a SymFloat node, or a 0-d floating tensor node (dynamic shapes give ``1/sqrt(d)`` so)."""
    value = tensor_val(arg)
    if value is not None:
        return arg if value.dim() == 0 and value.dtype.is_floating_point else None
    return scalar_value(arg)


def _scale_factor(node: fx.Node):
    """(input, factor, divide) for ``input * c`` or ``input / c`` with a scalar c."""
    if not is_op(node, aten.mul, aten.div) or len(node.args) != 2:
        return None
    x, c = node.args
    if isinstance(x, fx.Node) and tensor_val(x) is not None and tensor_val(x).dim() > 0:
        factor = _scalar_factor(c)
        if factor is not None:
            return x, factor, is_op(node, aten.div)
    if is_op(node, aten.mul) and isinstance(c, fx.Node) and tensor_val(c) is not None and tensor_val(c).dim() > 0:
        factor = _scalar_factor(x)
        if factor is not None:
            return c, factor, False
    return None


def _reaches_matmul(node: fx.Node, steps: int = 8) -> bool:
    """A batched matmul lies above ``node`` through elementwise ops (what scores go through)."""
    for _ in range(steps):
        if batched_matmul(node) is not None:
            return True
        scaled = _scale_factor(node)
        if scaled:
            node = scaled[0]
            continue
        tensor_inputs = [a for a in node.all_input_nodes if tensor_val(a) is not None]
        if is_op(node, aten.add, aten.where):
            return any(_reaches_matmul(a, steps - 1) for a in tensor_inputs)
        if len(tensor_inputs) != 1 or tensor_val(node) is None:
            return False
        node = tensor_inputs[0]
    return False


@dataclass
class _Scores:
    matmul: Optional[BatchedMatmul]
    factors: list  # (factor, divide) on the scores
    masks: list  # additive float masks (summed), or a single boolean one
    mask_negated: bool = False
    refusal: Optional[str] = None
    detail: str = ""


def _is_bool(node) -> bool:
    value = tensor_val(node)
    return value is not None and value.dtype == torch.bool


def _walk_up_scores(x: fx.Node) -> Optional[_Scores]:
    """From the softmax input up to the q @ kᵀ matmul, collecting scale factors and masks."""
    scores = _Scores(None, [], [])
    for _ in range(16):
        scores.matmul = batched_matmul(x)
        if scores.matmul is not None:
            return scores
        scaled = _scale_factor(x)
        if is_op(x, prims.convert_element_type):
            x = x.args[0]
        elif scaled:
            x = scaled[0]
            scores.factors.append(scaled[1:])
        elif is_op(x, aten.add) and len(x.args) == 2 and all(isinstance(a, fx.Node) for a in x.args):
            a, b = x.args
            a_scores, b_scores = _reaches_matmul(a), _reaches_matmul(b)
            if a_scores == b_scores:
                return None
            x, mask = (a, b) if a_scores else (b, a)
            if not tensor_val(mask).dtype.is_floating_point:  # s + bool adds 1.0: not a mask the op knows
                return _refused(scores, "non_float_additive_mask")
            if scores.factors or scores.mask_negated or any(_is_bool(m) for m in scores.masks):
                return _refused(scores, "scale_after_mask" if scores.factors else "several_masks")
            scores.masks.append(mask)
        elif is_op(x, aten.where) and len(x.args) == 3:
            condition, if_true, if_false = x.args
            if minus_infinity(if_false) and isinstance(if_true, fx.Node):
                x, negated = if_true, False
            elif minus_infinity(if_true) and isinstance(if_false, fx.Node):
                x, negated = if_false, True
            else:
                return _refused(scores, "finite_fill_value") if _reaches_matmul(x) else None
            if scores.factors or scores.masks:
                return _refused(scores, "scale_after_mask" if scores.factors else "several_masks")
            scores.masks, scores.mask_negated = [condition], negated
        else:
            transformed = any(_reaches_matmul(a) for a in x.all_input_nodes)
            if not transformed:
                return None
            # tanh between scale and softmax is logit soft-capping (Gemma 2): not an attention the op computes.
            return _refused(scores, "softcap" if is_op(x, aten.tanh) else "score_transform", str(x.target))
    return None


def _refused(scores: _Scores, reason: str, detail: str = "") -> _Scores:
    scores.refusal, scores.detail = reason, detail
    return scores


def _peel_operand(operand: Operand):
    """(source, dims, factors): walks through scalar scaling and more views on a matmul operand."""
    node, dims, factors = operand.source, list(operand.dims), []
    while True:
        scaled = _scale_factor(node)
        if scaled is None:
            return node, dims, factors
        factors.append(scaled[1:])
        source, source_dims = strip_views(scaled[0])
        dims = [source_dims[d] for d in dims]
        if None in dims:
            return None
        node = source


def _walk_down_probs(softmax: Softmax):
    """(P @ V matmul, probability nodes) or a refusal reason, or None when no matmul follows."""
    node, chain = softmax.output, [softmax.output]
    for _ in range(16):
        users = forward_users(node)
        if len(users) != 1:
            return "probs_used_elsewhere" if len(users) > 1 else None
        user = users[0]
        if is_op(user, aten.bmm):
            return (user, chain) if user.args[0] is node else None
        if is_op(user, aten.mul):
            other = [a for a in user.args if a is not node]
            return "dropout_active" if other and _is_random(other[0]) else "probs_modified"
        if _zeroes_empty_rows(user, node, softmax.input):
            node = user  # SDPA's safe softmax: rows with no visible key give 0, as the op does
            chain.append(node)
            continue
        if not is_op(user, *_PROBS_PASSTHROUGH):
            return "probs_modified" if is_op(user, aten.add, aten.sub, aten.div, aten.where) else None
        node = user
        chain.append(node)
    return None


def _zeroes_empty_rows(node: fx.Node, probs: fx.Node, scores: fx.Node) -> bool:
    """``where(no_key_visible(scores), 0, probs)``: the condition must be computed from the scores alone."""
    if not (is_op(node, aten.where) and len(node.args) == 3 and node.args[2] is probs):
        return False
    condition, zero = node.args[0], node.args[1]
    if not (zero == 0 or (is_op(zero, aten.full, aten.scalar_tensor) and zero.args[-1] == 0)):
        return False
    ancestors, stack = set(), [condition]
    while stack:
        n = stack.pop()
        if n is scores or n in ancestors:
            continue
        if n.op != "call_function" or len(ancestors) > 8:
            return False
        ancestors.add(n)
        stack.extend(n.all_input_nodes)
    return True


def _is_random(node, depth: int = 4) -> bool:
    if not isinstance(node, fx.Node) or depth == 0:
        return False
    name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
    return name in _RANDOM_OP_NAMES or any(_is_random(a, depth - 1) for a in node.all_input_nodes)


def _anchor_for(bmm: fx.Node) -> Optional[BatchedMatmul]:
    """P @ V in its logical layout: the outermost of bmm itself, its batch-split view, einsum's re-layout."""
    node, found = bmm, None
    for _ in range(6):
        matmul = batched_matmul(node)
        if matmul is not None and matmul.bmm is bmm:
            found = matmul
        users = list(node.users)
        if len(users) != 1 or not is_op(users[0], aten.view, aten._unsafe_view, aten.reshape, aten.permute):
            return found
        node = users[0]
    return found


def attention_shaped(softmax: Softmax) -> bool:
    """A matmul feeds the softmax and its output feeds another matmul (whatever the softmax dim)."""
    return _reaches_matmul(softmax.input) and isinstance(_walk_down_probs(softmax), tuple)


def match_softmax_attention(softmax: Softmax) -> Optional[AttentionSite]:
    """An AttentionSite (possibly refused) for an attention-shaped softmax; None for any other softmax."""
    probs = _walk_down_probs(softmax)
    if probs is None or not _reaches_matmul(softmax.input):
        return None
    if isinstance(probs, str):
        return AttentionSite("matmul_softmax", softmax.output).refuse(probs)
    bmm, probs_chain = probs
    pv = _anchor_for(bmm)
    site = AttentionSite("matmul_softmax", pv.out if pv else bmm)
    if softmax.dim != tensor_val(softmax.input).dim() - 1:
        return site.refuse("softmax_not_last_dim")
    if pv is None or pv.lhs.source not in probs_chain or pv.lhs.dims != list(range(pv.batch_rank + 2)):
        return site.refuse("unrecognised_layout", "P @ V")
    scores = _walk_up_scores(softmax.input)
    if scores is None:
        return site.refuse("unrecognised_scores")
    if scores.refusal:
        return site.refuse(scores.refusal, scores.detail)
    if scores.matmul.batch_rank != pv.batch_rank:
        return site.refuse("unrecognised_layout", "rank")
    q_side, k_side = _peel_operand(scores.matmul.lhs), _peel_operand(scores.matmul.rhs)
    if q_side is None or k_side is None:
        return site.refuse("unrecognised_layout", "q/k views")
    q, q_dims, q_factors = q_side
    k, kt_dims, k_factors = k_side
    v, v_dims = pv.rhs.source, pv.rhs.dims
    layouts = {
        "q": _LAYOUTS_QV.get(tuple(q_dims)),
        "k": _LAYOUTS_KT.get(tuple(kt_dims)),
        "v": _LAYOUTS_QV.get(tuple(v_dims)),
        "out": FLAT if pv.batch_rank == 1 else BHSD,
    }
    if None in layouts.values():
        return site.refuse("unrecognised_layout", f"q {q_dims}, kT {kt_dims}, v {v_dims}")
    site.q, site.k, site.v, site.layouts = q, k, v, layouts
    _record_scale(site, scores.factors, q_factors, k_factors)
    site.mask = scores.masks[0] if scores.masks else None
    site.extra_masks, site.mask_negated = scores.masks[1:], scores.mask_negated
    _map_repeated_kv(site)
    if _upcast(softmax):
        site.notes.append("float32 softmax")
    return site


def _record_scale(site: AttentionSite, *factor_lists) -> None:
    scale, symbolic, where = 1.0, [], []
    for name, factors in zip(("scores", "q", "k"), factor_lists):
        for factor, divide in factors:
            where.append(name)
            if isinstance(factor, fx.Node):
                symbolic.append((factor, divide))
            else:
                scale = scale / factor if divide else scale * factor
    site.scale, site.symbolic_scale = scale, symbolic
    site.notes.append("scale on " + "+".join(sorted(set(where))) if where else "no scale")


def _map_repeated_kv(site: AttentionSite) -> None:
    if site.layouts["k"] != BHSD or site.layouts["v"] != BHSD:
        return
    k_rep, v_rep = repeated_heads(site.k), repeated_heads(site.v)
    if k_rep and v_rep and k_rep[1] == v_rep[1]:
        site.k, site.v, site.n_rep = k_rep[0], v_rep[0], k_rep[1]


def _upcast(softmax: Softmax) -> bool:
    x = softmax.input
    return is_op(x, prims.convert_element_type) and tensor_val(x.args[0]).dtype != tensor_val(x).dtype
