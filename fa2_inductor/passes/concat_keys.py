"""Attention over keys concatenated in the scores (Pegasus-X's block-local attention):

    s = cat([q @ k1ᵀ, q @ k2ᵀ, ...], -1)  ->  scale, masks  ->  p = softmax(s, -1)
    out = p[..., :J1] @ v1 + p[..., J1:J1+J2] @ v2 + ...

is one attention over the keys ``cat([k1, k2, ...])`` with the values ``cat([v1, v2, ...])``: each score
column is one key's dot product with the row's query, and the sum of the products of the probabilities'
key ranges with their values is ``p @ cat(v)``. The products may batch the rows differently (Pegasus-X's
global keys are one ``[B*H, N*K, G]`` product shared by the N blocks, the block-local keys a
``[B*H*N, K, K]`` one); each key set is repeated for the row groups its product shares it with.

The site is rebuilt in the form the softmax matcher reads: a q @ cat(k)ᵀ product in the scores' place, a
copy of the steps from the scores to the softmax (scale, masks, casts: judged there as for any site), and
P @ cat(v) in place of the sum. Only when that site is rewritten does its output take over the sum's users
(``AttentionSite.replaces``); a refused one is erased, leaving the graph as it was.

Exactness rests on views that keep the row-major order of the values (so the flattened tensors are
equal): every operand and output is followed only through such views, and all q operands must be read
from one tensor.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from . import op_table as ops
from .fx_utils import (aten, erase_unused, forward_users, insert_call, is_joint_graph, is_op, same_shape, same_size,
                       tensor_val)
from .match_softmax import Softmax, match_softmax_attention, softmax_at
from .refusals import Refusal, Refused
from .site import AttentionSite
from .views import is_batched_product

_SCORE_STEPS = 32  # nodes looked at above the softmax for the concatenation (scale, masks, casts between)


@dataclass
class _Product:
    """A bmm ``[Bt, M, J] = [Bt, M, F] @ [Bt, F, J]`` (or its outer-product form, F = 1) read by row: row r of
    its flattened output is row r of its left operand's, paired with the right operand of batch r // M."""

    bmm: fx.Node
    end: fx.Node  # the bmm's output as the graph uses it: a view of it that keeps its order

    @property
    def rows(self) -> int:  # M
        return tensor_val(self.bmm).shape[1]


def match_concatenated_keys(softmax: Softmax) -> Optional[AttentionSite]:
    """The site of a softmax over concatenated scores whose probabilities are split into key ranges (possibly
    refused, with the reason); None where the probabilities are not split so (the softmax matcher's case)."""
    split = _split_probabilities(softmax)
    cat = _concatenated_scores(softmax.input) if split else None
    if cat is None:
        return None
    reading = _read(softmax, cat, *split)
    if isinstance(reading, Refused):
        return AttentionSite("matmul_softmax", softmax.output, notes=["keys concatenated in the scores"]).refuse_as(reading)
    return _rebuilt_site(softmax, cat, reading)


def _split_probabilities(softmax: Softmax) -> Optional[tuple[fx.Node, list]]:
    """(probabilities, slices): the probabilities past casts and copies (a bf16 softmax computed in float32
    and cast back; eval-mode dropout's clone), when two or more slices (step 1) of one dim read them; else None."""
    probs = softmax.output
    while len(_readers(probs)) == 1 and ops.calls(_readers(probs)[0], *ops.IDENTITY, *ops.CAST):
        probs = _readers(probs)[0]
    users = _readers(probs)
    if len(users) < 2 or not all(user.target is aten.slice.Tensor for user in users):
        return None
    if len({_slice_args(user)[0] for user in users}) != 1 or any(_slice_args(user)[3] != 1 for user in users):
        return None
    return probs, users


def _slice_args(node: fx.Node) -> tuple:
    """(dim, start, end, step) of ``aten.slice.Tensor``, dim non-negative and start/end within the size."""
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = (node.kwargs.get(name, args[i]) for i, name in enumerate(("dim", "start", "end", "step"), 1))
    shape = tensor_val(node.args[0]).shape
    dim = (dim or 0) % len(shape)
    size = shape[dim]
    start = 0 if start is None else start
    end = sys.maxsize if end is None else end
    if isinstance(start, int) and isinstance(end, int) and isinstance(size, int):
        start, end = (min(max(i + size if i < 0 else i, 0), size) for i in (start, end))
    return dim, start, end, 1 if step is None else step


def _cat_dim(cat: fx.Node) -> int:
    dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    return dim % tensor_val(cat).dim()


