"""Proving that a mask built inside the graph is the top-left causal mask, so the op can take is_causal.

A mask built from positions alone (arange/iota comparisons, tril/triu of ones, slices, expands) is a
function of the shapes only. When those shapes are static the graph is specialised to them, so
evaluating the mask's subgraph once on CPU is a proof for every call of this graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .fx_utils import tensor_val

# Larger masks are not evaluated (the proof would cost more than it saves at compile time). 2**28
# covers a [1, 1, 16k, 16k] mask: a quarter of a second and 256 MiB of bools, once per compile.
_MAX_MASK_ELEMENTS = 1 << 28
# An additive mask entry this negative adds exactly 0 probability after softmax's exp().
_NEGLIGIBLE_BIAS = torch.finfo(torch.float16).min


def _subgraph(mask: fx.Node) -> Optional[list[fx.Node]]:
    """The nodes computing ``mask`` in graph order, or None if it depends on graph inputs."""
    seen: dict[fx.Node, None] = {}
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op not in ("call_function", "get_attr"):
            return None
        seen[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _static(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return all(isinstance(s, int) for s in value.shape)
    return node.op == "get_attr" or not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _on_cpu(arg):
    return torch.device("cpu") if isinstance(arg, torch.device) else arg


def _evaluate(nodes: list[fx.Node]) -> Optional[torch.Tensor]:
    values: dict[fx.Node, object] = {}
    module = nodes[-1].graph.owning_module
    for node in nodes:
        if node.op == "get_attr":
            values[node] = getattr(module, node.target).cpu()
            continue
        args = fx.map_arg(node.args, values.__getitem__)
        kwargs = {k: _on_cpu(v) for k, v in fx.map_arg(node.kwargs, values.__getitem__).items()}
        values[node] = node.target(*args, **kwargs)
    result = values[nodes[-1]]
    return result if isinstance(result, torch.Tensor) else None


def _attend_pattern(mask_value: torch.Tensor, negated: bool) -> Optional[torch.Tensor]:
    """Boolean 'may attend' tensor of a bool mask, or of an additive mask made of 0 and huge negatives."""
    if mask_value.dtype == torch.bool:
        return ~mask_value if negated else mask_value
    if negated or not mask_value.dtype.is_floating_point:
        return None
    zero = mask_value == 0
    blocked = mask_value <= _NEGLIGIBLE_BIAS
    return zero if bool((zero | blocked).all()) else None


def mask_pattern(mask: fx.Node, negated: bool, seq_q, seq_k) -> Optional[str]:
    """"causal" when ``mask`` (True/0 = attend) is ``key <= query`` at every leading index, "all" when
    it hides nothing; None otherwise or when that cannot be proven."""
    value = tensor_val(mask)
    if value is None or value.dim() < 2 or not isinstance(seq_q, int) or not isinstance(seq_k, int):
        return None
    if value.numel() > _MAX_MASK_ELEMENTS or seq_k == 0 or value.shape[-2:] != (seq_q, seq_k):
        return None
    nodes = _subgraph(mask)
    if nodes is None or not all(_static(n) for n in nodes):
        return None
    # The pass runs under the graph's fake mode; the proof needs real (small, CPU) tensors.
    with torch.utils._python_dispatch._disable_current_modes():
        try:
            concrete = _evaluate(nodes)
        except Exception:  # an op that cannot run eagerly here: no proof, the mask stays
            return None
        attend = None if concrete is None else _attend_pattern(concrete, negated)
        if attend is None:
            return None
        if bool(attend.all()):
            return "all"
        causal = torch.ones(seq_q, seq_k, dtype=torch.bool).tril()
        return "causal" if bool((attend == causal).all()) else None
