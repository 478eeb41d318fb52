"""The ATen op overloads an attention chain may contain, and every argument that can change their values.

The matchers accept a node inside a chain only through ``calls``: its overload must be in the table, and
each argument of its schema is either an operand (read and judged by the matcher, as add's ``alpha``),
pinned to the one value that keeps the math (``rounding_mode=None``, ``keepdim=True``, sub's ``alpha=1``),
or inert (memory format, layout, device placement: they never change a value). An overload that is not
listed, or whose schema has an argument the table does not name (a newer torch may add one), is never
accepted.

Casts are judged by ``widens``: a float cast that keeps every value; narrowing is allowed by the
matchers only where the op rounds the same way itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

OPERAND = "operand"  # read by the matcher, which judges its value
INERT = "inert"  # cannot change any value
_UNSET = object()


def _rule(overload_name: str, packet, *operands: str, inert: tuple = (), **pinned) -> tuple:
    """(overload name, packet, argument rules); a packet this torch lacks is skipped by ``_build_table``."""
    return overload_name, packet, {**{a: OPERAND for a in operands}, **{a: INERT for a in inert}, **pinned}


_FACTORY_INERT = ("layout", "device", "pin_memory")
_SDPA_OPERANDS = ("query", "key", "value", "dropout_p", "is_causal", "scale")
_SPECS = [
    # scale: scores * c, scores / c (true division only)
    _rule("Tensor", aten.mul, "self", "other"),
    _rule("Scalar", aten.mul, "self", "other"),
    _rule("Tensor", aten.div, "self", "other"),
    _rule("Scalar", aten.div, "self", "other"),
    _rule("Tensor_mode", aten.div, "self", "other", rounding_mode=None),
    _rule("Scalar_mode", aten.div, "self", "other", rounding_mode=None),
    # additive masks (alpha scales the second operand: the matcher folds it in), -inf fills, the softmax's subtraction
    _rule("Tensor", aten.add, "self", "other", "alpha"),
    _rule("Tensor", aten.sub, "self", "other", alpha=1),
    _rule("self", aten.where, "condition", "self", "other"),
    _rule("ScalarSelf", aten.where, "condition", "self", "other"),
    _rule("ScalarOther", aten.where, "condition", "self", "other"),
    _rule("Scalar", aten.where, "condition", "self", "other"),
    _rule("default", aten.full, "size", "fill_value", "dtype", inert=_FACTORY_INERT),
    # a clamp from below (XGLM's max(scores, finfo.min)): the matcher judges the bound
    _rule("default", aten.maximum, "self", "other"),
    _rule("default", aten.clamp_min, "self", "min"),
    _rule("default", aten.scalar_tensor, "s", "dtype", inert=_FACTORY_INERT),
    # casts (judged by the matcher with ``widens``)
    _rule("default", prims.convert_element_type, "a", "dtype"),
    # softmax, whole or as Inductor decomposes it; a safe softmax's "row fully masked" test
    _rule("default", aten._softmax, "self", "dim", "half_to_float"),
    _rule("default", aten._safe_softmax, "self", "dim", "dtype"),
    _rule("default", aten.amax, "self", "dim", keepdim=True),
    _rule("default", aten.exp, "self"),
    _rule("dim_IntList", aten.sum, "self", "dim", "keepdim", dtype=None),  # keepdim: the softmax's True, lse's False
    _rule("Scalar", aten.eq, "self", "other"),
    _rule("default", aten.logical_not, "self"),
    _rule("dim", aten.any, "self", "dim", keepdim=True),
    _rule("dim", aten.all, "self", "dim", keepdim=True),
    # a sink applied after P @ V as sigmoid(logsumexp(scores) - sink) (sink_gate)
    _rule("default", aten.logsumexp, "self", "dim", keepdim=False),
    _rule("default", aten.log, "self"),
    _rule("default", aten.abs, "self"),
    _rule("default", aten.sigmoid, "self"),
    # matmul and layout: same values, other views of them
    _rule("default", aten.bmm, "self", "mat2"),
    _rule("default", aten.baddbmm, "self", "batch1", "batch2", "beta", "alpha"),  # the matcher judges beta, alpha
    _rule("default", aten.view, "self", "size"),
    _rule("default", aten._unsafe_view, "self", "size"),
    _rule("default", aten.reshape, "self", "shape"),
    _rule("default", aten.permute, "self", "dims"),
    _rule("default", aten.expand, "self", "size", inert=("implicit",)),
    _rule("default", aten.unsqueeze, "self", "dim"),
    _rule("default", aten.squeeze, "self"),
    _rule("dim", aten.squeeze, "self", "dim"),
    _rule("dims", aten.squeeze, "self", "dim"),
    _rule("default", aten.clone, "self", inert=("memory_format",)),
    _rule("default", aten.contiguous, "self", inert=("memory_format",)),
    _rule("default", aten.alias, "self"),
    _rule("default", aten.detach, "self"),
    _rule("default", aten.lift_fresh_copy, "self"),
    # SDPA in the forms dispatch leaves (whether lse or a debug mask is also returned changes no value)
    _rule("default", aten.scaled_dot_product_attention, *_SDPA_OPERANDS, "attn_mask", "enable_gqa"),
    _rule("default", getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), *_SDPA_OPERANDS, "attn_mask"),
    _rule("default", getattr(aten, "_scaled_dot_product_flash_attention", None), *_SDPA_OPERANDS, inert=("return_debug_mask",)),
    _rule("default", getattr(aten, "_scaled_dot_product_efficient_attention", None), *_SDPA_OPERANDS, "attn_bias",
          inert=("compute_log_sumexp",)),
    _rule("default", getattr(aten, "_scaled_dot_product_cudnn_attention", None), *_SDPA_OPERANDS, "attn_bias",
          inert=("compute_log_sumexp", "return_debug_mask")),
    _rule("default", getattr(aten, "_scaled_dot_product_fused_attention_overrideable", None), *_SDPA_OPERANDS, "attn_bias",
          inert=("return_debug_mask",)),
]


def _build_table(specs) -> dict:
    """Overload -> argument rules, for the overloads this torch has and whose schema the rules cover fully."""
    table = {}
    for name, packet, rules in specs:
        overload = getattr(packet, name, None) if packet is not None else None
        if overload is None:
            continue
        if {a.name for a in overload._schema.arguments} == set(rules):
            table[overload] = rules
    return table


TABLE = _build_table(_SPECS)


def overloads(packet, *names: str) -> tuple:
    """The listed overloads of ``packet`` that the table holds (in this torch)."""
    return tuple(o for o in (getattr(packet, n, None) for n in names) if o in TABLE)


# The roles the matchers ask for, each a set of overloads from the table.
SCALE = overloads(aten.mul, "Tensor", "Scalar") + overloads(aten.div, "Tensor", "Scalar", "Tensor_mode", "Scalar_mode")
DIVIDE = overloads(aten.div, "Tensor", "Scalar", "Tensor_mode", "Scalar_mode")
ADD = overloads(aten.add, "Tensor")
SUB = overloads(aten.sub, "Tensor")
WHERE = overloads(aten.where, "self", "ScalarSelf", "ScalarOther", "Scalar")
FILL = overloads(aten.full, "default") + overloads(aten.scalar_tensor, "default")
CLAMP_LOW = overloads(aten.maximum, "default") + overloads(aten.clamp_min, "default")
CAST = overloads(prims.convert_element_type, "default")
SOFTMAX = overloads(aten._softmax, "default")
SAFE_SOFTMAX = overloads(aten._safe_softmax, "default")
AMAX = overloads(aten.amax, "default")
EXP = overloads(aten.exp, "default")
SUM = overloads(aten.sum, "dim_IntList")
EQ = overloads(aten.eq, "Scalar")
NOT = overloads(aten.logical_not, "default")
ANY = overloads(aten.any, "dim")
ALL = overloads(aten.all, "dim")
MUL = overloads(aten.mul, "Tensor")
LOGSUMEXP = overloads(aten.logsumexp, "default")
LOG = overloads(aten.log, "default")
ABS = overloads(aten.abs, "default")
SIGMOID = overloads(aten.sigmoid, "default")
BMM = overloads(aten.bmm, "default")
BADDBMM = overloads(aten.baddbmm, "default")
# [N, M, 1] * [N, 1, K]: a bmm over a single inner index, as Inductor decomposes one (views.is_outer_product)
OUTER_PRODUCT = overloads(aten.mul, "Tensor")
VIEW = overloads(aten.view, "default") + overloads(aten._unsafe_view, "default") + overloads(aten.reshape, "default")
PERMUTE = overloads(aten.permute, "default")
EXPAND = overloads(aten.expand, "default")
UNSQUEEZE = overloads(aten.unsqueeze, "default")
SQUEEZE = overloads(aten.squeeze, "default", "dim", "dims")
CLONE = overloads(aten.clone, "default")
ALIAS = overloads(aten.alias, "default")
SDPA = tuple(o for o in TABLE if "scaled_dot_product" in o.name())
# Ops that return their input's values unchanged (a copy or an alias).
IDENTITY = CLONE + overloads(aten.contiguous, "default") + ALIAS + overloads(aten.detach, "default") + overloads(
    aten.lift_fresh_copy, "default"
)


def arguments(node: fx.Node) -> dict:
    """Every schema argument of ``node``'s call by name: given positionally, by keyword, or its default."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = _UNSET
    return bound


