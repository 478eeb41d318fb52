"""Hand-written attention in ATen: ``softmax(scale * (q @ kᵀ) + mask, -1) @ v`` in all its spellings.

Every node accepted inside the chain goes through ``op_table.calls`` (overload and every argument that
can change a value); anything else between the matmuls refuses the site with the reason it is not
the op's attention.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from . import op_table as ops
from .fx_utils import forward_users, insert_call, is_op, is_joint_graph, same_shape, same_size, scalar_value, tensor_val
from .mask_structure import (constant_after_casts, constant_value, finite_by_construction, same_computation,
                             strip_value_preserving, without_negations)
from .precision import chain_rounding_refusal, run_in_input_precision
from .refusals import Refusal, Refused
from .sink_gate import sink_gate
from .site import BHSD, FLAT, AttentionSite
from .views import BatchedMatmul, Operand, batched_matmul, batched_matmul_readings, is_batched_product, repeated_heads, strip_views, undoes_a_view

# Random number ops by name: some (prims.inductor_random) exist only once Inductor is loaded.
_RANDOM_OP_NAMES = frozenset({"rand", "rand_like", "randn", "bernoulli", "native_dropout", "inductor_random", "inductor_seeds"})
# A fill at most this large (and finite in float32) is an additive mask: s + fill rounds to fill in
# float32 for every |s| < 2**103, so masked scores, and rows with every key masked, come out as in eager.
_ABSORBING_FILL = -(2.0**127)
_FLOAT32_MIN = torch.finfo(torch.float32).min
# Ops allowed between the softmax and the P @ V matmul besides casts and the safe softmax's zeroing.
_PROBS_LAYOUT = ops.IDENTITY + ops.VIEW + ops.EXPAND + ops.PERMUTE + ops.UNSQUEEZE


def _dtype(node) -> torch.dtype:
    return tensor_val(node).dtype


@dataclass
class Softmax:
    input: fx.Node  # the tensor the softmax normalises
    output: fx.Node
    dim: int  # normalised to be non-negative
    rounded_to: set = field(default_factory=set)  # float dtypes the softmax itself narrows its input to
    refused: Optional[Refused] = None


def softmax_at(node: fx.Node) -> Optional[Softmax]:
    """Recognises the softmax Inductor's decomposition leaves (amax, sub, exp, sum, div) or an undecomposed one."""
    if ops.calls(node, *ops.SOFTMAX, *ops.SAFE_SOFTMAX):
        x = node.args[0]
        softmax = Softmax(x, node, ops.arg(node, "dim") % tensor_val(x).dim())
        _judge_cast(softmax, _dtype(x), _dtype(node), "in the softmax")
        return softmax
    if not ops.calls(node, *ops.overloads(torch.ops.aten.div, "Tensor")) or not isinstance(node.args[1], fx.Node):
        return None
    exp, total = node.args
    if not (ops.calls(exp, *ops.EXP) and ops.calls(total, *ops.SUM) and ops.arg(total, "keepdim") is True
            and total.args[0] is exp and ops.calls(exp.args[0], *ops.SUB)):
        return None
    x, row_max = exp.args[0].args
    if not (ops.calls(row_max, *ops.AMAX) and row_max.args[0] is x):
        return None
    rank = tensor_val(x).dim()
    dims = {d % rank for d in ops.arg(row_max, "dim")}
    if len(dims) != 1 or {d % rank for d in ops.arg(total, "dim")} != dims:
        return None
    return Softmax(x, node, dims.pop())


def _judge_cast(record, source: torch.dtype, target: torch.dtype, where: str) -> None:
    """Widening keeps values; a float narrowing is kept for the site's dtype check; the rest refuses."""
    if ops.widens(source, target):
        return
    if source.is_floating_point and target.is_floating_point:
        record.rounded_to.add(target)
    elif record.refused is None:
        record.refused = Refused(Refusal.VALUE_CHANGING_CAST, f"{source} -> {target} {where}")


def _scalar_factor(arg):
    """A finite number, a SymFloat node, or a 0-d floating tensor node (dynamic shapes give ``1/sqrt(d)`` so)."""
    value = tensor_val(arg)
    if value is not None:
        return arg if value.dim() == 0 and value.dtype.is_floating_point else None
    factor = scalar_value(arg)
    return None if isinstance(factor, (int, float)) and not math.isfinite(factor) else factor


def _scale_factor(node: fx.Node):
    """(input, factor, divide) for ``input * c`` or ``input / c`` with a scalar c."""
    if not ops.calls(node, *ops.SCALE):
        return None
    x, c = ops.arg(node, "self"), ops.arg(node, "other")
    divide = node.target in ops.DIVIDE
    if isinstance(x, fx.Node) and tensor_val(x) is not None and tensor_val(x).dim() > 0:
        factor = _scalar_factor(c)
        if factor is not None:
            return x, factor, divide
    if not divide and isinstance(c, fx.Node) and tensor_val(c) is not None and tensor_val(c).dim() > 0:
        factor = _scalar_factor(x)
        if factor is not None:
            return c, factor, False
    return None


def _reaches_matmul(node: fx.Node, steps: int = 8) -> bool:
    """A batched matmul lies above ``node`` through elementwise ops (what scores go through)."""
    for _ in range(steps):
        if not isinstance(node, fx.Node):
            return False
        if batched_matmul(node, with_bias=True) is not None or is_batched_product(node, with_bias=True):
            return True
        scaled = _scale_factor(node)
        viewed = strip_views(node)[0]  # a chain of views is one step (LongT5's in-place sum views 6 deep)
        if scaled or viewed is not node:
            node = scaled[0] if scaled else viewed
            continue
        tensor_inputs = [a for a in node.all_input_nodes if tensor_val(a) is not None]
        if len(tensor_inputs) > 1:
            return any(_reaches_matmul(a, steps - 1) for a in tensor_inputs)
        if len(tensor_inputs) != 1 or tensor_val(node) is None:
            return False
        node = tensor_inputs[0]
    return False


@dataclass
class _Scores:
    matmul: Optional[BatchedMatmul] = None
    factors: list = field(default_factory=list)  # (factor, divide) on the scores
    masks: list = field(default_factory=list)  # additive float masks (summed), or a single boolean one
    mask_negated: bool = False
    rounded_to: set = field(default_factory=set)  # float dtypes the scores are narrowed to
    merged_heads: Optional[tuple] = None  # [B, H, M, K] while above a view of the scores as [B*H, M, K]
    unflattened: list = field(default_factory=list)  # (index in masks, user) of masks met while merged_heads
    clamped: bool = False  # under a clamp at the lowest finite value: a -inf inside it would become finite
    softcap: float = 0.0  # cap * tanh(scores / cap) met on the way up; the masks met before it come after it
    masks_after_softcap: int = 0
    bool_mask_where: Optional[fx.Node] = None  # the where() whose -inf fill gave the bool mask
    zeroed: Optional[tuple] = None  # (condition, zeroed where True): the probabilities zeroed after the softmax
    zeroed_fill: Optional[float] = None  # the fill of the mask that hides the keys zeroed, once found
    product_terms: int = 0  # masks that are terms computed from other products (relative positions)
    refused: Optional[Refused] = None


def _is_bool(node) -> bool:
    value = tensor_val(node)
    return value is not None and value.dtype == torch.bool


