"""Attention with more than two leading dims (Hiera's ``[B, H, windows, S, D]``, ProphetNet's n-gram streams):
the op runs it with every leading dim but the last merged into its batch.

Each leading index is an attention of its own, so merging them computes the same values as long as q, k,
v, the output and the mask index them alike: the same sizes dim for dim (``leading_dims_agree``), and the
mask broadcast over the merged dims before the merge. A merge is a reshape: a view where the strides
allow it, a copy otherwise; the split back of the op's contiguous output is always a view.

The helpers build graph nodes (``GraphBuilder``) or compute fake values (``ValueBuilder``) with one code,
so the checks on the op's call see exactly the tensors the rewrite hands it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .fx_utils import aten, insert_call, same_shape, same_size, tensor_val

OP_RANK = 4  # the op's [B, H, S, D]


def merges(layout: tuple) -> bool:
    return len(layout) > OP_RANK


class ValueBuilder:
    """Applies the ops to (fake) tensors."""

    def call(self, target, *args):
        return target(*args)

    def size(self, value: torch.Tensor, dim: int):
        return value.shape[dim]

    def shape(self, value: torch.Tensor):
        return value.shape


class GraphBuilder:
    """Inserts the ops into ``graph`` at its current insert point."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph

    def call(self, target, *args) -> fx.Node:
        return insert_call(self.graph, target, args)

    def size(self, node: fx.Node, dim: int):
        """The int, or a ``sym_size`` node for a symbolic size."""
        value = tensor_val(node)
        size = value.shape[dim]
        return size if isinstance(size, int) else insert_call(self.graph, aten.sym_size.int, (node, dim % value.dim()))

    def shape(self, node: fx.Node):
        return tensor_val(node).shape


def leading_sizes(build, tensor, layout: tuple) -> list:
    """The leading (batch) sizes of ``tensor`` in the op's dim order (``tensor.permute(layout)[:-2]``)."""
    return [build.size(tensor, d) for d in layout[:-2]]


def merge(build, tensor):
    """``[d0, ..., dn, S, D]`` -> ``[d0 * ... * d(n-1), dn, S, D]``."""
    return build.call(aten.reshape.default, tensor, [-1, *(build.size(tensor, d) for d in (-3, -2, -1))])


def split(build, tensor, leading: list):
    """The op's ``[B, H, S, D]`` back as ``[*leading, S, D]``."""
    return build.call(aten.reshape.default, tensor, [*leading, build.size(tensor, -2), build.size(tensor, -1)])


def merge_mask(build, mask, leading: list):
    """A mask that broadcasts to ``[*leading, Sq, Sk]``, as one for the merged ``[B, H, Sq, Sk]`` scores."""
    rank = len(leading) + 2
    if len(build.shape(mask)) < OP_RANK:  # it broadcasts over the merged dims as it is
        return mask
    while len(build.shape(mask)) < rank:
        mask = build.call(aten.unsqueeze.default, mask, 0)
    shape = build.shape(mask)
    if not all(same_size(size, 1) for size in shape[:rank - 3]):  # one mask per merged index: a copy
        mask = build.call(aten.expand.default, mask, [*leading[:-1], -1, -1, -1])
    return merge(build, mask)


def leading_dims_agree(values: dict, layouts: dict) -> bool:
    """q, k, v and the output (fake values by name) have the same leading sizes in the op's dim order. A
    batched product only proves their products equal ([2, 3, 4] and [3, 2, 4] both flatten to 24), and the
    output is split back with q's sizes: equal sizes dim for dim keep every pairing the product's."""
    build = ValueBuilder()
    sizes = [leading_sizes(build, values[name], layouts[name]) for name in ("q", "k", "v", "out")]
    return all(same_shape(sizes[0], other) for other in sizes[1:])
