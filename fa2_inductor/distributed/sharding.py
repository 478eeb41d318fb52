"""DTensor sharding rules for ``fa2_inductor::flash_attention_fwd`` and ``flash_attention_bwd``.

Attention is independent across batch elements and across query heads, so the op runs on local shards,
without communication, when its inputs are sharded along the batch dim or the head dim:

- batch: every tensor ``Shard(0)``; the outputs too.
- heads: q (and grad_out, out, lse) ``Shard(1)``; K/V ``Shard(1)`` when the shard count divides Hkv, so
  each shard's query heads meet exactly their own K/V heads (GQA groups stay whole); with a single K/V
  head (MQA) K/V stay replicated and their gradients come back ``Partial("sum")``.
- the mask follows the sharded dim where it has that dim at full size; where it broadcasts (size 1, or
  fewer dims) it stays replicated, and its gradient comes back ``Partial("sum")``.
- the sinks ([Hq]) follow the query heads: ``Shard(0)`` when heads are split, else replicated, their
  gradient ``Partial("sum")`` when the batch is split.
- everything replicated is always accepted, so any other placement (sequence-sharded, head-dim-sharded,
  partial, inconsistent GQA heads) is redistributed by DTensor to the cheapest of these instead of failing.

The rules read the op's schema: tensor arguments are known by name (an unknown tensor argument is an
error at registration, so a schema change cannot silently get a wrong rule), and every non-tensor argument
(scale, is_causal, and whatever trailing options the op grows) is part of DTensor's cache key.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

BATCH_DIM, HEAD_DIM = 0, 1

# What each tensor argument is, by its name in the schema: laid out like q ([B, Hq, ...]), like k/v
# ([B, Hkv, ...]), or the mask (broadcastable to [B, Hq, Sq, Sk]).
_QUERY_LIKE = frozenset({"q", "grad_out", "out", "lse"})
_KEY_LIKE = frozenset({"k", "v"})
_MASK = "attn_mask"
_SINKS = "sinks"
# The outputs, in order: (out, lse) and (dq, dk, dv, dmask, dsinks).
_OUTPUT_ROLES = {
    "flash_attention_fwd": ("query", "query"),
    "flash_attention_bwd": ("query", "key", "key", "mask_grad", "sinks_grad"),
}

# The ways one mesh dim may split the work: all replicated, by batch, by heads with K/V split alike,
# by query heads with a single K/V head replicated (MQA).
_REPLICATE, _BATCH, _HEADS, _QUERY_HEADS = "replicate", "batch", "heads", "query_heads"


def _is_tensor_argument(argument) -> bool:
    kind = argument.type
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


def _role(name: str) -> str:
    if name in _QUERY_LIKE:
        return "query"
    if name in _KEY_LIKE:
        return "key"
    if name == _MASK:
        return "mask"
    if name == _SINKS:
        return "sinks"
    raise NotImplementedError(f"fa2_inductor sharding rules: no rule for the op's tensor argument {name!r}")


class _Call:
    """One call's arguments, read through the schema (positional, keyword or default)."""

    def __init__(self, op_schema: OpSchema):
        self.schema = op_schema.op._schema
        self.args = op_schema.args_schema
        self.kwargs = op_schema.kwargs_schema

    def get(self, name: str):
        for i, argument in enumerate(self.schema.arguments):
            if argument.name == name:
                if i < len(self.args):
                    return self.args[i]
                if name in self.kwargs:
                    return self.kwargs[name]
                return argument.default_value if argument.has_default_value() else None
        raise KeyError(name)

    def tensor_names(self) -> list[str]:
        """The names of the tensor arguments present, in the order DTensor lists their strategies."""
        by_position = [
            a.name for i, a in enumerate(self.schema.arguments) if i < len(self.args) and isinstance(self.args[i], OpStrategy)
        ]
        by_keyword = [name for name, value in self.kwargs.items() if isinstance(value, OpStrategy)]
        return by_position + by_keyword

    def shape(self, name: str) -> Optional[torch.Size]:
        """The tensor argument's shape; None when it is not given (or the op has no such argument)."""
        if all(a.name != name for a in self.schema.arguments):
            return None
        value = self.get(name)
        return value.shape if isinstance(value, OpStrategy) else None


def _mask_placement(mask_shape: Optional[torch.Size], dim: int, full_size: int):
    """Where the mask goes when q is sharded along ``dim`` of [B, Hq, Sq, Sk]: Shard of the mask's own
    matching dim when it has that dim at full size, else None (it broadcasts along ``dim``)."""
    if mask_shape is None:
        return None
    mask_dim = len(mask_shape) - 4 + dim
    if mask_dim < 0 or mask_shape[mask_dim] == 1 or full_size == 1:
        return None
    return Shard(mask_dim)


