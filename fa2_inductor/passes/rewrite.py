"""Replacing a matched site by the fused op, in inference graphs and in joint (training) graphs.

In a joint graph AOTAutograd tags every backward node with the ``seq_nr`` of the forward op it
differentiates. The backward of a site is therefore the set of backward nodes whose seq_nr belongs to
one of the site's forward nodes; its outputs are the gradients of q, k and v, told apart by the
seq_nr of the forward ops private to each input. That region is replaced by ``flash_attention_bwd``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .fx_utils import aten, insert_call, is_backward_node, is_op, same_shape, tensor_val
from .leading_dims import OP_RANK, GraphBuilder, ValueBuilder, leading_sizes, merge, merge_mask, merges, split
from .refusals import Refusal
from .site import AttentionSite, inverse, is_flat


def to_op_layout(graph: fx.Graph, node: fx.Node, layout: tuple) -> fx.Node:
    if layout != tuple(range(len(layout))):
        node = insert_call(graph, aten.permute.default, (node, list(layout)))
    if is_flat(layout):
        node = insert_call(graph, aten.unsqueeze.default, (node, 1))
    return merge(GraphBuilder(graph), node) if merges(layout) else node


def from_op_layout(graph: fx.Graph, node: fx.Node, layout: tuple, leading: Optional[list] = None) -> fx.Node:
    """The op's [B, H, S, D] back in ``layout``; ``leading``: the sizes a merge of leading dims split back to."""
    if is_flat(layout):
        node = insert_call(graph, aten.squeeze.dim, (node, 1))
    if merges(layout):
        node = split(GraphBuilder(graph), node, leading)
    if layout != tuple(range(len(layout))):
        node = insert_call(graph, aten.permute.default, (node, list(inverse(layout))))
    return node