def _concatenated_scores(x: fx.Node) -> Optional[fx.Node]:
    """The one concatenation of two or more products a few steps above the softmax input, or None."""
    found, seen, frontier = [], set(), [x]
    while frontier and len(seen) < _SCORE_STEPS:
        node = frontier.pop(0)
        if node in seen or not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is aten.cat.default:
            parts = node.args[0]
            if len(parts) >= 2 and all(_product_above(part) is not None for part in parts):
                found.append(node)
            continue
        if not is_batched_product(node, with_bias=True):
            frontier.extend(node.all_input_nodes)
    return found[0] if len(found) == 1 else None


def _readers(node: fx.Node) -> list:
    """The forward users that read ``node``'s values (a dynamic shape's ``sym_size`` reads only its size)."""
    return [user for user in forward_users(node) if not is_op(user, aten.sym_size)]


def _static(*nodes: fx.Node) -> bool:
    return all(isinstance(size, int) for node in nodes for size in tensor_val(node).shape)


def _order_source(node: fx.Node) -> Optional[fx.Node]:
    """The input of a layout-only op whose output lists the input's values in the same row-major order
    (``node.flatten()`` equals ``input.flatten()``); None for any other op."""
    if ops.calls(node, *ops.VIEW, *ops.UNSQUEEZE, *ops.SQUEEZE, *ops.IDENTITY):
        return node.args[0]
    if ops.calls(node, *ops.PERMUTE):
        shape = tensor_val(node.args[0]).shape
        moved = [d % len(shape) for d in ops.arg(node, "dims") if not same_size(shape[d], 1)]
        return node.args[0] if moved == sorted(moved) else None  # only size-1 dims move
    if ops.calls(node, *ops.EXPAND, *ops.CAST) and tensor_val(node.args[0]).dtype == tensor_val(node).dtype:
        return node.args[0] if same_shape(tensor_val(node.args[0]).shape, tensor_val(node).shape) else None
    return None


def _furthest_order_source(node: fx.Node) -> fx.Node:
    while _order_source(node) is not None:
        node = _order_source(node)
    return node


def _product_above(node: fx.Node) -> Optional[_Product]:
    """The bmm that ``node`` shows in the same order and with the same last dim, through views read by
    nothing else (the scores' part of the site)."""
    end = node
    while not is_batched_product(node):
        source = _order_source(node)
        if source is None or len(_readers(source)) != 1:
            return None
        node = source
    return _Product(node, end) if same_size(tensor_val(end).shape[-1], tensor_val(node).shape[-1]) else None


def _product_below(node: fx.Node) -> Optional[_Product]:
    """The bmm whose left operand shows ``node`` in the same order and with its last dim (through views
    read by nothing else), with its output as far as such views go (showing it with its last dim)."""
    start = node
    while True:
        users = _readers(node)
        if len(users) != 1:
            return None
        user = users[0]
        if is_batched_product(user) and user.args[0] is node and user.args[1] is not node:
            break
        if _order_source(user) is not node:
            return None
        node = user
    bmm = end = user
    if not same_size(tensor_val(node).shape[-1], tensor_val(start).shape[-1]):
        return None
    while len(_readers(end)) == 1 and _order_source(_readers(end)[0]) is end:
        end = _readers(end)[0]
    return _Product(bmm, end) if same_size(tensor_val(end).shape[-1], tensor_val(bmm).shape[-1]) else None


@dataclass
class _Reading:
    """What the rebuilt site is made of: the key parts in the scores' column order, the value parts in the
    probabilities' column order, and the sum of the P @ V products the site's output takes the place of."""

    steps: list  # the nodes from the concatenation to the probabilities the slices read, in graph order
    probs: fx.Node
    keys: list  # _Product per part of the concatenation
    values: list  # _Product per key range of the probabilities
    total: fx.Node