def _walk_up_scores(softmax: Softmax, zeroed: Optional[tuple] = None) -> Optional[_Scores]:
    """From the softmax input up to the q @ kᵀ matmul, collecting scale factors, masks and casts (``zeroed``:
    the probabilities' zeroing, see ``_zeroes_masked_probs``)."""
    x, scores = softmax.input, _Scores(rounded_to=set(softmax.rounded_to), zeroed=zeroed)
    for _ in range(24):
        if scores.merged_heads is None:
            scores.matmul = batched_matmul(x, with_bias=True, scale_of=_scale_factor)
            if scores.matmul is not None:
                if scores.matmul.bias is not None:
                    _bias_of_product(scores, scores.matmul)
                if scores.softcap and len(scores.masks) > scores.masks_after_softcap and not scores.refused:
                    scores.refused = Refused(Refusal.SOFTCAP, "a mask added before the soft-capping")
                return scores
        elif _splits_heads(x, scores.merged_heads):
            _flatten_masks(scores, x)
            x, scores.merged_heads = x.args[0], None
            continue
        scaled = _scale_factor(x)
        if ops.calls(x, *ops.CAST):
            _judge_cast(scores, _dtype(x.args[0]), _dtype(x), "on the scores")
            x = x.args[0]
        elif scaled:
            x = scaled[0]
            scores.factors.append(scaled[1:])
        elif _plus_zero(x) is not None:
            x = _plus_zero(x)
        elif ops.calls(x, *ops.ADD) and all(isinstance(a, fx.Node) for a in x.args):
            x = _additive_mask(scores, x)
        elif _subtracts_mask(x):
            x = _add_mask(scores, x.args[0], _negated_mask(x), x)
        elif scores.merged_heads is None and _split_sum(x):
            x = _sum_of_views(x)
            if x is None:
                scores.refused = Refused(Refusal.UNRECOGNISED_LAYOUT, "a term broadcast against [B*H, M, K] scores, "
                                         "the sum then viewed as [B, H, M, K]")
        elif ops.calls(x, *ops.WHERE):
            x = _where_mask(scores, x)
        elif undoes_a_view(x):
            x = x.args[0].args[0]
        elif _clamped_at_lowest(x) is not None:
            x = _clamped_at_lowest(x)
            scores.clamped = True
        elif x.target is torch.ops.aten.tanh.default and not scores.softcap and _softcap(scores, x) is not None:
            x = _softcap(scores, x)
            scores.softcap, scores.factors, scores.masks_after_softcap = _softcap_value(scores), [], len(scores.masks)
        elif scores.merged_heads is None and _merges_heads(x):
            x = x.args[0]
            scores.merged_heads = tuple(tensor_val(x).shape)
        elif _viewed_scores(x) is not None:
            x, as_they_are = _viewed_scores(x)
            if not as_they_are:
                scores.refused = Refused(Refusal.SCORE_TRANSFORM, "the scores seen through views that move their values")
        elif any(_reaches_matmul(a) for a in x.all_input_nodes):
            scores.refused = _transform_refusal(x)
        else:
            return None
        if scores.refused:  # before x: a step that refuses may leave no node to go on with
            return scores
        if x is None:
            return None
    return None


def _softcap_value(scores: _Scores) -> float:
    """The product of the factors met since the last mask: what multiplies tanh(...) (numbers only)."""
    value = 1.0
    for factor, divide in scores.factors:
        value = value / factor if divide else value * factor
    return value


def _softcap(scores: _Scores, tanh: fx.Node) -> Optional[fx.Node]:
    """The scores inside ``cap * tanh(scores / cap)`` (Gemma 2's logit soft-capping), with cap a number > 0
    that multiplies the tanh exactly as it divides the scores (to float32's rounding); None otherwise."""
    if not scores.factors or any(isinstance(f, fx.Node) for f, _ in scores.factors):
        return None
    inner = _scale_factor(tanh.args[0])
    if inner is None or isinstance(inner[1], fx.Node) or _dtype(inner[0]) != _dtype(tanh):
        return None
    x, factor, divide = inner
    cap = _softcap_value(scores)
    inner_cap = factor if divide else 1.0 / factor
    if not (cap > 0 and math.isfinite(cap) and math.isclose(cap, inner_cap, rel_tol=2 ** -23)):
        return None
    return x


def _viewed_scores(node: fx.Node) -> Optional[tuple[fx.Node, bool]]:
    """(scores, as they are): the scores a chain of views and permutes shows, and whether it shows them with
    their own shape and dim order (LongT5's in-place ``scores += bias`` on einsum's view of its product,
    functionalised, views the sum back into the product's layout and out again); None for no such chain."""
    if not ops.calls(node, *ops.VIEW, *ops.PERMUTE, *ops.IDENTITY):
        return None
    source, dims = strip_views(node)  # a size-1 dim comes out as None (any size-1 dim shows it)
    if source is node or not _reaches_matmul(source):
        return None
    same = all(d in (i, None) for i, d in enumerate(dims))
    return source, same and same_shape(tensor_val(source).shape, tensor_val(node).shape)


def _plus_zero(node: fx.Node) -> Optional[fx.Node]:
    """The scores of ``scores + 0`` (DeBERTa without relative attention adds its ``rel_att = 0``): the same
    values (a -0.0 score becomes 0.0, which exp() does not tell apart)."""
    if not ops.calls(node, *ops.ADD):
        return None
    x, other, alpha = node.args[0], ops.arg(node, "other"), ops.arg(node, "alpha")
    if not (_is_number(other) and other == 0 and _is_number(alpha) and math.isfinite(alpha)):
        return None
    if not isinstance(x, fx.Node) or _dtype(x) != _dtype(node):
        return None
    return x


def _transform_refusal(node: fx.Node) -> Refused:
    """Why an op on the scores makes the chain something else than the op's attention."""
    unaccepted = ops.unaccepted_use(node)
    if unaccepted:
        return Refused(Refusal.UNSUPPORTED_ARGUMENT, unaccepted)
    # tanh between scale and softmax is logit soft-capping (Gemma 2): not an attention the op computes.
    if node.target is torch.ops.aten.tanh.default:
        return Refused(Refusal.SOFTCAP, str(node.target))
    if ops.calls(node, *ops.overloads(torch.ops.aten.mul, "Tensor")) and all(
            tensor_val(a) is not None and tensor_val(a).dim() > 0 for a in node.args):
        # OpenAI GPT's ``w * b + -1e4 * (1 - b)``: an additive mask only if every b is 0 or 1, which a tensor
        # read from the graph's inputs (a buffer) does not prove.
        return Refused(Refusal.SCORE_TRANSFORM, f"{node.target}: the scores multiplied by a tensor (a multiplicative mask)")
    return Refused(Refusal.SCORE_TRANSFORM, str(node.target))


def _additive_mask(scores: _Scores, add: fx.Node) -> Optional[fx.Node]:
    """``s + mask``; ``add(s, mask, alpha=a)`` is ``s + a * mask``, ``add(mask, s, alpha=a)`` is ``a * s + mask``."""
    a, b = add.args
    a_scores, b_scores = _reaches_matmul(a), _reaches_matmul(b)
    if a_scores and b_scores:
        return _add_of_bias_from_products(scores, add)
    if a_scores == b_scores:
        return None
    x, mask = (a, b) if a_scores else (b, a)
    return _add_mask(scores, x, mask, add)