def value_in_op_layout(value: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The same transform as ``to_op_layout``, applied to a (fake) tensor."""
    value = value.permute(layout)
    if is_flat(layout):
        value = value.unsqueeze(1)
    return merge(ValueBuilder(), value) if merges(layout) else value


def _merged_leading_sizes(build, site: AttentionSite) -> Optional[list]:
    """q's leading sizes in the op's dim order where the site's layout merges them (else None)."""
    layout = site.layouts["q"]
    q = site.q if isinstance(build, GraphBuilder) else tensor_val(site.q)
    return leading_sizes(build, q, layout) if merges(layout) else None


def mask_value_in_op_layout(site: AttentionSite) -> Optional[torch.Tensor]:
    """The (fake) mask the op would receive: what ``_mask_in_op_layout`` builds, as a value."""
    if site.mask_terms:
        mask = None
        for node, negated in site.mask_terms:
            term = ~tensor_val(node) if negated else tensor_val(node)
            mask = term if mask is None else mask & term
    elif site.mask is not None:
        mask = tensor_val(site.mask)
        for extra in site.extra_masks:
            mask = mask + tensor_val(extra)
    else:
        return None
    leading = _merged_leading_sizes(ValueBuilder(), site)
    if leading is not None:
        return merge_mask(ValueBuilder(), mask, leading)
    return mask.unsqueeze(1) if is_flat(site.layouts["q"]) and mask.dim() == 3 else mask


def forward_region(site: AttentionSite) -> set:
    """Nodes between the site's inputs (q, k, v) and its output: what the rewrite makes dead."""
    inputs = {site.q, site.k, site.v}
    above, stack = set(), [site.anchor]
    while stack:
        node = stack.pop()
        if node in above or node in inputs:
            continue
        above.add(node)
        stack.extend(node.all_input_nodes)
    region = set()
    for node in site.anchor.graph.nodes:  # graph order: inputs of a node are decided before it
        if node in above and any(a in inputs or a in region for a in node.all_input_nodes):
            region.add(node)
    return region | site.forward_nodes


@dataclass
class BackwardRegion:
    nodes: list  # in graph order
    grad_out: fx.Node
    grads: dict  # "q"/"k"/"v" (and "mask") -> the backward node holding that input's gradient


def _gradient_owner_keys(start: fx.Node, region: set) -> set:
    """Keys identifying the backward node that holds ``start``'s gradient.

    The seq_nrs of the forward ops only this input flows through; when it goes straight into an op
    with several tensor inputs (bmm, SDPA), that op's seq_nr with the input's argument position.
    """
    keys, node = set(), start
    while True:
        users = [u for u in node.users if u in region and not is_backward_node(u)]
        if len(users) != 1:
            return keys
        user = users[0]
        if len([a for a in user.all_input_nodes if tensor_val(a) is not None]) != 1:  # sizes may be nodes too
            if not keys:
                keys.add((user.meta.get("seq_nr"), user.args.index(node) if node in user.args else None))
            return keys
        node = user
        keys.add((node.meta.get("seq_nr"), None))


def _gradient_key_matches(node: fx.Node, key: tuple) -> bool:
    seq, position = key
    if node.meta.get("seq_nr") != seq:
        return False
    # An op with several inputs: its backward returns one gradient per input, picked by getitem.
    return position is None or node.target is not operator.getitem or node.args[1] == position


def backward_region(site: AttentionSite, region: set) -> Optional[BackwardRegion]:
    """The site's backward in a joint graph; None when there is none or (the site refused) when unusable."""
    seqs = {n.meta.get("seq_nr") for n in region if not is_backward_node(n)} - {None, -1}
    graph = site.anchor.graph
    tagged = [n for n in graph.nodes if is_backward_node(n) and n.meta.get("seq_nr") in seqs]
    # Gradient accumulation for an input used elsewhere too can carry one of our seq_nrs; it sums
    # gradients arriving from outside and is not part of this site's backward.
    outside = set(tagged)
    nodes = [n for n in tagged if not (is_op(n, aten.add) and any(
        a not in outside and _carries_gradient(a) for a in n.all_input_nodes))]
    if not nodes:
        return None
    members = _with_untagged_links(graph, nodes, region)
    nodes = [n for n in graph.nodes if n in members]
    forward = region | {n for n in graph.nodes if not is_backward_node(n) and n.meta.get("seq_nr") in seqs}
    grad_inputs = {
        a for n in nodes for a in n.all_input_nodes
        if a not in members and a not in forward and isinstance(tensor_val(a), torch.Tensor) and _carries_gradient(a)
    }
    if len(grad_inputs) != 1:
        site.refuse(Refusal.TRAINING_BACKWARD_UNRECOGNISED)
        return None
    inputs = {"q": site.q, "k": site.k, "v": site.v}
    if len(set(inputs.values())) != 3:
        site.refuse(Refusal.TRAINING_SHARED_INPUT)
        return None
    if _mask_gradient_mappable(site, region):
        inputs["mask"] = site.mask
    keys = {name: _gradient_owner_keys(node, region) for name, node in inputs.items()}
    grads, unowned = {}, []
    for node in nodes:
        if all(u in members for u in node.users):
            continue
        owners = [name for name, own in keys.items() if any(_gradient_key_matches(node, key) for key in own)]
        if not owners:
            unowned.append(node)
        elif len(owners) != 1 or owners[0] in grads:
            site.refuse(Refusal.TRAINING_GRADIENT_UNMAPPED)
            return None
        else:
            grads[owners[0]] = node
    # A mask as large as the scores has no reduction node: its gradient is the scores' own, the one
    # gradient left once q, k and v have theirs.
    if unowned and not (len(unowned) == 1 and "mask" in inputs and grads.keys() == {"q", "k", "v"}
                        and _is_full_mask_gradient(unowned[0], site)):
        site.refuse(Refusal.TRAINING_GRADIENT_UNMAPPED)
        return None
    if unowned:
        grads["mask"] = unowned[0]
    return BackwardRegion(nodes, grad_inputs.pop(), grads)


def _mask_gradient_mappable(site: AttentionSite, region: set) -> bool:
    """The op's mask is the graph's own mask node, added to the scores as it is (one additive mask, in its
    own layout, not a node the matcher derived from one): the op's dmask is then its gradient, reduced
    over broadcast dims as the graph reduces it."""
    mask = tensor_val(site.mask) if site.mask is not None else None
    if mask is None or site.is_causal or site.extra_masks or not mask.dtype.is_floating_point:
        return False
    if site.kind != "matmul_softmax":  # SDPA's backward ops differ in whether (and where) they return one
        return False
    if not any(user in region for user in site.mask.users):  # e.g. alpha * mask, built for the op
        return False
    if merges(site.layouts["q"]) and mask.dim() >= OP_RANK:  # the op gets a merged copy of it
        return False
    return not (is_flat(site.layouts["q"]) and mask.dim() == 3)


def _is_full_mask_gradient(node: fx.Node, site: AttentionSite) -> bool:
    """``node`` has the shape and dtype of a mask that covers every [B, Hq, Sq, Sk] score."""
    q = value_in_op_layout(tensor_val(site.q), site.layouts["q"])
    k = value_in_op_layout(tensor_val(site.k), site.layouts["k"])
    scores = [q.shape[0], q.shape[1], q.shape[2], k.shape[2]]
    value, mask = tensor_val(node), tensor_val(site.mask)
    return (value is not None and value.dtype == mask.dtype and same_shape(mask.shape, scores)
            and same_shape(value.shape, scores))


def _with_untagged_links(graph: fx.Graph, nodes: list, region: set) -> set:
    """Adds the nodes that only link our backward nodes to each other: computed from them and read only by
    them or by each other. Some later pass creates such nodes without a seq_nr (e.g. dynamic shapes' scalar
    division); a functionalised in-place op on a view (LongT5's ``scores += bias``) leaves a chain of them
    under the seq_nrs of ops the graph no longer holds."""
    members = set(nodes)
    order = [n for n in graph.nodes if n.op == "call_function" and n not in region]
    reached = set()  # computed from our backward nodes
    for node in order:
        if node not in members and any(a in members or a in reached for a in node.all_input_nodes):
            reached.add(node)
    links = set()
    for node in reversed(order):  # users come after the nodes they read
        if node in reached and node.users and all(u in members or u in links for u in node.users):
            links.add(node)
    return members | links


def _carries_gradient(node: fx.Node) -> bool:
    return is_backward_node(node) or (node.op == "placeholder" and node.name.startswith("tangents"))


def _tag_new_nodes(graph: fx.Graph, existing: set, backward: bool) -> None:
    """Marks added nodes the way AOTAutograd marks joint-graph nodes, for the partitioner."""
    for node in graph.nodes:
        if node not in existing:
            node.meta["partitioner_tag"] = "is_backward" if backward else "is_forward"
            if backward:
                node.meta["autograd_backward"] = True


def rewrite_site(site: AttentionSite, backward: Optional[BackwardRegion]) -> None:
    graph = site.anchor.graph
    existing = set(graph.nodes)
    with graph.inserting_before(site.anchor):
        q = to_op_layout(graph, site.q, site.layouts["q"])
        for factor, divide in site.symbolic_scale:
            q = insert_call(graph, aten.div.Tensor if divide else aten.mul.Tensor, (q, factor))
        k = to_op_layout(graph, site.k, site.layouts["k"])
        v = to_op_layout(graph, site.v, site.layouts["v"])
        mask = _mask_in_op_layout(graph, site)
        fwd = insert_call(graph, torch.ops.fa2_inductor.flash_attention_fwd.default,
                          (q, k, v, mask, site.scale, site.is_causal, site.window_left, int(site.empty_rows),
                           float(site.softcap), site.sinks))
        out = insert_call(graph, operator.getitem, (fwd, 0))
        lse = insert_call(graph, operator.getitem, (fwd, 1))
        result = from_op_layout(graph, out, site.layouts["out"], _merged_leading_sizes(GraphBuilder(graph), site))
    site.anchor.replace_all_uses_with(result)
    if site.replaces is not None:
        site.replaces.replace_all_uses_with(result)
    if "partitioner_tag" in site.anchor.meta:
        _tag_new_nodes(graph, existing, backward=False)
    if backward is not None:
        _rewrite_backward(site, backward, (q, k, v, mask, out, lse))


def _mask_in_op_layout(graph: fx.Graph, site: AttentionSite) -> Optional[fx.Node]:
    if site.mask_terms:
        mask = None
        for node, negated in site.mask_terms:
            term = insert_call(graph, aten.logical_not.default, (node,)) if negated else node
            mask = term if mask is None else insert_call(graph, aten.logical_and.default, (mask, term))
    elif site.mask is not None:
        mask = site.mask
        for extra in site.extra_masks:
            mask = insert_call(graph, aten.add.Tensor, (mask, extra))
        if site.mask_negated:
            mask = insert_call(graph, aten.logical_not.default, (mask,))
    else:
        return None
    leading = _merged_leading_sizes(GraphBuilder(graph), site)
    if leading is not None:
        return merge_mask(GraphBuilder(graph), mask, leading)
    if is_flat(site.layouts["q"]) and tensor_val(mask).dim() == 3:
        mask = insert_call(graph, aten.unsqueeze.default, (mask, 1))
    return mask


def _rewrite_backward(site: AttentionSite, backward: BackwardRegion, saved: tuple) -> None:
    graph = site.anchor.graph
    q, k, v, mask, out, lse = saved
    existing = set(graph.nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = max((backward.grad_out, lse), key=order.__getitem__)
    with graph.inserting_before(start.next):
        grad_out = to_op_layout(graph, backward.grad_out, site.layouts["out"])
        mask_grad = "mask" in backward.grads
        bwd = insert_call(graph, torch.ops.fa2_inductor.flash_attention_bwd.default,
                          (grad_out, q, k, v, out, lse, mask, site.scale, site.is_causal, mask_grad, site.window_left,
                           float(site.softcap), site.sinks, int(site.empty_rows)))
        grads = {name: insert_call(graph, operator.getitem, (bwd, i)) for i, name in enumerate("qkv")}
        leading = _merged_leading_sizes(GraphBuilder(graph), site)  # k's and v's too (leading_dims_agree)
        grads = {name: from_op_layout(graph, g, site.layouts[name], leading) for name, g in grads.items()}
        if mask_grad:  # reduced to the mask's own shape by the op
            grads["mask"] = insert_call(graph, operator.getitem, (bwd, 3))
        for factor, divide in site.symbolic_scale:  # q was scaled before the op: chain rule
            grads["q"] = insert_call(graph, aten.div.Tensor if divide else aten.mul.Tensor, (grads["q"], factor))
    _tag_new_nodes(graph, existing, backward=True)
    for name, old in backward.grads.items():
        old.replace_all_uses_with(grads[name])
    for node in reversed(backward.nodes):
        if not node.users:
            graph.erase_node(node)
