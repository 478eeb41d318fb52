"""Seeing through layout-only ops: which dims of a source tensor a viewed tensor shows, and batched matmuls.

After AOTAutograd, ``q @ k.mT`` (4-D), ``torch.bmm`` on ``[B*H, S, D]`` and ``einsum`` all become an
``aten.bmm`` surrounded by expand/view/permute/unsqueeze. These helpers undo that wrapping so the
matcher can reason about logical ``[..., M, K] @ [..., K, N]`` products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx

from . import op_table as ops
from .fx_utils import forward_users, same_shape, same_size, tensor_val


def _is_identity(node: fx.Node) -> bool:
    if ops.calls(node, *ops.IDENTITY):
        return True
    if ops.calls(node, *ops.CAST):
        return tensor_val(node.args[0]).dtype == ops.arg(node, "dtype")
    if ops.calls(node, *ops.EXPAND, *ops.VIEW):
        return same_shape(tensor_val(node.args[0]).shape, tensor_val(node).shape)
    return False


def _through_identities(node: fx.Node) -> fx.Node:
    while _is_identity(node):
        node = node.args[0]
    return node


def _non_unit(shape) -> list[int]:
    return [i for i, s in enumerate(shape) if not same_size(s, 1)]


def _is_unit_view(node: fx.Node) -> bool:
    """A view that only inserts or removes size-1 dims."""
    if not ops.calls(node, *ops.VIEW, *ops.SQUEEZE):
        return False
    src, dst = tensor_val(node.args[0]).shape, tensor_val(node).shape
    a, b = [src[i] for i in _non_unit(src)], [dst[i] for i in _non_unit(dst)]
    return same_shape(a, b)


def undoes_a_view(node: fx.Node) -> bool:
    """``view(view(x, s), x.shape)``: x's own values (functionalised in-place ops on a view leave these)."""
    if not (ops.calls(node, *ops.VIEW) and ops.calls(node.args[0], *ops.VIEW)):
        return False
    return same_shape(tensor_val(node.args[0].args[0]).shape, tensor_val(node).shape)


def strip_views(node: fx.Node, unit_views: bool = True, keep_shared: bool = False,
                source_rank: Optional[int] = None) -> tuple[fx.Node, list[Optional[int]]]:
    """(source, dims): ``node`` shows ``source`` through permutes and (if ``unit_views``) size-1 dims.

    ``dims[i]`` is the source dim that ``node``'s dim i shows, or None for an inserted size-1 dim.
    With ``keep_shared``, a view that other ops read too is the source (its gradient is not only ours).
    With ``source_rank``, a size-1 view whose input leads to a source of another rank is the source
    (XLNet's v: a [I, B, N, D] view of einsum's [I, B, 1, N, D] product).
    """
    if not isinstance(node, fx.Node) or tensor_val(node) is None:
        return node, []

    def through(view_input: fx.Node):
        if keep_shared and len(forward_users(view_input)) > 1:
            return view_input, list(range(tensor_val(view_input).dim()))
        return strip_views(view_input, unit_views, keep_shared, source_rank)

    def through_unit_view(view_input: fx.Node):
        source, dims = through(view_input)
        if source_rank is not None and tensor_val(source).dim() != source_rank:
            return None
        return source, dims

    if _is_identity(node):
        return through(node.args[0])
    if undoes_a_view(node):
        return through(node.args[0].args[0])
    if ops.calls(node, *ops.PERMUTE):
        source, dims = through(node.args[0])
        return source, [dims[i] for i in ops.arg(node, "dims")]
    found = through_unit_view(node.args[0]) if unit_views and ops.calls(node, *ops.UNSQUEEZE) else None
    if found:
        source, dims = found
        at = ops.arg(node, "dim") % (len(dims) + 1)
        return source, dims[:at] + [None] + dims[at:]
    found = through_unit_view(node.args[0]) if unit_views and _is_unit_view(node) else None
    if found:
        source, dims = found
        src_shape = tensor_val(node.args[0]).shape
        kept = iter([dims[i] for i in _non_unit(src_shape)])
        return source, [None if same_size(s, 1) else next(kept) for s in tensor_val(node).shape]
    return node, list(range(tensor_val(node).dim()))


def _product(sizes):
    return math.prod(sizes) if sizes else 1