def _add_of_bias_from_products(scores: _Scores, add: fx.Node) -> Optional[fx.Node]:
    """``scores + bias`` where the bias is computed by other products, e.g. from q (a relative-position
    term: Transformer-XL's, Conformer's, SAM's): an additive mask like any other, as long as the scores'
    own q @ kᵀ is on one side alone and the bias is not computed from it."""
    a, b = add.args
    products = _direct_product(a), _direct_product(b)
    if (products[0] is None) == (products[1] is None):
        scores.refused = Refused(Refusal.SCORE_TRANSFORM, "a sum of two terms that are both products: which one "
                                 "is q @ kᵀ and which an added bias is unclear")
        return None
    (x, mask), product = ((a, b), products[0]) if products[0] is not None else ((b, a), products[1])
    if _computed_from(mask, product):
        scores.refused = Refused(Refusal.SCORE_TRANSFORM, "a term computed from the scores added to them")
        return None
    if is_joint_graph(add.graph):
        scores.refused = Refused(Refusal.TRAINING_GRADIENT_UNMAPPED, "an additive term computed from other "
                                 "products (relative positions): its gradient also flows into their inputs")
        return x
    scores.product_terms += 1
    return _add_mask(scores, x, mask, add)


def _direct_product(node, steps: int = 8) -> Optional[fx.Node]:
    """The batched product that ``node`` is through scaling, casts, views and additions of terms that are no
    products (the scores' own path up to q @ kᵀ); None if there is none or more than one."""
    for _ in range(steps):
        if not isinstance(node, fx.Node) or tensor_val(node) is None:
            return None
        matmul = batched_matmul(node, with_bias=True, scale_of=_scale_factor)
        if matmul is not None:
            return matmul.bmm
        scaled = _scale_factor(node)
        if scaled:
            node = scaled[0]
        elif ops.calls(node, *ops.CAST):
            node = node.args[0]
        elif ops.calls(node, *ops.ADD) and all(isinstance(a, fx.Node) for a in node.args):
            found = [p for p in map(_direct_product, node.args) if p is not None]
            return found[0] if len(found) == 1 else None
        else:
            return None
    return None