def _read(softmax: Softmax, cat: fx.Node, probs: fx.Node, slices: list) -> Union[_Reading, Refused]:
    """The _Reading, or the refusal of the first check that fails."""
    if is_joint_graph(cat.graph):
        return Refused(Refusal.TRAINING_GRADIENT_UNMAPPED, "keys concatenated in the scores: their gradients would be "
                       "slices of the op's dk and dv, summed over the row groups sharing them")
    if softmax.dim != tensor_val(softmax.input).dim() - 1:
        return Refused(Refusal.SOFTMAX_NOT_LAST_DIM)
    shape = tensor_val(cat).shape
    last = len(shape) - 1
    if _cat_dim(cat) != last:
        return Refused(Refusal.UNRECOGNISED_SCORES, "products concatenated along another dim than the keys")
    if _slice_args(slices[0])[0] != last:
        return Refused(Refusal.PROBS_USED_ELSEWHERE, "the probabilities split along another dim than the keys")
    keys = [_product_above(part) for part in cat.args[0]]
    products = [p.bmm for p in keys] + [p.bmm.args[1] for p in keys]
    if not _static(cat, *slices, *products):
        return Refused(Refusal.UNRECOGNISED_LAYOUT, "concatenated scores with symbolic sizes")
    if len(shape) < 3:
        return Refused(Refusal.UNRECOGNISED_LAYOUT, "concatenated scores without a batch dim")
    steps = _steps_between(cat, probs)
    inside = {cat, *steps}
    if any(user not in inside for node in (*cat.args[0], *inside - {probs}) for user in _readers(node)):
        return Refused(Refusal.INTERMEDIATE_USED_ELSEWHERE, "the concatenated scores, a part of them, or a step to the "
                       "softmax are read elsewhere")
    if not same_shape(tensor_val(probs).shape, shape):
        return Refused(Refusal.OUTPUT_SHAPE, "a mask broadcasts the concatenated scores to another shape")
    rows = shape[-2]
    refused = _rows_refusal(keys, rows, tensor_val(cat).dtype) or _same_queries_refusal(keys)
    if refused:
        return refused
    if not all(isinstance(i, int) for s in slices for i in _slice_args(s)[1:3]):
        return Refused(Refusal.UNRECOGNISED_LAYOUT, "the probabilities split at symbolic positions")
    slices = sorted(slices, key=lambda s: _slice_args(s)[1])
    ranges = [_slice_args(s)[1:3] for s in slices]
    if ranges[0][0] != 0 or ranges[-1][1] != shape[-1] or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])) \
            or any(start >= end for start, end in ranges):
        return Refused(Refusal.PROBS_USED_ELSEWHERE, f"split into the key ranges {ranges}: not each key once")
    values = [_product_below(s) for s in slices]
    if None in values:
        return Refused(Refusal.PROBS_USED_ELSEWHERE, "a key range of the probabilities reaches no P @ V product of its own")
    if not _static(*[p.bmm for p in values], *[p.bmm.args[1] for p in values]):
        return Refused(Refusal.UNRECOGNISED_LAYOUT, "P @ V products with symbolic sizes")
    refused = _rows_refusal(values, rows, tensor_val(probs).dtype)
    if refused:
        return refused
    total = _sum_of([value.end for value in values])
    if total is None:
        return Refused(Refusal.PROBS_USED_ELSEWHERE, "the key ranges' P @ V products are not summed, alone")
    if not same_shape(tensor_val(total).shape, [*shape[:-1], tensor_val(values[0].bmm).shape[-1]]):
        return Refused(Refusal.UNRECOGNISED_LAYOUT, "the summed P @ V products in another shape than the scores' rows")
    return _Reading(steps, probs, keys, values, total)


def _steps_between(cat: fx.Node, output: fx.Node) -> list:
    """The nodes computed from ``cat`` that ``output`` is computed from (``output`` included), in graph order."""
    order = {node: i for i, node in enumerate(cat.graph.nodes)}
    above, frontier = set(), [output]
    while frontier:  # only nodes after the concatenation can be computed from it
        node = frontier.pop()
        if node not in above and order[node] > order[cat]:
            above.add(node)
            frontier.extend(node.all_input_nodes)
    steps, reached = [], {cat}
    for node in sorted(above, key=order.__getitem__):
        if any(a in reached for a in node.all_input_nodes):
            reached.add(node)
            steps.append(node)
    return steps


def _rows_refusal(products: list, rows: int, dtype: torch.dtype) -> Optional[Refused]:
    """Why the products' row blocks do not each hold whole row groups of the scores (None when they do)."""
    for product in products:
        value = tensor_val(product.bmm)
        if value.dtype != dtype:
            return Refused(Refusal.VALUE_CHANGING_CAST, f"a {value.dtype} product in {dtype} attention")
        if product.rows % rows:
            return Refused(Refusal.UNRECOGNISED_LAYOUT, f"a product over blocks of {product.rows} rows: not whole "
                           f"groups of the scores' {rows}")
    return None


def _same_queries_refusal(keys: list) -> Optional[Refused]:
    """Why the concatenated products do not read one q, row for row (None when they do)."""
    queries = [k.bmm.args[0] for k in keys]
    inner = {tensor_val(q).shape[-1] for q in queries}
    if len({_furthest_order_source(q) for q in queries}) != 1 or len(inner) != 1:
        return Refused(Refusal.UNRECOGNISED_SCORES, "the concatenated products read their queries from different tensors")
    return None