def _merged_batch_source(node: fx.Node, rank: int) -> Optional[tuple[fx.Node, list[int]]]:
    """(source, kept): a ``[N, M, K]`` bmm operand view that flattens the leading dims of ``source``.

    ``kept`` lists the source dims forming (batch..., M, K); other source dims have size 1.
    """
    if not ops.calls(node, *ops.VIEW):
        return None
    source = node.args[0]
    src, dst = tensor_val(source).shape, tensor_val(node).shape
    kept = list(range(len(src))) if len(src) == rank else _non_unit(src)
    if len(kept) != rank:
        return None
    sizes = [src[i] for i in kept]
    if not same_shape(sizes[-2:], dst[-2:]) or not same_size(_product(sizes[:-2]), dst[0]):
        return None
    return source, kept


@dataclass
class Operand:
    """A bmm operand seen as ``source.permute(dims)``: dims lists the source dim for (batch..., row, col)."""

    source: fx.Node
    dims: list[int]
    factors: list = field(default_factory=list)  # (factor, divide): scalar scales met on the [N, M, K] operand
    units: tuple = ()  # batch positions of size-1 source dims the product's batch has not (see _beside_unit_dims)


@dataclass
class BatchedMatmul:
    """``out = lhs @ rhs`` over ``batch_rank`` leading dims; ``bmm`` is the ATen node doing it.

    A ``baddbmm`` (only where ``with_bias`` was asked) computes ``beta * bias + alpha * (lhs @ rhs)``
    with ``bias`` in its own [N, M, K] (broadcastable) layout; a bmm has no bias."""

    bmm: fx.Node
    out: fx.Node
    lhs: Operand
    rhs: Operand
    batch_rank: int
    bias: Optional[fx.Node] = None
    out_layout: Optional[tuple] = None  # ``out.permute(out_layout)`` is the product in its order (None: out is)


def is_outer_product(node: fx.Node) -> bool:
    """``a * b`` with a ``[N, M, 1]`` and b ``[N, 1, K]`` (one dtype, no broadcast over N): ``bmm(a, b)``,
    which Inductor decomposes so (attention over a single key leaves P @ V in this form)."""
    if not ops.calls(node, *ops.OUTER_PRODUCT) or not all(isinstance(a, fx.Node) for a in node.args):
        return False
    a, b, out = (tensor_val(n) for n in (*node.args, node))
    if a is None or b is None or a.dim() != 3 or b.dim() != 3 or not a.dtype == b.dtype == out.dtype:
        return False
    return same_size(a.shape[2], 1) and same_size(b.shape[1], 1) and same_shape(out.shape, [a.shape[0], a.shape[1], b.shape[2]]) \
        and same_size(a.shape[0], b.shape[0])


def is_batched_product(node, with_bias: bool = False) -> bool:
    """A bmm (or a baddbmm ``with_bias``), in any of the forms the graph holds it."""
    products = ops.BMM + ops.BADDBMM if with_bias else ops.BMM
    return ops.calls(node, *products) or (isinstance(node, fx.Node) and is_outer_product(node))


def _factors(bmm: fx.Node) -> tuple:
    """(lhs, rhs, bias) of a bmm or baddbmm node."""
    if ops.calls(bmm, *ops.BADDBMM):
        return ops.arg(bmm, "batch1"), ops.arg(bmm, "batch2"), ops.arg(bmm, "self")
    return bmm.args[0], bmm.args[1], None


def _operand(bmm_arg: fx.Node, rank: int, scale_of=None, units: Optional[tuple] = (),
             source_rank: Optional[int] = None) -> Optional[Operand]:
    """The logical operand of a product of batch rank ``rank - 2``; with ``units`` (positions, or None for where
    the source has them), one whose source, of ``source_rank`` dims, holds size-1 dims beside those
    (_beside_unit_dims)."""
    node, factors = bmm_arg, []
    while _is_identity(node):
        node = node.args[0]
    if rank > 3:
        # A scale on the merged operand (DeBERTa-v2's ``bmm(q, kᵀ / c)``) scales the logical one alike.
        while scale_of is not None and len(forward_users(node)) <= 1 and scale_of(node) is not None:
            node, factor, divide = scale_of(node)
            factors.append((factor, divide))
            node = _through_identities(node)
        # A [N, M, K] operand may be transposed after the merge (BLOOM's ``k.transpose(-1, -2)`` of a flat k).
        swapped = ops.calls(node, *ops.PERMUTE) and list(ops.arg(node, "dims")) == [0, 2, 1]
        if swapped:
            node = node.args[0]
            while _is_identity(node):
                node = node.args[0]
        merged = _merged_batch_source(node, rank)
        if merged is None:
            return None
        node, kept = merged
        if swapped:
            kept = kept[:-2] + [kept[-1], kept[-2]]
    else:
        kept = [0, 1, 2]
    if units != ():
        source, source_dims = strip_views(node, keep_shared=True, source_rank=source_rank)
        found = _beside_unit_dims(source, [source_dims[i] for i in kept], units)
        return Operand(source, found[0], factors, found[1]) if found else None
    # Through size-1 views first (einsum); without them when that leaves a tensor of another rank
    # (e.g. MQA's [B, 1, G, S, D] -> [B, G, S, D] repeat, which must stay the operand).
    for unit_views, source_rank in ((True, None), (False, None), (True, rank)):
        source, source_dims = strip_views(node, unit_views, keep_shared=True, source_rank=source_rank)
        dims = [source_dims[i] for i in kept]
        if None not in dims and len(set(dims)) == rank and tensor_val(source).dim() == rank:
            return Operand(source, dims, factors)
    if rank == 3:  # e.g. a [1, H, S, D] tensor seen as [H, S, D]
        return Operand(node, [0, 1, 2])
    return None