def _computed_from(node: fx.Node, source: fx.Node) -> bool:
    """``source`` is an ancestor of ``node`` (only nodes after ``source`` in the graph can be on the way)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    start, seen, stack = order[source], set(), [node]
    while stack:
        current = stack.pop()
        if current is source:
            return True
        if current in seen or order.get(current, -1) < start:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False


def _add_mask(scores: _Scores, x: fx.Node, mask: fx.Node, add: fx.Node) -> fx.Node:
    """Records ``mask`` as added to the scores ``x`` by ``add`` (or why it cannot be); returns ``x``."""
    a, b = add.args
    alpha = ops.arg(add, "alpha")
    if not (_is_number(alpha) and math.isfinite(alpha)):
        scores.refused = Refused(Refusal.UNSUPPORTED_ARGUMENT, f"{add.target} with alpha={alpha!r}")
    elif not _dtype(mask).is_floating_point:  # s + bool adds 1.0: not a mask the op knows
        scores.refused = Refused(Refusal.NON_FLOAT_ADDITIVE_MASK, str(_dtype(mask)))
    elif scores.clamped and not finite_by_construction(mask):
        scores.refused = _clamp_over_infinities()
    elif any(isinstance(factor, fx.Node) for factor, _ in scores.factors):
        scores.refused = Refused(Refusal.SCALE_AFTER_MASK, "a mask, then a scale that is a tensor")
    elif any(not ops.widens(_dtype(mask), d) for d in scores.rounded_to):
        scores.refused = Refused(Refusal.VALUE_CHANGING_CAST, f"a {_dtype(mask)} mask rounded to "
                                 f"{', '.join(sorted(map(str, scores.rounded_to)))} with the scores")
    else:
        _bool_mask_as_additive(scores)
        if alpha != 1 and mask is b:
            mask = _scaled_mask(mask, alpha, add)
        if scores.factors:
            mask = _mask_under_later_factors(mask, scores.factors, add)
        scores.masks.append(_mask_for_flat_scores(mask, scores, add))
        if alpha != 1 and x is b:
            scores.factors.append((alpha, False))  # applied to the scores before the mask is added
    return x


def _subtracts_mask(sub: fx.Node) -> bool:
    """``scores - mask`` (Funnel's ``s - INF * (1 - mask)``): ``s + (-mask)``, the same value bit for bit."""
    if not (ops.calls(sub, *ops.SUB) and all(isinstance(a, fx.Node) for a in sub.args)):
        return False
    x, mask = sub.args
    return (_reaches_matmul(x) and tensor_val(mask) is not None and not _reaches_matmul(mask)
            and not _computed_from(mask, x))  # e.g. a max of the scores


def _negated_mask(sub: fx.Node) -> fx.Node:
    with sub.graph.inserting_before(sub):
        negated = insert_call(sub.graph, torch.ops.aten.neg.default, (sub.args[1],))
    _tag_like(sub, [negated])
    return negated


def _split_sum(view: fx.Node) -> bool:
    """``(s + t).view(B, H, M, K)`` of [B*H, M, K] scores: DeBERTa-v2 adds its relative-position terms to
    the 3-D scores, then masks and normalises a 4-D view of the sum."""
    if not ops.calls(view, *ops.VIEW) or not ops.calls(view.args[0], *ops.ADD):
        return False
    shape, merged = tensor_val(view).shape, tensor_val(view.args[0]).shape
    return len(merged) == 3 and len(shape) == 4 and same_shape(shape[2:], merged[1:])


def _sum_of_views(view: fx.Node) -> Optional[fx.Node]:
    """Replaces ``view(s + t)`` by ``view(s) + view(t)`` (the same values: splitting the batch dim is a view
    of any tensor), so that the walk reads t as a term added to the scores' [B, H, M, K] view, and t stays
    inside the site; None when a term broadcasts (its view would be another shape)."""
    add = view.args[0]
    terms = [ops.arg(add, "self"), ops.arg(add, "other")]
    if not all(isinstance(t, fx.Node) and same_shape(tensor_val(t).shape, tensor_val(add).shape) for t in terms):
        return None
    graph = view.graph
    with graph.inserting_before(view):
        views = [insert_call(graph, view.target, (t, *view.args[1:]), dict(view.kwargs)) for t in terms]
        split = insert_call(graph, add.target, tuple(views), dict(add.kwargs))
    _tag_like(view, [*views, split])
    view.replace_all_uses_with(split)
    graph.erase_node(view)
    if not add.users:
        graph.erase_node(add)
    return split


def _clamp_over_infinities() -> Refused:
    """A clamp at the lowest value turns a -inf mask into a finite fill: eager then averages V over a fully
    masked row (and over all its keys, -inf or not), which a -inf mask in the op does not."""
    return Refused(Refusal.SCORE_TRANSFORM, "a clamp at the lowest value over a mask that may hold -inf")


def _clamped_at_lowest(node: fx.Node) -> Optional[fx.Node]:
    """The clamped tensor of ``max(x, c)`` / ``clamp_min(x, c)`` with c at or below the dtype's lowest
    finite value (XGLM's guard against -inf): the identity on every finite score."""
    if not ops.calls(node, *ops.CLAMP_LOW):
        return None
    x, bound = node.args[0], node.args[1]
    if not isinstance(x, fx.Node) or _dtype(x) != _dtype(node) or not _dtype(node).is_floating_point:
        return None
    if isinstance(bound, fx.Node) and (tensor_val(bound) is None or tensor_val(bound).dim() > 0):
        return None  # a bound that broadcasts the scores to another shape is no plain clamp
    value = constant_value(bound)
    return x if value is not None and value <= torch.finfo(_dtype(node)).min else None


def _bias_of_product(scores: _Scores, matmul: BatchedMatmul) -> None:
    """``baddbmm(bias, q, kᵀ, beta=1, alpha=a)`` is ``a * (q @ kᵀ) + bias``: the scale a, and the bias as an
    additive mask (BLOOM's ALiBi, F.multi_head_attention_forward's float attn_mask); a zero bias is none."""
    product = matmul.bmm
    beta, alpha, bias = ops.arg(product, "beta"), ops.arg(product, "alpha"), matmul.bias
    if not (_is_number(beta) and beta == 1 and _is_number(alpha) and math.isfinite(alpha)):
        scores.refused = Refused(Refusal.UNSUPPORTED_ARGUMENT, f"{product.target} with beta={beta!r}, alpha={alpha!r}")
        return
    if alpha != 1:
        scores.factors.append((alpha, False))
    if _fill_value(bias, product) == 0:
        return
    if scores.clamped and not finite_by_construction(bias):
        scores.refused = _clamp_over_infinities()
    elif not _dtype(bias).is_floating_point:
        scores.refused = Refused(Refusal.NON_FLOAT_ADDITIVE_MASK, str(_dtype(bias)))
    elif len(scores.factors) > (alpha != 1):
        scores.refused = Refused(Refusal.SCALE_AFTER_MASK, "the scores of a baddbmm with a bias are scaled")
    elif any(not ops.widens(_dtype(bias), d) for d in scores.rounded_to):
        scores.refused = Refused(Refusal.VALUE_CHANGING_CAST, f"a {_dtype(bias)} bias rounded with the scores")
    else:
        _bool_mask_as_additive(scores)
        mask = _bias_as_scores_mask(bias, matmul)
        if mask is None:
            scores.refused = Refused(Refusal.UNRECOGNISED_LAYOUT, "a baddbmm bias over symbolic batch sizes")
        else:
            scores.masks.append(_mask_for_flat_scores(mask, scores, matmul.out))


def _bias_as_scores_mask(bias: fx.Node, matmul: BatchedMatmul) -> Optional[fx.Node]:
    """The [N|1, M|1, K|1] bias of the product as a mask of its logical [.., M, K] output (a view)."""
    bias_shape, out_shape = tensor_val(bias).shape, tensor_val(matmul.out).shape
    if matmul.batch_rank == 1 and len(bias_shape) == 3:
        return bias
    if len(bias_shape) < 3 or same_size(bias_shape[-3], 1):
        size = [1] * (len(out_shape) - 2) + list(bias_shape[-2:])
    elif all(isinstance(d, int) for d in out_shape[:-2]):
        size = list(out_shape[:-2]) + list(bias_shape[-2:])
    else:
        return None
    user = matmul.out
    with user.graph.inserting_before(user):
        view = insert_call(user.graph, torch.ops.aten.view.default, (bias, size))
    _tag_like(user, [view])
    return view


def _scaled_mask(mask: fx.Node, alpha, add: fx.Node) -> fx.Node:
    with add.graph.inserting_before(add):
        scaled = insert_call(add.graph, torch.ops.aten.mul.Tensor, (mask, alpha))
    _tag_like(add, [scaled])
    return scaled


def _mask_under_later_factors(mask: fx.Node, factors: list, add: fx.Node) -> fx.Node:
    """CodeGen's ``(s + mask) / c`` is ``s / c + mask / c``: the mask as the numbers ``factors`` met below
    its add leave it, in the add's dtype (eager promotes the mask before scaling). A mask built as
    ``where(cond, a, b)`` from constants stays one, with ``a`` and ``b`` scaled (its structure stays
    provable); any other mask is scaled in the graph."""
    dtype, graph = _dtype(add), add.graph

    def scaled(value):
        for factor, divide in factors:
            value = value / factor if divide else value * factor
        return value

    new = []
    with graph.inserting_before(add):
        source, casts = strip_value_preserving(mask)
        is_where = ops.calls(source, *ops.WHERE)
        branches = [constant_after_casts(ops.arg(source, b), casts) for b in ("self", "other")] if is_where else []
        if is_where and None not in branches:
            fills = [scaled(torch.tensor(b, dtype=dtype)).item() for b in branches]
            new += [insert_call(graph, torch.ops.aten.scalar_tensor.default, (f,), {"dtype": dtype}) for f in fills]
            new.append(insert_call(graph, torch.ops.aten.where.self, (ops.arg(source, "condition"), *new)))
        else:
            if _dtype(mask) != dtype:
                new.append(insert_call(graph, torch.ops.prims.convert_element_type.default, (mask, dtype)))
            for factor, divide in factors:
                target = torch.ops.aten.div.Tensor if divide else torch.ops.aten.mul.Tensor
                new.append(insert_call(graph, target, (new[-1] if new else mask, factor)))
    _tag_like(add, new)
    return new[-1]


def _fill_value(arg, where: fx.Node) -> Optional[float]:
    """The constant a where() branch puts into the scores, as the where's dtype holds it; None if not constant."""
    if isinstance(arg, fx.Node):
        if ops.calls(arg, *ops.FILL):
            value = ops.arguments(arg).get("fill_value", ops.arguments(arg).get("s"))
        elif tensor_val(arg) is not None and tensor_val(arg).dim() == 0:
            value = constant_value(arg)  # e.g. GPT-Neo's torch.tensor(finfo.min), a lifted graph constant
        else:
            return None
        if not _is_number(value):
            return None  # a symbolic fill
        value = torch.tensor(value, dtype=_dtype(arg)).item()
    elif _is_number(arg):
        value = arg
    else:
        return None
    return torch.tensor(value, dtype=_dtype(where)).item()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _where_mask(scores: _Scores, where: fx.Node) -> Optional[fx.Node]:
    """``where(visible, s, fill)`` / ``where(blocked, fill, s)``: a -inf fill is a boolean mask; a fill that
    float32 addition absorbs every score into is an additive mask (in inference graphs); other fills refuse."""
    condition, if_true, if_false = (ops.arg(where, n) for n in ("condition", "self", "other"))
    true_fill, false_fill = _fill_value(if_true, where), _fill_value(if_false, where)
    if false_fill is not None and isinstance(if_true, fx.Node) and _reaches_matmul(if_true):
        x, fill, negated = if_true, false_fill, False
    elif true_fill is not None and isinstance(if_false, fx.Node) and _reaches_matmul(if_false):
        x, fill, negated = if_false, true_fill, True
    else:
        scores.refused = Refused(Refusal.SCORE_TRANSFORM, "where() without a constant fill")
        return None
    if _reaches_matmul(condition):
        scores.refused = Refused(Refusal.SCORE_TRANSFORM, "a mask computed from the scores")
    elif scores.clamped and not math.isfinite(fill):
        scores.refused = _clamp_over_infinities()
    elif scores.factors:
        scores.refused = Refused(Refusal.SCALE_AFTER_MASK)
    elif (fill <= _ABSORBING_FILL and _zeroes_masked_probs(scores, condition, negated, fill)) or fill == float("-inf"):
        _add_bool_mask(scores, condition, negated, where)
    elif not (_FLOAT32_MIN <= fill <= _ABSORBING_FILL):
        scores.refused = Refused(Refusal.FINITE_FILL_VALUE, f"fill {fill!r}: only fills <= -2**127 add exactly")
    elif scores.rounded_to:
        scores.refused = Refused(Refusal.FINITE_FILL_VALUE, f"fill {fill!r} rounded to {sorted(map(str, scores.rounded_to))}")
    elif is_joint_graph(where.graph):  # s + fill passes gradients to a fully masked row's scores; where() does not
        scores.refused = Refused(Refusal.FINITE_FILL_VALUE, f"fill {fill!r} in a training graph")
    else:
        _bool_mask_as_additive(scores)
        scores.masks.append(_mask_for_flat_scores(_fill_as_additive(where, condition, fill, negated), scores, where))
    return x


def _zeroes_masked_probs(scores: _Scores, condition: fx.Node, negated: bool, fill: float) -> bool:
    """The probabilities are zeroed exactly where this mask (with a fill <= -2**127) hides keys (DeBERTa's
    XSoftmax, Conformer's ``masked_fill(mask, 0)`` after the softmax): the fill then gives what -inf gives
    with empty rows of zeros. A row with a visible key already has probability 0 (exp underflows) where
    the fill is; a row with none has a uniform softmax, which the zeroing turns into zeros. Marks the
    zeroing as accounted for (``_zeroing_refusal`` checks the other masks)."""
    if scores.zeroed is None or scores.zeroed_fill is not None:
        return False
    zeroed, zeroed_where_true = without_negations(*scores.zeroed)
    condition, negated = without_negations(condition, negated)
    if zeroed_where_true != negated or not same_computation(zeroed, condition):
        return False
    scores.zeroed_fill = fill
    return True


def _zeroing_refusal(scores: _Scores) -> Optional[Refused]:
    """Why zeroing the probabilities is not what the op's empty rows give (None when it is)."""
    if scores.zeroed_fill is None:
        return Refused(Refusal.PROBS_MODIFIED, "zeroed where no mask of the scores hides keys")
    # A finite fill hides a key only next to a visible score far above it: other masks could bring every
    # visible score of a row down to it (e.g. a finfo.min padding mask). Terms from products cannot.
    if math.isfinite(scores.zeroed_fill) and len(scores.masks) > 1 + scores.product_terms:
        return Refused(Refusal.PROBS_MODIFIED, f"zeroed where a fill of {scores.zeroed_fill!r} hides keys, "
                                               "beside other masks")
    return None


def _add_bool_mask(scores: _Scores, condition: fx.Node, negated: bool, where: fx.Node) -> None:
    """A -inf fill: the condition as a bool mask, or an additive -inf one beside other masks."""
    if scores.masks:
        additive = _fill_as_additive(where, condition, float("-inf"), negated)
        scores.masks.append(_mask_for_flat_scores(additive, scores, where))
    else:
        scores.masks.append(_mask_for_flat_scores(condition, scores, where))
        scores.mask_negated, scores.bool_mask_where = negated, where


def _bool_mask_as_additive(scores: _Scores) -> None:
    """Another mask joins a bool one: the bool one becomes ``where(visible, 0, -inf)`` (an exact sum)."""
    if scores.masks and _is_bool(scores.masks[0]):
        scores.masks[0] = _fill_as_additive(scores.bool_mask_where, scores.masks[0], float("-inf"), scores.mask_negated)
        scores.mask_negated = False


def _fill_as_additive(where: fx.Node, condition: fx.Node, fill: float, negated: bool) -> fx.Node:
    """``where(condition, 0, fill)`` (or the reverse): the fill as an additive mask in the where's dtype."""
    dtype = _dtype(where) if _dtype(where) in (torch.float32, torch.bfloat16) else torch.float32
    graph = where.graph
    with graph.inserting_before(where):
        zero, blocked = (insert_call(graph, torch.ops.aten.scalar_tensor.default, (value,), {"dtype": dtype})
                         for value in (0.0, fill))
        branches = (blocked, zero) if negated else (zero, blocked)
        mask = insert_call(graph, torch.ops.aten.where.self, (condition, *branches))
    _tag_like(where, (zero, blocked, mask))
    return mask


def _merges_heads(node: fx.Node) -> bool:
    """A view of [B, H, M, K] scores as [B*H, M, K] (masks were added to a 4-D view of 3-D scores)."""
    if not ops.calls(node, *ops.VIEW):
        return False
    src, dst = tensor_val(node.args[0]).shape, tensor_val(node).shape
    return len(src) == 4 and len(dst) == 3 and same_shape([src[0] * src[1], src[2], src[3]], dst)


def _splits_heads(node: fx.Node, merged_shape: tuple) -> bool:
    """The view of [B*H, M, K] scores as the [B, H, M, K] that ``_merges_heads`` merged again."""
    if not ops.calls(node, *ops.VIEW):
        return False
    src, dst = tensor_val(node.args[0]).shape, tensor_val(node).shape
    return len(src) == 3 and same_shape(dst, merged_shape)


def _mask_for_flat_scores(mask: fx.Node, scores: _Scores, user: fx.Node) -> fx.Node:
    """A mask of ``user``; one applied to a [B, H, M, K] view of the scores is flattened when the walk
    reaches the view that splits [B*H, M, K] (``_flatten_masks``)."""
    if scores.merged_heads is not None:
        scores.unflattened.append((len(scores.masks), user))
    return mask


def _flatten_masks(scores: _Scores, split: fx.Node) -> None:
    heads = _heads_sizes(split)
    if heads is None and scores.unflattened:
        scores.refused = Refused(Refusal.UNRECOGNISED_LAYOUT, "a mask on a [B, H, M, K] view with a symbolic -1 size")
        return
    for index, user in scores.unflattened:
        scores.masks[index] = _flat_mask(scores.masks[index], heads, user)
    scores.unflattened = []


def _flat_mask(mask: fx.Node, heads: list, user: fx.Node) -> fx.Node:
    """A mask broadcast to [B, H, M, K] scores (``heads`` = [B, H]), as one for the [B*H, M, K] scores."""
    graph, aten = user.graph, torch.ops.aten
    new = []
    with graph.inserting_before(user):
        while tensor_val(new[-1] if new else mask).dim() < 4:
            new.append(insert_call(graph, aten.unsqueeze.default, (new[-1] if new else mask, 0)))
        mask4 = new[-1] if new else mask
        if all(same_size(s, 1) for s in tensor_val(mask4).shape[:2]):  # broadcast over batch and heads: a view
            new.append(insert_call(graph, aten.squeeze.dims, (mask4, [0, 1])))
        else:  # one mask row per (batch, head): a copy
            rows = [_size(graph, mask4, d, new) for d in (2, 3)]
            new.append(insert_call(graph, aten.expand.default, (mask4, [*heads, -1, -1])))
            new.append(insert_call(graph, aten.clone.default, (new[-1],), {"memory_format": torch.contiguous_format}))
            new.append(insert_call(graph, aten.view.default, (new[-1], [-1, *rows])))
    _tag_like(user, new)
    return new[-1]


def _heads_sizes(split: fx.Node) -> Optional[list]:
    """B and H as the split view's own size arguments (ints or symbolic-size nodes the graph has already:
    a size read off the scores themselves would make them look used outside the site)."""
    sizes = list(ops.arg(split, "size")[:2])
    shape = tensor_val(split).shape
    sizes = [shape[d] if isinstance(a, int) and a < 0 else a for d, a in enumerate(sizes)]
    return sizes if all(isinstance(a, fx.Node) or (isinstance(a, int) and a >= 0) for a in sizes) else None


def _size(graph: fx.Graph, node: fx.Node, dim: int, new: list):
    """A size of ``node`` as a graph argument: the int, or a sym_size node for a symbolic one."""
    size = tensor_val(node).shape[dim]
    if isinstance(size, int):
        return size
    new.append(insert_call(graph, torch.ops.aten.sym_size.int, (node, dim)))
    return new[-1]


def _tag_like(node: fx.Node, new_nodes) -> None:
    """New forward nodes carry the partitioner's tag of the node they serve (joint graphs need it)."""
    if "partitioner_tag" in node.meta:
        for new in new_nodes:
            new.meta.setdefault("partitioner_tag", node.meta["partitioner_tag"])


def _peel_operand(operand: Operand):
    """(source, dims, factors): walks through scalar scaling and more views on a matmul operand."""
    node, dims, factors = operand.source, list(operand.dims), list(operand.factors)
    while True:
        scaled = _scale_factor(node) if len(forward_users(node)) <= 1 else None  # a shared node is the input
        if scaled is None:
            return node, dims, factors
        factors.append(scaled[1:])
        source, source_dims = strip_views(scaled[0], keep_shared=True)
        dims = [source_dims[d] for d in dims]
        if None in dims:
            return None
        node = source


@dataclass
class _Probs:
    bmm: Optional[fx.Node] = None  # the P @ V matmul
    chain: list = field(default_factory=list)  # the probabilities, cast or copied but in their own shape
    rounded_to: set = field(default_factory=set)
    zeroed: Optional[tuple] = None  # (condition, zeroed where True) of a where() that zeroes some probabilities
    refused: Optional[Refused] = None


def _walk_down_probs(softmax: Softmax) -> Optional[_Probs]:
    """The P @ V matmul below a softmax, or why the probabilities do not reach one as they are; None
    when the softmax output is not used at all."""
    node, probs = softmax.output, _Probs(chain=[softmax.output])
    for _ in range(16):
        users = forward_users(node)
        if len(users) != 1:
            if not users:
                return None if node is softmax.output else _unrecognised_probs(f"{node.target} has no user")
            readers = sorted({"the graph's output" if u.op == "output" else str(u.target) for u in users})
            return _Probs(refused=Refused(Refusal.PROBS_USED_ELSEWHERE, "read by " + ", ".join(readers)))
        user = users[0]
        if is_batched_product(user):
            probs.bmm = user
            return probs if user.args[0] is node else _unrecognised_probs("P is the right operand of its matmul")
        if ops.calls(user, *ops.CAST):
            _judge_cast(probs, _dtype(node), _dtype(user), "on the probabilities")
        elif probs.zeroed is None and _zeroing(user, node) is not None:
            probs.zeroed = _zeroing(user, node)
        elif not (_zeroes_empty_rows(user, node, softmax) or ops.calls(user, *_PROBS_LAYOUT)):
            if _reaches_bmm(user):
                return _modified_probs(user, node, softmax)
            return _unrecognised_probs(f"they go to {user.target}")
        if probs.refused:
            return probs
        if probs.chain[-1] is node and same_shape(tensor_val(user).shape, tensor_val(softmax.output).shape):
            probs.chain.append(user)  # views that reshape P can only be the matmul's own batching (_anchor_for)
        elif undoes_a_view(user) and user.args[0].args[0] is probs.chain[-1]:
            probs.chain.append(user)  # XGLM: P viewed as [B, H, M, K] and back
        node = user
    return _unrecognised_probs("no matmul within 16 ops")


def _zeroing(node: fx.Node, probs: fx.Node) -> Optional[tuple]:
    """(condition, zeroed where True) for ``where(c, 0, probs)`` or ``where(c, probs, 0)`` with a bool c not
    computed from the scores that keeps the probabilities' shape and dtype; None for anything else."""
    if not ops.calls(node, *ops.WHERE):
        return None
    condition, if_true, if_false = (ops.arg(node, n) for n in ("condition", "self", "other"))
    if if_false is probs and _fill_value(if_true, node) == 0:
        zeroed_where_true = True
    elif if_true is probs and _fill_value(if_false, node) == 0:
        zeroed_where_true = False
    else:
        return None
    if not _is_bool(condition) or _reaches_matmul(condition) or _dtype(node) != _dtype(probs):
        return None
    if not same_shape(tensor_val(node).shape, tensor_val(probs).shape):
        return None
    return condition, zeroed_where_true


def _unrecognised_probs(detail: str) -> _Probs:
    return _Probs(refused=Refused(Refusal.UNRECOGNISED_PROBS, detail))


def _modified_probs(user: fx.Node, probs: fx.Node, softmax: Softmax) -> _Probs:
    if getattr(user.target, "overloadpacket", None) is torch.ops.aten.mul:
        if any(_is_random(a) for a in user.all_input_nodes if a is not probs):
            return _Probs(refused=Refused(Refusal.DROPOUT_ACTIVE))
    sinks = _sink_logits(softmax)
    if sinks is not None:
        return _Probs(refused=Refused(Refusal.ATTENTION_SINKS, sinks))
    return _Probs(refused=Refused(Refusal.PROBS_MODIFIED, ops.unaccepted_use(user) or str(user.target)))


def _softmax_with_sinks(softmax: Softmax) -> Optional[tuple[Softmax, fx.Node]]:
    """gpt-oss's attention sinks, as the op takes them: ``softmax(cat([scores, sinks], -1) [- its row max])``
    with only its first K columns read (``[..., :K]``), and sinks ``[Hq]`` broadcast as ``[B, Hq, M, 1]``.
    Returns the softmax seen as one over ``scores`` ending at that slice, and the ``[Hq]`` sinks; else None."""
    x, dim = softmax.input, softmax.dim
    if ops.calls(x, *ops.SUB) and _is_row_max_of(x.args[1], x.args[0], dim):
        x = x.args[0]
    if not (is_op(x, torch.ops.aten.cat) and len(x.args[0]) == 2 and len(x.all_input_nodes) == 2):
        return None
    if (x.args[1] if len(x.args) > 1 else 0) % tensor_val(x).dim() != dim or dim != tensor_val(x).dim() - 1:
        return None
    scores, sink_part = x.args[0]
    keys = tensor_val(scores).shape[-1]
    users = forward_users(softmax.output)
    if len(users) != 1 or not _first_columns(users[0], keys, dim) or tensor_val(x).dim() != 4:
        return None
    sinks = _per_head_logits(sink_part, tensor_val(scores).shape[1])
    if sinks is None:
        return None
    return Softmax(scores, users[0], dim, set(softmax.rounded_to), softmax.refused), sinks


def _without_row_max(softmax: Softmax) -> Softmax:
    """``softmax(x - max(x, dim))`` is ``softmax(x)`` (MiMo subtracts the row max itself): the softmax
    subtracts its row max, 0 here, so both compute exp of the same rounded ``x - max(x)``."""
    x = softmax.input
    if ops.calls(x, *ops.SUB) and _is_row_max_of(x.args[1], x.args[0], softmax.dim):
        return Softmax(x.args[0], softmax.output, softmax.dim, set(softmax.rounded_to), softmax.refused)
    return softmax


def _is_row_max_of(node, x: fx.Node, dim: int) -> bool:
    """``max(x, dim, keepdim=True).values`` or ``amax(x, [dim], keepdim=True)``."""
    if ops.calls(node, *ops.AMAX):
        return node.args[0] is x and [d % tensor_val(x).dim() for d in ops.arg(node, "dim")] == [dim] \
            and ops.arg(node, "keepdim")
    if node.target is operator.getitem and node.args[1] == 0 and is_op(node.args[0], torch.ops.aten.max):
        reduce = node.args[0]
        return reduce.target is torch.ops.aten.max.dim and reduce.args[0] is x and \
            reduce.args[1] % tensor_val(x).dim() == dim and len(reduce.args) > 2 and reduce.args[2] is True
    return False


def _first_columns(node: fx.Node, count, dim: int) -> bool:
    """``node`` is ``x[..., :count]`` along ``dim`` (a slice from 0, step 1, ending at count or -1 of count + 1)."""
    if node.target is not torch.ops.aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    slice_dim, start, step = args[1] or 0, args[2] or 0, args[4] or 1  # the end: the output's size says it
    rank = tensor_val(node.args[0]).dim()
    return slice_dim % rank == dim and start == 0 and step == 1 and same_size(tensor_val(node).shape[dim], count)


def _per_head_logits(node: fx.Node, heads) -> Optional[fx.Node]:
    """The ``[H]`` tensor that ``node`` broadcasts as ``[B, H, M, 1]`` (through view and expand); else None."""
    if not is_op(node, torch.ops.aten.expand):
        return None
    source = node.args[0]
    if is_op(source, torch.ops.aten.view, torch.ops.aten.reshape, torch.ops.aten._unsafe_view):
        source = source.args[0]
    value, broadcast = tensor_val(source), tensor_val(node.args[0])
    if value is None or value.dim() != 1 or not same_size(value.shape[0], heads):
        return None
    if broadcast.dim() != 4 or not same_shape(broadcast.shape, [1, heads, 1, 1]) or not value.dtype.is_floating_point:
        return None
    return source


def _sink_logits(softmax: Softmax) -> Optional[str]:
    """gpt-oss's sinks: the softmax runs over ``cat([scores, sinks], -1)`` (its max subtracted first, maybe),
    and P @ V reads the scores' part back; a description of the cat, or None."""
    x = softmax.input
    for _ in range(4):
        if is_op(x, torch.ops.aten.cat):
            parts = x.args[0]
            dim = (x.args[1] if len(x.args) > 1 else 0) % tensor_val(x).dim()
            if dim == softmax.dim and len(parts) == 2 and _reaches_matmul(parts[0]) and not _reaches_matmul(parts[1]):
                return f"{tensor_val(parts[1]).shape[-1]} sink logit(s) concatenated to the keys' scores"
            return None
        if not (ops.calls(x, *ops.CAST) or ops.calls(x, *ops.SUB)):
            return None
        x = x.args[0]
    return None


def _reaches_bmm(node: fx.Node, steps: int = 8) -> bool:
    for _ in range(steps):
        users = forward_users(node)
        if any(is_batched_product(u) for u in users):
            return True
        if len(users) != 1:
            return False
        node = users[0]
    return False


def _zeroes_empty_rows(node: fx.Node, probs: fx.Node, softmax: Softmax) -> bool:
    """SDPA's safe softmax: ``where(row_fully_masked(scores), 0, probs)``: rows with no visible key give 0,
    as the op does. The condition must be exactly "every score of the row is -inf" over the softmax dim."""
    if not (ops.calls(node, *ops.WHERE) and ops.arg(node, "other") is probs):
        return False
    zero = ops.arg(node, "self")
    if _fill_value(zero, node) != 0:
        return False
    return _all_minus_infinity(ops.arg(node, "condition"), softmax)


def _all_minus_infinity(condition, softmax: Softmax) -> bool:
    """``all(x == -inf, dim, keepdim)`` or ``not any(not (x == -inf), dim, keepdim)`` with x the scores."""
    if ops.calls(condition, *ops.ALL):
        reduced, is_minus_inf = condition, condition.args[0]
    elif ops.calls(condition, *ops.NOT) and ops.calls(condition.args[0], *ops.ANY):
        reduced = condition.args[0]
        if not ops.calls(reduced.args[0], *ops.NOT):
            return False
        is_minus_inf = reduced.args[0].args[0]
    else:
        return False
    rank = tensor_val(softmax.input).dim()
    if ops.arg(reduced, "dim") % rank != softmax.dim:
        return False
    if not (ops.calls(is_minus_inf, *ops.EQ) and ops.arg(is_minus_inf, "other") == float("-inf")):
        return False
    scores = is_minus_inf.args[0]
    x = softmax.input
    while x is not scores and ops.calls(x, *ops.CAST) and ops.widens(_dtype(x.args[0]), _dtype(x)):
        x = x.args[0]  # widening keeps -inf: the test may read the scores before the upcast
    return x is scores


def _is_random(node, depth: int = 4) -> bool:
    if not isinstance(node, fx.Node) or depth == 0:
        return False
    name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
    return name in _RANDOM_OP_NAMES or any(_is_random(a, depth - 1) for a in node.all_input_nodes)


def _anchor_for(bmm: fx.Node, probs_chain: list) -> Optional[BatchedMatmul]:
    """P @ V in its logical layout: the outermost of bmm itself, its batch-split view, einsum's re-layout
    whose left operand is the probabilities as the softmax gave them (XGLM's P, viewed as [B, H, M, K] and
    back, is only so for the 3-D product); failing one on the probabilities, a permutation of the split
    (einsum's ``bnij,bjnd->bind`` output)."""
    first = None
    for permuted_out in (False, True):
        node, found, found_on_probs = bmm, None, None
        for _ in range(6):
            for matmul in batched_matmul_readings(node, permuted_out=permuted_out):
                if matmul.bmm is bmm:
                    found = found if found and found.out is node else matmul  # the first reading of the outermost
                    if matmul.lhs.source in probs_chain:
                        found_on_probs = matmul
            users = list(node.users)
            if len(users) != 1 or not ops.calls(users[0], *ops.VIEW, *ops.PERMUTE):
                break
            node = users[0]
        if found_on_probs:
            return found_on_probs
        first = first or found
    return first


def attention_shaped(softmax: Softmax) -> bool:
    """A matmul feeds the softmax and its output feeds another matmul (whatever the softmax dim)."""
    probs = _walk_down_probs(softmax)
    return _reaches_matmul(softmax.input) and probs is not None and probs.bmm is not None


# Ops whose output is no score of an attention: a linear layer (a router's or classifier's logits).
_LINEAR_OPS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.linear)
# Batched products of two tensors, i.e. what q @ kᵀ (matmul, einsum, bmm, baddbmm) becomes in ATen.
_BATCHED_PRODUCTS = (torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.matmul, torch.ops.aten.einsum)
_SCORES_SEARCH_NODES = 256  # Longformer's sliding chunks put ~100 ops between its bmm and softmax