def _sum_of(terms: list) -> Optional[fx.Node]:
    """The node that sums exactly ``terms``, each once, by adds that nothing else reads; else None."""
    total = terms[0]
    while len(_readers(total)) == 1 and _is_plain_add(_readers(total)[0]):
        total = _readers(total)[0]
    if total is terms[0]:
        return None

    def leaves(node: fx.Node) -> list:
        inner = node is total or len(_readers(node)) == 1
        if node in terms or not (inner and _is_plain_add(node)):
            return [node]
        return leaves(node.args[0]) + leaves(node.args[1])

    found = leaves(total)
    return total if len(found) == len(terms) and set(found) == set(terms) else None


def _is_plain_add(node: fx.Node) -> bool:
    """``a + b`` of two tensors of its own shape and dtype (no alpha, no broadcast)."""
    if not ops.calls(node, *ops.ADD) or ops.arg(node, "alpha") != 1:
        return False
    out = tensor_val(node)
    return all(isinstance(a, fx.Node) and tensor_val(a) is not None and tensor_val(a).dtype == out.dtype
               and same_shape(tensor_val(a).shape, out.shape) for a in node.args[:2])


def _rebuilt_site(softmax: Softmax, cat: fx.Node, reading: _Reading) -> AttentionSite:
    """The site of q @ cat(k)ᵀ -> the same steps -> softmax -> P @ cat(v), built before the sum it replaces."""
    graph = cat.graph
    shape = list(tensor_val(cat).shape)
    leading, rows = shape[:-2], shape[-2]
    groups = math.prod(leading)
    with graph.inserting_before(reading.total):
        first_q = reading.keys[0].bmm.args[0]
        inner = tensor_val(first_q).shape[-1]
        q = insert_call(graph, aten.reshape.default, (first_q, [*leading, rows, inner]))
        key_parts = [_per_row_group(graph, insert_call(graph, aten.permute.default, (k.bmm.args[1], [0, 2, 1])),
                                    k.rows, rows, leading) for k in reading.keys]
        k = insert_call(graph, aten.cat.default, (key_parts, -2))
        scores = _product(graph, q, _transposed(graph, k), leading, groups)
        copies = {cat: scores}
        for step in reading.steps:
            copies[step] = graph.node_copy(step, lambda arg: copies.get(arg, arg))
        value_parts = [_per_row_group(graph, v.bmm.args[1], v.rows, rows, leading) for v in reading.values]
        v = insert_call(graph, aten.cat.default, (value_parts, -2))
        out = _product(graph, copies[reading.probs], v, leading, groups)
    site = match_softmax_attention(softmax_at(copies[softmax.output]))
    if site is None or (site.refusal is None and site.anchor is not out):
        site = AttentionSite("matmul_softmax", softmax.output).refuse(
            Refusal.UNRECOGNISED_SCORES, "the rebuilt attention over the concatenated keys is not read back")
    site.notes.insert(0, f"keys concatenated from {len(reading.keys)} products")
    if site.refusal is None:
        site.replaces = reading.total
    else:  # the graph as it was
        erase_unused(out)
    return site


def _per_row_group(graph: fx.Graph, operand: fx.Node, product_rows: int, rows: int, leading: list) -> fx.Node:
    """A product's right operand ``[Bt, J, D]`` (one per block of ``product_rows`` rows) as ``[*leading, J, D]``:
    one per group of ``rows`` rows, each block's repeated for the groups it spans (a view where it spans one)."""
    blocks, keys, dim = tensor_val(operand).shape
    repeat = product_rows // rows
    if repeat > 1:
        operand = insert_call(graph, aten.unsqueeze.default, (operand, 1))
        operand = insert_call(graph, aten.expand.default, (operand, [blocks, repeat, keys, dim]))
    return insert_call(graph, aten.reshape.default, (operand, [*leading, keys, dim]))


def _transposed(graph: fx.Graph, node: fx.Node) -> fx.Node:
    rank = tensor_val(node).dim()
    return insert_call(graph, aten.permute.default, (node, [*range(rank - 2), rank - 1, rank - 2]))


def _product(graph: fx.Graph, lhs: fx.Node, rhs: fx.Node, leading: list, groups: int) -> fx.Node:
    """``lhs @ rhs`` over the leading dims, as a bmm of the merged ones (the form matmul decomposes to)."""
    merged = [insert_call(graph, aten.reshape.default, (x, [groups, *tensor_val(x).shape[-2:]])) for x in (lhs, rhs)]
    bmm = insert_call(graph, aten.bmm.default, tuple(merged))
    return insert_call(graph, aten.reshape.default, (bmm, [*leading, *tensor_val(bmm).shape[-2:]]))