def _beside_unit_dims(source: fx.Node, dims: list, units: Optional[tuple]) -> Optional[tuple[list, tuple]]:
    """(dims, units): ``dims`` (the source dims an operand shows) with every other source dim, each of size 1,
    placed at the batch positions ``units`` (None: at their own positions in the source), in source order;
    None if the source has other dims than those or they do not fit there."""
    shape = tensor_val(source).shape
    hidden = [d for d in range(len(shape)) if d not in dims]
    if None in dims or len(set(dims)) != len(dims) or not all(same_size(shape[d], 1) for d in hidden):
        return None
    units = tuple(hidden) if units is None else tuple(units)
    if not hidden or len(units) != len(hidden) or any(u >= len(shape) - 2 for u in units):
        return None
    shown, spare = iter(dims), iter(hidden)
    return [next(spare) if p in units else next(shown) for p in range(len(shape))], units


def _split_dims(shape, bmm_shape) -> Optional[list[int]]:
    """Dims of a view of a ``[N, M, K]`` bmm output that are (batch..., M, K); others have size 1."""
    for kept in (list(range(len(shape))), _non_unit(shape)):  # plain split first, then einsum's extra 1s
        sizes = [shape[i] for i in kept]
        if len(sizes) >= 3 and same_shape(sizes[-2:], bmm_shape[1:]) and same_size(_product(sizes[:-2]), bmm_shape[0]):
            return kept
    return None


def batched_matmul(node: fx.Node, with_bias: bool = False, scale_of=None) -> Optional[BatchedMatmul]:
    """Recognises ``node`` as the output of a logical batched matmul (a baddbmm too ``with_bias``), or None.
    With ``scale_of`` (node -> (input, factor, divide) or None), scalar scales between an operand's merge
    into [N, M, K] and the bmm are seen through and kept in ``Operand.factors``."""
    # Seen through size-1 views first (einsum's extra dims); then as a plain view of the bmm, which is
    # what a batch of 1 with a single query row needs: [H, 1, Sk] -> [1, H, 1, Sk] only inserts 1s, so
    # the first reading cannot tell the row dim from an inserted one.
    readings = batched_matmul_readings(node, with_bias, scale_of)
    return readings[0] if readings else None


def batched_matmul_readings(node: fx.Node, with_bias: bool = False, scale_of=None,
                            permuted_out: bool = False) -> list[BatchedMatmul]:
    """Every reading of ``node`` as a logical batched matmul, ``batched_matmul``'s first. With one head, a
    [B, 1, M, K] view of a [B, M, K] product is both a 3-D product and a 4-D one split as [B, 1].
    With ``permuted_out``, ``node`` may also be a permutation of the product's split (einsum's
    ``bnij,bjnd->bind`` leaves it so); ``out_layout`` then holds that permutation."""
    readings = [_batched_matmul(node, unit_views, with_bias, scale_of, permuted_out) for unit_views in (True, False)]
    if not any(r is not None and r.batch_rank + 2 == tensor_val(node).dim() for r in readings):
        readings.append(_batched_matmul_beside_unit_dims(node, with_bias, scale_of, permuted_out))
    return [r for i, r in enumerate(readings) if r is not None and r not in readings[:i]]