def scores_product(x: fx.Node) -> tuple[Optional[fx.Node], list]:
    """(product, ops): the batched product above a softmax input, through any ops but linear layers, and
    the ops on the way the attention table does not know; (None, ...) when there is none near: the softmax
    is then over something else than scores (a router, a classifier)."""
    seen, frontier, unknown = set(), [x], {}
    while frontier and len(seen) < _SCORES_SEARCH_NODES:
        node = frontier.pop(0)
        if node in seen or not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        seen.add(node)
        if is_op(node, *_BATCHED_PRODUCTS):
            return node, list(unknown)
        if not is_op(node, *_LINEAR_OPS):
            frontier.extend(node.all_input_nodes)
            if node.target not in ops.TABLE:
                unknown.setdefault(str(node.target), None)
    return None, []


def _keys_part(softmax: Softmax) -> tuple[Softmax, Optional[fx.Node]]:
    """(the softmax over the keys' scores alone, the sink logits that join it or None)."""
    with_sinks = _softmax_with_sinks(softmax)
    return with_sinks if with_sinks is not None else (_without_row_max(softmax), None)


def not_over_scores(softmax: Softmax) -> Optional[str]:
    """Why a used softmax is over no q·kᵀ scores: no product of two tensors computes its input (a
    router, a classifier, pooling weights from a linear layer or a convolution). None for every other."""
    softmax = _keys_part(softmax)[0]
    if scores_product(softmax.input)[0] is not None or not forward_users(softmax.output):
        return None
    nearest = [n for n in _ancestors(softmax.input, _SCORES_SEARCH_NODES)
               if is_op(n, *_LINEAR_OPS, torch.ops.aten.convolution)]
    made_by = f" (it comes from {nearest[0].target})" if nearest else ""
    return "its input is computed by no product of two tensors" + made_by


