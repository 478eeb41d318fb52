"""Small helpers for reading and extending ATen FX graphs (the graphs Inductor's joint passes see)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
prims = torch.ops.prims


def is_op(node: Any, *packets) -> bool:
    """True if ``node`` calls one of the given ATen/prims overload packets (any overload)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and any(packet is p for p in packets)


def val(node: Any):
    """The fake value recorded for a node (a FakeTensor, SymInt/SymFloat, or a plain number)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def tensor_val(node: Any) -> Optional[torch.Tensor]:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def same_size(a, b) -> bool:
    """Sizes equal for every value of the shape symbols (never adds a guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def same_shape(a: Iterable, b: Iterable) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def is_backward_node(node: fx.Node) -> bool:
    """A node AOTAutograd emitted for the backward of a joint graph."""
    return bool(node.meta.get("autograd_backward")) or node.meta.get("partitioner_tag") == "is_backward"


def is_joint_graph(graph: fx.Graph) -> bool:
    """A forward + backward (training) graph."""
    return any(is_backward_node(n) for n in graph.nodes)


def forward_users(node: fx.Node) -> list[fx.Node]:
    """Users outside the backward; an alias that only feeds the backward counts as backward."""
    users = []
    for user in node.users:
        if is_backward_node(user):
            continue
        if is_op(user, aten.alias) and all(is_backward_node(u) for u in user.users):
            continue
        users.append(user)
    return users


def erase_unused(node: fx.Node) -> None:
    """Erases ``node`` if nothing reads it, then every input that this leaves unread (a local dead-code
    elimination, for nodes a pass built and did not use)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if node._erased or node.users or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        stack.extend(inputs)


def scalar_value(arg: Any):
    """A Python number, or a graph node holding a SymInt/SymFloat; None for anything tensor-valued."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return arg
    if isinstance(arg, fx.Node) and isinstance(val(arg), (torch.SymInt, torch.SymFloat, int, float)):
        return arg
    return None


def insert_call(graph: fx.Graph, target, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """Adds a call at the graph's current insert point and records its fake value in meta['val']."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake_args = fx.map_arg(args, lambda n: n.meta["val"])
    fake_kwargs = fx.map_arg(kwargs, lambda n: n.meta["val"])
    fake_mode = torch._guards.detect_fake_mode(_tensors_in((fake_args, fake_kwargs)))
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def _tensors_in(tree) -> list:
    found = []
    fx.node.map_aggregate(tree, lambda x: found.append(x) if isinstance(x, torch.Tensor) else x)
    return found