def arg(node: fx.Node, name: str) -> Any:
    """One argument of ``node``'s call by its schema name."""
    return arguments(node)[name]


def _pinned_mismatch(node: fx.Node) -> str:
    """'' when every pinned argument has its value; else which one differs (``node`` is in the table)."""
    rules = TABLE[node.target]
    for name, value in arguments(node).items():
        rule = rules[name]
        if rule not in (OPERAND, INERT) and not _same_value(value, rule):
            return f"{name}={value!r}"
    return ""


def _same_value(given: Any, pinned: Any) -> bool:
    if isinstance(pinned, bool) or pinned is None:
        return given is pinned or (isinstance(given, bool) and given == pinned)
    return not isinstance(given, (bool, fx.Node)) and given == pinned


def calls(node: Any, *accepted) -> bool:
    """``node`` calls one of the ``accepted`` overloads (roles above) with arguments the table allows."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in accepted:
        return False
    return not _pinned_mismatch(node)


def unaccepted_use(node: Any) -> str:
    """For an op the table knows by name, what keeps this call of it out ('' if nothing or not known).

    Used for the refusal's detail, e.g. ``aten.add.Tensor with alpha=0.5``.
    """
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return ""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is None or not any(o.overloadpacket is packet for o in TABLE):
        return ""
    if node.target not in TABLE:
        return f"{node.target} (an overload the pass does not accept)"
    mismatch = _pinned_mismatch(node)
    return f"{node.target} with {mismatch}" if mismatch else ""


_WIDER = {
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def widens(source: torch.dtype, target: torch.dtype) -> bool:
    """A cast from ``source`` to ``target`` keeps every value (the same dtype, or a wider float)."""
    return source == target or target in _WIDER.get(source, ())
