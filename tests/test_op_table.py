"""The table of op overloads the matchers accept: complete for this torch, and strict about arguments."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fa2_inductor.passes import op_table as ops
from fa2_inductor.passes.refusals import Refusal

aten = torch.ops.aten


def test_every_listed_overload_is_in_the_table():
    """A torch whose schema grew an argument drops that overload (refused, never guessed): say which."""
    missing = []
    for name, packet, rules in ops._SPECS:
        overload = getattr(packet, name, None) if packet is not None else None
        if overload is not None and overload not in ops.TABLE:
            missing.append(f"{overload}: schema {[a.name for a in overload._schema.arguments]}, rules {sorted(rules)}")
    assert not missing, "\n".join(missing)


def _only_call(fn, *inputs) -> torch.fx.Node:
    """The op ``fn`` calls, as a graph node (make_fx may add a detach after a view)."""
    graph = make_fx(fn)(*inputs).graph
    return next(n for n in graph.nodes if n.op == "call_function")


X = torch.randn(2, 3)

CALLS = {
    # name: (fn, the role it must (not) pass)
    "div": (lambda x: aten.div.Tensor(x, 2.0), ops.SCALE, True),
    "div_rounding_none": (lambda x: aten.div.Tensor_mode(x, x, rounding_mode=None), ops.SCALE, True),
    "div_floor": (lambda x: aten.div.Tensor_mode(x, x, rounding_mode="floor"), ops.SCALE, False),
    "div_trunc": (lambda x: aten.div.Scalar_mode(x, 2.0, rounding_mode="trunc"), ops.SCALE, False),
    "sub": (lambda x: aten.sub.Tensor(x, x), ops.SUB, True),
    "sub_alpha": (lambda x: aten.sub.Tensor(x, x, alpha=2), ops.SUB, False),
    "amax_keepdim": (lambda x: aten.amax.default(x, [-1], True), ops.AMAX, True),
    "amax_no_keepdim": (lambda x: aten.amax.default(x, [-1]), ops.AMAX, False),
    "sum_keepdim": (lambda x: aten.sum.dim_IntList(x, [-1], True), ops.SUM, True),
    "sum_dtype": (lambda x: aten.sum.dim_IntList(x, [-1], True, dtype=torch.float64), ops.SUM, False),
    "clone_channels_last_is_inert": (lambda x: aten.clone.default(x, memory_format=torch.contiguous_format), ops.IDENTITY, True),
    "view_dtype_is_no_view": (lambda x: aten.view.dtype(x, torch.int32), ops.VIEW, False),
}


@pytest.mark.parametrize("name", CALLS)
def test_calls_judges_every_argument(name):
    fn, role, accepted = CALLS[name]
    node = _only_call(fn, X)
    assert ops.calls(node, *role) is accepted
    if not accepted and node.target in ops.TABLE:
        assert ops.unaccepted_use(node).startswith(str(node.target))


def test_add_alpha_is_read_by_the_matcher():
    node = _only_call(lambda x: aten.add.Tensor(x, x, alpha=0.5), X)
    assert ops.calls(node, *ops.ADD) and ops.arg(node, "alpha") == 0.5


@pytest.mark.parametrize("source, target, widens", [
    (torch.bfloat16, torch.float32, True), (torch.float16, torch.float32, True), (torch.float32, torch.float64, True),
    (torch.float32, torch.float32, True), (torch.float32, torch.bfloat16, False), (torch.float16, torch.bfloat16, False),
    (torch.float32, torch.int32, False), (torch.bfloat16, torch.float16, False),
])
def test_widening_casts(source, target, widens):
    assert ops.widens(source, target) is widens


def test_refusal_reasons_are_their_counter_strings():
    assert "refused:" + Refusal.SOFTCAP.value == "refused:softcap"
    assert f"{Refusal.DECODE_STEP}" == str(Refusal.DECODE_STEP) == "decode_step"
    assert len({r.value for r in Refusal}) == len(Refusal) and all(r.meaning for r in Refusal)
