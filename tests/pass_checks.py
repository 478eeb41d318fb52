"""Shared checks for the graph-pass tests: compile with the fa2_inductor backend on CPU and compare."""

from __future__ import annotations

import re

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

OP_IN_CODE = "torch.ops.fa2_inductor.flash_attention_fwd.default("
BWD_IN_CODE = "torch.ops.fa2_inductor.flash_attention_bwd.default("
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def pass_counts() -> dict:
    return dict(counters["fa2_inductor"])


def op_calls(code: str) -> list[str]:
    """The argument lists of every forward op call in Inductor's generated code."""
    return re.findall(re.escape(OP_IN_CODE) + r"([^\n]*)\)", code)


def compile_and_compare(fn, *inputs, rewrites: int, train: bool = False, dynamic=None, backend="fa2_inductor"):
    """Compiles ``fn``, checks the rewrite count, the op in the code, and outputs (and grads) against eager.

    Returns the generated code so callers can check the op's arguments.
    """
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    got, code = run_and_get_code(compiled, *inputs)
    code = "\n".join(code)
    assert counters["fa2_inductor"]["rewrites"] == rewrites, pass_counts()
    forms = sum(n for key, n in counters["fa2_inductor"].items() if key.startswith("rewrites:"))
    assert forms == rewrites, pass_counts()  # each rewrite is counted once by the kernel form it runs
    assert (OP_IN_CODE in code) == (rewrites > 0)
    expected = fn(*inputs)
    tol = TOLERANCE[inputs[0].dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    if train:
        if isinstance(got, tuple):  # gradients through the first output (the attention output)
            got, expected = got[0], expected[0]
        grad = torch.randn_like(expected)
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        got_grads = torch.autograd.grad(got, leaves, grad)
        expected_grads = torch.autograd.grad(expected, leaves, grad)
        for g, e in zip(got_grads, expected_grads):
            torch.testing.assert_close(g, e, atol=tol * 4, rtol=tol * 4)
    return code


def qkv(batch=2, heads=4, seq_q=8, seq_k=None, dim=16, kv_heads=None, dtype=torch.float32, train=False, bshd=False,
        device="cpu"):
    """Random q, k, v ([B, H, S, D], or [B, S, H, D] with bshd)."""
    seq_k = seq_q if seq_k is None else seq_k
    kv_heads = heads if kv_heads is None else kv_heads
    torch.manual_seed(0)

    def make(h, s):
        shape = (batch, s, h, dim) if bshd else (batch, h, s, dim)
        return torch.randn(shape, dtype=dtype).to(device).requires_grad_(train)

    return make(heads, seq_q), make(kv_heads, seq_k), make(kv_heads, seq_k)


def _eager_graphs(gm, example_inputs, **kwargs):
    """Inductor's inner compile replaced by running the (post-pass) graph with eager kernels."""
    from torch._functorch._aot_autograd.utils import make_boxed_func

    return make_boxed_func(gm.forward)


def graph_passes_backend(gm, example_inputs):
    """The fa2_inductor backend up to its graphs: Inductor's decompositions and joint-graph passes with ours,
    then the graphs run eagerly. A fraction of a second per compile: what the pass decides, without codegen."""
    from torch._inductor.compile_fx import compile_fx

    from fa2_inductor.passes import with_attention_pass

    hook = with_attention_pass(torch._inductor.config.joint_custom_pre_pass)
    with torch._inductor.config.patch(joint_custom_pre_pass=hook):
        return compile_fx(gm, example_inputs, inner_compile=_eager_graphs)