def _ancestors(x: fx.Node, limit: int) -> list:
    """The call nodes ``x`` is computed from (itself first), nearest first, at most ``limit``."""
    seen, frontier = [], [x]
    while frontier and len(seen) < limit:
        node = frontier.pop(0)
        if isinstance(node, fx.Node) and node.op == "call_function" and node not in seen:
            seen.append(node)
            frontier.extend(node.all_input_nodes)
    return seen


def match_softmax_attention(softmax: Softmax) -> Optional[AttentionSite]:
    """An AttentionSite (possibly refused) for a softmax over scores; None for any other softmax."""
    softmax, sinks = _keys_part(softmax)
    product, unknown_ops = scores_product(softmax.input)
    probs = _walk_down_probs(softmax)
    if product is None or probs is None:
        return None
    if not _reaches_matmul(softmax.input):
        site = AttentionSite("matmul_softmax", softmax.output)
        through = ", ".join(unknown_ops[:4]) + (", ..." if len(unknown_ops) > 4 else "")
        return site.refuse(Refusal.UNRECOGNISED_SCORES, f"scores from {product.target}" + (f" through {through}" if through else ""))
    if probs.refused:
        return AttentionSite("matmul_softmax", softmax.output).refuse_as(probs.refused)
    pv = _anchor_for(probs.bmm, probs.chain)
    site = AttentionSite("matmul_softmax", pv.out if pv else probs.bmm)
    if softmax.refused:
        return site.refuse_as(softmax.refused)
    if softmax.dim != tensor_val(softmax.input).dim() - 1:
        return site.refuse(Refusal.SOFTMAX_NOT_LAST_DIM)
    if pv is None or pv.lhs.source not in probs.chain or pv.lhs.dims != list(range(pv.batch_rank + 2)):
        return site.refuse(Refusal.UNRECOGNISED_LAYOUT, _pv_layout_detail(pv, probs))
    scores = _walk_up_scores(softmax, probs.zeroed)
    if scores is None:
        return site.refuse(Refusal.UNRECOGNISED_SCORES)
    if scores.refused:
        return site.refuse_as(scores.refused)
    if probs.zeroed is not None and _zeroing_refusal(scores):
        return site.refuse_as(_zeroing_refusal(scores))
    scores.matmul = _reading_of_rank(scores.matmul, pv.batch_rank)
    if scores.matmul.batch_rank != pv.batch_rank:
        return site.refuse(Refusal.UNRECOGNISED_LAYOUT, "rank")
    q_side, k_side = _peel_operand(scores.matmul.lhs), _peel_operand(scores.matmul.rhs)
    if q_side is None or k_side is None:
        return site.refuse(Refusal.UNRECOGNISED_LAYOUT, "q/k views")
    q, q_dims, q_factors = q_side
    k, kt_dims, k_factors = k_side
    v, v_dims = pv.rhs.source, pv.rhs.dims
    # Each operand is a permuted view of its source (views.Operand): that permutation is its layout.
    k_dims = [*kt_dims[:-2], kt_dims[-1], kt_dims[-2]]
    layouts = {"q": tuple(q_dims), "k": tuple(k_dims), "v": tuple(v_dims), "out": pv.out_layout or tuple(range(pv.batch_rank + 2))}
    if any(tensor_val(node).dim() != len(layouts[name]) for name, node in (("q", q), ("k", k), ("v", v))):
        return site.refuse(Refusal.UNRECOGNISED_LAYOUT, "q, k or v seen through a view that drops a size-1 dim")
    if tensor_val(site.anchor).dim() != len(layouts["out"]):
        return site.refuse(Refusal.UNRECOGNISED_LAYOUT, "the output viewed with another rank than P @ V's")
    site.q, site.k, site.v, site.layouts = q, k, v, layouts
    _record_scale(site, scores.factors, q_factors, k_factors)
    site.mask = scores.masks[0] if scores.masks else None
    site.extra_masks, site.mask_negated = scores.masks[1:], scores.mask_negated
    site.softcap = scores.softcap
    site.sinks = sinks
    if sinks is None:
        _take_sink_gate(site, softmax)
    if site.sinks is not None and layouts["q"] == FLAT:
        return site.refuse(Refusal.UNRECOGNISED_LAYOUT, "sinks over scores with batch and heads merged")
    _map_repeated_kv(site)
    if _upcast(softmax):
        site.notes.append("float32 softmax")
    run_in_input_precision(site)
    refused = chain_rounding_refusal(site, scores.rounded_to | probs.rounded_to)
    return site.refuse_as(refused) if refused else site


