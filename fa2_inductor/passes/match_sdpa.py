"""``F.scaled_dot_product_attention`` as AOTAutograd leaves it: one of ATen's fused SDPA ops."""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from . import op_table as ops
from .fx_utils import aten, insert_call, prims, tensor_val
from .precision import run_in_input_precision
from .refusals import Refusal
from .site import BHSD, AttentionSite
from .views import repeated_heads


def is_sdpa(node: fx.Node) -> bool:
    """A call of one of ATen's SDPA ops (any overload: ``match_sdpa`` judges its arguments)."""
    packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
    return packet is not None and any(packet is op.overloadpacket for op in ops.SDPA)


def _output(node: fx.Node) -> Optional[fx.Node]:
    if node.target is aten.scaled_dot_product_attention.default:
        return node
    outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    return outs[0] if len(outs) == 1 else None


def _inverse_sqrt_head_dim(sdpa: fx.Node, q: fx.Node) -> fx.Node:
    """SDPA's default scale for a symbolic head dim, as a 0-d float32 tensor (folded into q)."""
    graph = sdpa.graph
    with graph.inserting_before(sdpa):
        head_dim = insert_call(graph, aten.sym_size.int, (q, 3))
        as_tensor = insert_call(graph, aten.scalar_tensor.default, (head_dim,), {"dtype": torch.float64})
        inverse = insert_call(graph, aten.rsqrt.default, (as_tensor,))
        return insert_call(graph, prims.convert_element_type.default, (inverse, torch.float32))


def match_sdpa(node: fx.Node) -> Optional[AttentionSite]:
    anchor = _output(node)
    if anchor is None:
        return None
    site = AttentionSite("sdpa", anchor)
    site.forward_nodes = {node, *node.users}
    if not ops.calls(node, *ops.SDPA):
        return site.refuse(Refusal.UNSUPPORTED_ARGUMENT, ops.unaccepted_use(node))
    args = ops.arguments(node)
    if args["dropout_p"] != 0.0:
        return site.refuse(Refusal.DROPOUT_ACTIVE)
    q, k, v = args["query"], args["key"], args["value"]
    site.q, site.k, site.v = q, k, v
    site.layouts = {"q": BHSD, "k": BHSD, "v": BHSD, "out": BHSD}
    head_dim = tensor_val(q).shape[-1]
    scale = args.get("scale")
    if scale is None and not isinstance(head_dim, int):
        site.symbolic_scale = [(_inverse_sqrt_head_dim(node, q), False)]
        scale = 1.0
    site.scale = float(1.0 / math.sqrt(head_dim) if scale is None else scale)
    site.mask = args.get("attn_mask", args.get("attn_bias"))
    site.is_causal = bool(args.get("is_causal", False))
    k_rep, v_rep = repeated_heads(k), repeated_heads(v)
    if k_rep and v_rep and k_rep[1] == v_rep[1]:
        site.k, site.v, site.n_rep = k_rep[0], v_rep[0], k_rep[1]
    run_in_input_precision(site)
    return site