def _placements(call: _Call, kind: str, output_roles: tuple) -> list:
    """Outputs' then tensor inputs' placements for one mesh dim under one way of splitting the work."""
    q_shape = call.shape("q")
    mask_shape = call.shape(_MASK)
    if kind == _REPLICATE:
        query = key = key_grad = Replicate()
        mask = Replicate()
        mask_grad = Replicate()
        sinks = sinks_grad = Replicate()
    else:
        dim = BATCH_DIM if kind == _BATCH else HEAD_DIM
        query = Shard(dim)
        key = Replicate() if kind == _QUERY_HEADS else Shard(dim)
        key_grad = Partial() if kind == _QUERY_HEADS else Shard(dim)
        mask_shard = _mask_placement(mask_shape, dim, q_shape[dim])
        mask = mask_shard or Replicate()
        mask_grad = mask_shard or Partial()
        sinks = Replicate() if kind == _BATCH else Shard(0)
        sinks_grad = Partial() if kind == _BATCH else Shard(0)
    if "mask_grad" in output_roles and (mask_shape is None or not call.get("compute_mask_grad")):
        mask_grad = Replicate()  # the op returns an empty placeholder
    if call.shape(_SINKS) is None:
        sinks_grad = Replicate()  # likewise
    by_output_role = {"query": query, "key": key_grad, "mask_grad": mask_grad, "sinks_grad": sinks_grad}
    by_input_role = {"query": query, "key": key, "mask": mask, "sinks": sinks}
    return [by_output_role[role] for role in output_roles] + [by_input_role[_role(n)] for n in call.tensor_names()]


def _shard_count(spec, dim: int) -> int:
    return math.prod(spec.mesh.size(i) for i, p in enumerate(spec.placements) if p.is_shard(dim))


def _heads_stay_grouped(call: _Call):
    """A check of one candidate: every shard's query heads meet exactly the K/V heads they attend to."""
    names = call.tensor_names()
    q_index, k_index = names.index("q"), names.index("k")
    kv_heads = call.shape("k")[HEAD_DIM]

    def check(input_specs) -> bool:
        q_shards = _shard_count(input_specs[q_index], HEAD_DIM)
        k_shards = _shard_count(input_specs[k_index], HEAD_DIM)
        if k_shards == 1:
            return q_shards == 1 or kv_heads == 1
        return k_shards == q_shards and kv_heads % k_shards == 0

    return check


def _strategy(output_roles: tuple, op_schema: OpSchema) -> OpStrategy:
    call = _Call(op_schema)
    kinds = [_REPLICATE, _BATCH, _HEADS]
    if call.shape("k")[HEAD_DIM] == 1:
        kinds.append(_QUERY_HEADS)
    strategy = expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(validate=False),
        op_schema,
        [_placements(call, kind, output_roles) for kind in kinds],
        input_index=len(output_roles),
    )
    # Filtered here rather than through the expansion's callback, whose name differs between torch versions.
    keep = _heads_stay_grouped(call)
    strategy.strategies[:] = [spec for spec in strategy.strategies if keep(spec.input_specs)]
    return strategy


def _schema_info(op: torch._ops.OpOverload) -> RuntimeSchemaInfo:
    """Every non-tensor argument is part of DTensor's cache key (compute_mask_grad decides the dmask output;
    the rest is cheap to hash and keeps future options safe): all arguments from the first non-tensor one
    on (a tensor among them, e.g. sinks, is keyed by its placement anyway), and every non-tensor keyword."""
    arguments = op._schema.arguments
    for argument in arguments:
        if _is_tensor_argument(argument):
            _role(argument.name)  # fails now for a tensor argument the rules do not know
    first_static = next(i for i, a in enumerate(arguments) if not _is_tensor_argument(a))
    return RuntimeSchemaInfo(static_argnum=first_static,
                             static_kwargkey=[a.name for a in arguments[first_static:] if not _is_tensor_argument(a)])


def register_attention_op(op: torch._ops.OpOverload, output_roles: tuple) -> None:
    """Gives DTensor the rules for one attention op whose outputs are ``output_roles`` (see _OUTPUT_ROLES)."""
    register_op_strategy(op, schema_info=_schema_info(op))(functools.partial(_strategy, output_roles))


def register() -> None:
    """Registers the rules of both ops with DTensor (idempotent: a second registration replaces the first)."""
    import fa2_inductor.ops  # noqa: F401  (defines the ops)

    for name, output_roles in _OUTPUT_ROLES.items():
        register_attention_op(getattr(torch.ops.fa2_inductor, name).default, output_roles)