def _pv_layout_detail(pv: Optional[BatchedMatmul], probs: _Probs) -> str:
    if pv is not None and pv.lhs.source in probs.chain:
        return "P @ V reads the probabilities with their dims in another order (e.g. transposed)"
    if pv is not None and strip_views(pv.lhs.source)[0] in probs.chain:
        return "P @ V: its matmul reads the probabilities through views the layout map does not follow"
    return "P @ V"


def _take_sink_gate(site: AttentionSite, softmax: Softmax) -> None:
    """Granite SWA's ``(P @ V) * sigmoid(lse - sinks)``: the site's output is the gated one, with sinks."""
    gate = sink_gate(softmax.input, softmax.dim, site.anchor)
    if gate is not None:
        site.anchor, site.sinks = gate
        site.notes.append("sinks as an output gate")


def _reading_of_rank(matmul: BatchedMatmul, batch_rank: int) -> BatchedMatmul:
    """q @ kᵀ read with P @ V's batch rank where both readings hold (one head: see batched_matmul_readings);
    a product with a bias keeps the reading its mask was built for."""
    if matmul.batch_rank == batch_rank or matmul.bias is not None:
        return matmul
    same = [r for r in batched_matmul_readings(matmul.out) if r.bmm is matmul.bmm and r.batch_rank == batch_rank]
    return same[0] if same else matmul


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
    return (ops.calls(x, *ops.CAST) and _dtype(x.args[0]) != _dtype(x)) or _dtype(softmax.output) != _dtype(x)