def _batched_matmul(node: fx.Node, unit_views: bool, with_bias: bool, scale_of,
                    permuted_out: bool = False) -> Optional[BatchedMatmul]:
    source, dims = strip_views(node, unit_views)
    out_layout = None
    rank = tensor_val(node).dim()
    if is_batched_product(source, with_bias) and rank > 3 and dims == [None] * (rank - 3) + [0, 1, 2]:
        bmm = source  # a batch of 1 x H: the split of N into batch dims is a unit view
    elif is_batched_product(source, with_bias):
        bmm, rank = source, 3
    elif ops.calls(source, *ops.VIEW) and is_batched_product(_through_identities(source.args[0]), with_bias):
        bmm = _through_identities(source.args[0])  # matmul's 3-D result keeps a view of its own shape
        shape, bmm_shape = tensor_val(source).shape, tensor_val(bmm).shape
        kept = _split_dims(shape, bmm_shape)
        if kept is None:
            return None
        if [d for d in dims if d is not None] != kept:
            if not (permuted_out and None not in dims and sorted(dims) == kept):
                return None
            out_layout = tuple(dims.index(d) for d in kept)
        rank = len(kept)
    else:
        return None
    if rank == 3 and [d for d in dims if d is not None] != [0, 1, 2]:
        return None
    lhs_arg, rhs_arg, bias = _factors(bmm)
    lhs, rhs = _operand(lhs_arg, rank, scale_of), _operand(rhs_arg, rank, scale_of)
    if lhs is None or rhs is None:
        return None
    return BatchedMatmul(bmm, node, lhs, rhs, rank - 2, bias, out_layout)


def _batched_matmul_beside_unit_dims(node: fx.Node, with_bias: bool, scale_of, permuted_out: bool) -> Optional[BatchedMatmul]:
    """``node`` shows the product's batch and size-1 dims beside it: einsum takes a size-1 head or block dim
    (CvT's single head, LongT5's single block) out of the bmm's batch and puts it back around it. Read as a
    product of ``node``'s rank whose extra batch dims have size 1 and whose operands' sources hold as many
    size-1 dims beside those they show. Such dims index nothing, so where they stand changes no value; the
    logical order is ``node``'s own, or with ``permuted_out`` its permutation that puts the size-1 dims where
    the left operand's source has them (einsum's permuted P @ V output reads the probabilities as they are)."""
    source, dims = strip_views(node)
    if is_batched_product(source, with_bias):
        bmm, split = source, [0, 1, 2]
    elif ops.calls(source, *ops.VIEW) and is_batched_product(_through_identities(source.args[0]), with_bias):
        bmm = _through_identities(source.args[0])
        split = _split_dims(tensor_val(source).shape, tensor_val(bmm).shape)
    else:
        return None
    if split is None:
        return None
    shown = [d for d in dims if d in split]
    units = tuple(i for i, d in enumerate(dims) if d not in split)  # inserted, or size-1 dims of the split
    if sorted(shown) != split or not units or not all(same_size(tensor_val(node).shape[u], 1) for u in units):
        return None
    lhs_arg, rhs_arg, bias = _factors(bmm)
    rank = len(dims)
    if shown == split and dims[-2:] == split[-2:]:
        lhs = _operand(lhs_arg, len(split), scale_of, units, rank)
        out_layout = None
    elif permuted_out:
        lhs = _operand(lhs_arg, len(split), scale_of, None, rank)
        if lhs is None or len(lhs.units) != len(units):
            return None
        at_units, at_split = iter(units), iter(split)
        out_layout = tuple(next(at_units) if p in lhs.units else dims.index(next(at_split)) for p in range(rank))
        out_layout = None if out_layout == tuple(range(rank)) else out_layout
    else:
        return None
    rhs = _operand(rhs_arg, len(split), scale_of, lhs.units, rank) if lhs is not None else None
    if rhs is None:
        return None
    return BatchedMatmul(bmm, node, lhs, rhs, rank - 2, bias, out_layout)


def repeated_heads(node: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """(kv, n_rep) when ``node`` is ``[B, Hkv, S, D]`` with each head repeated n_rep times in place.

    That is HF's repeat_kv (expand + reshape) and ``repeat_interleave(n_rep, dim=1)``, both of which
    map query head h to kv head h // n_rep, as the op's native GQA does.
    """
    if not ops.calls(node, *ops.VIEW):
        return None
    expanded = node.args[0]
    while ops.calls(expanded, *ops.CLONE):
        expanded = expanded.args[0]
    if not ops.calls(expanded, *ops.EXPAND) or not ops.calls(expanded.args[0], *ops.UNSQUEEZE):
        return None
    unsqueezed = expanded.args[0]
    kv = unsqueezed.args[0]
    kv_shape, big = tensor_val(kv).shape, tensor_val(expanded).shape
    if len(kv_shape) != 4 or ops.arg(unsqueezed, "dim") % 5 != 2 or len(big) != 5:
        return None
    n_rep = big[2]
    out_shape = tensor_val(node).shape
    if not same_shape([big[0], big[1], big[3], big[4]], kv_shape) or not isinstance(n_rep, int):
        return None
    if not same_shape(out_shape, [kv_shape[0], kv_shape[1] * n_rep, kv_shape[2], kv_shape[3]]):
        return None
    return kv, n_rep
