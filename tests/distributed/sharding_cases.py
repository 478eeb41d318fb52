"""The sharding-rule cases, run on every rank of one launch (see tests/distributed/test_sharding_cpu.py).

Each case builds the same full tensors on every rank (same seed), runs the op on DTensors made from them and
compares the gathered result with the op on the full tensors. Every case makes the same collectives in the
same order on every rank (comparisons happen after the gathers), so one failing case does not derail the next.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import fa2_inductor
from fa2_inductor.distributed import sharding

FWD = torch.ops.fa2_inductor.flash_attention_fwd
SCALE = 0.3


def _inputs(batch, q_heads, kv_heads, seq_q=6, seq_k=7, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, seq_q, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq_k, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq_k, head_dim, generator=gen)
    return q, k, v


def _bool_mask(shape, seed=1):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[..., 0] = True  # every row sees a key
    return mask


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _forward(mesh, tensors, placements, mask=None, mask_placement=Replicate(), is_causal=False):
    """The op on DTensors; returns (out, lse, number of collectives the call made)."""
    q, k, v = (distribute_tensor(t, mesh, [p]) for t, p in zip(tensors, placements))
    d_mask = None if mask is None else distribute_tensor(mask, mesh, [mask_placement])
    with CommDebugMode() as comms:
        out, lse = FWD(q, k, v, d_mask, SCALE, is_causal)
    return out, lse, comms.get_total_counts()


def _check_forward(mesh, tensors, placements, expect, mask=None, mask_placement=Replicate(), is_causal=False):
    """expect: the output placement when the call must run locally, or None when it must redistribute."""
    out, lse, n_comms = _forward(mesh, tensors, placements, mask, mask_placement, is_causal)
    full_out, full_lse = _full(out), _full(lse)
    ref_out, ref_lse = FWD(*tensors, mask, SCALE, is_causal)
    torch.testing.assert_close(full_out, ref_out)
    torch.testing.assert_close(full_lse, ref_lse)
    if expect is None:
        assert n_comms > 0, "expected a redistribution"
    else:
        assert n_comms == 0, f"{n_comms} collectives for a call that should run locally"
        assert out.placements == (expect,) and lse.placements == (expect,), (out.placements, lse.placements)


def _check_backward(mesh, tensors, placements, mask=None, mask_placement=Replicate(), is_causal=False, local=True):
    """Gradients through DTensors (q, k, v and a float mask that requires grad) equal the full ones."""
    leaves = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(tensors, placements)]
    d_mask = None
    if mask is not None:
        d_mask = distribute_tensor(mask, mesh, [mask_placement]).requires_grad_(mask.requires_grad)
    out = fa2_inductor.flash_attention(*leaves, attn_mask=d_mask, scale=SCALE, is_causal=is_causal)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    d_grad_out = distribute_tensor(grad_out, mesh, out.placements)
    with CommDebugMode() as comms:
        out.backward(d_grad_out)
    grads = [_full(leaf.grad) for leaf in leaves]
    mask_grad = _full(d_mask.grad) if d_mask is not None and mask.requires_grad else None

    ref_leaves = [t.clone().requires_grad_() for t in tensors]
    ref_mask = None if mask is None else mask.detach().clone().requires_grad_(mask.requires_grad)
    ref_out = fa2_inductor.flash_attention(*ref_leaves, attn_mask=ref_mask, scale=SCALE, is_causal=is_causal)
    ref_out.backward(grad_out)
    for name, got, leaf in zip("qkv", grads, ref_leaves):
        torch.testing.assert_close(got, leaf.grad, msg=lambda m, name=name: f"d{name}: {m}")
    if mask_grad is not None:
        torch.testing.assert_close(mask_grad, ref_mask.grad)
    if local:
        assert comms.get_total_counts() == 0, f"{comms.get_total_counts()} collectives in a local backward"
    return leaves


def batch_sharded(mesh):
    _check_forward(mesh, _inputs(4, 4, 2), [Shard(0)] * 3, expect=Shard(0), is_causal=True)


def heads_sharded_gqa(mesh):
    # 4 query heads over 2 K/V heads: each rank gets 2 query heads and exactly their K/V head.
    _check_forward(mesh, _inputs(2, 4, 2), [Shard(1)] * 3, expect=Shard(1), is_causal=True)


def heads_sharded_mqa(mesh):
    # One K/V head: it stays replicated while the query heads are split.
    _check_forward(mesh, _inputs(2, 4, 1), [Shard(1), Replicate(), Replicate()], expect=Shard(1))


def odd_batch_sharded_unevenly(mesh):
    _check_forward(mesh, _inputs(3, 2, 2), [Shard(0)] * 3, expect=Shard(0))


def gqa_heads_that_cannot_split_redistribute(mesh):
    # 6 query heads over 3 K/V heads cannot be split in two without breaking a group.
    _check_forward(mesh, _inputs(2, 6, 3), [Shard(1)] * 3, expect=None)


def sequence_sharded_redistributes(mesh):
    _check_forward(mesh, _inputs(2, 4, 2, seq_q=8, seq_k=8), [Shard(2)] * 3, expect=None, is_causal=True)


def mixed_placements_redistribute(mesh):
    _check_forward(mesh, _inputs(2, 4, 2), [Shard(0), Shard(1), Replicate()], expect=None)


def mask_batch_broadcast_stays_replicated(mesh):
    # [1, Hq, Sq, Sk]: broadcast over the batch, so batch-sharded inputs use it whole.
    _check_forward(mesh, _inputs(4, 2, 2), [Shard(0)] * 3, expect=Shard(0), mask=_bool_mask((1, 2, 6, 7)))


def mask_head_broadcast_stays_replicated(mesh):
    _check_forward(mesh, _inputs(2, 4, 2), [Shard(1)] * 3, expect=Shard(1), mask=_bool_mask((2, 1, 6, 7)))


def mask_follows_batch_sharding(mesh):
    mask = _bool_mask((4, 1, 6, 7))
    _check_forward(mesh, _inputs(4, 2, 2), [Shard(0)] * 3, expect=Shard(0), mask=mask, mask_placement=Shard(0))


def mask_follows_head_sharding(mesh):
    mask = _bool_mask((4, 6, 7))  # 3-D: [Hq, Sq, Sk]
    _check_forward(mesh, _inputs(2, 4, 2), [Shard(1)] * 3, expect=Shard(1), mask=mask, mask_placement=Shard(0))


def mask_without_batch_or_head_dims(mesh):
    _check_forward(mesh, _inputs(4, 4, 2), [Shard(0)] * 3, expect=Shard(0), mask=_bool_mask((6, 7)))


def mask_sharded_along_keys_redistributes(mesh):
    mask = _bool_mask((4, 1, 6, 8))
    tensors = _inputs(4, 2, 2, seq_k=8)
    _check_forward(mesh, tensors, [Shard(0)] * 3, expect=None, mask=mask, mask_placement=Shard(3))


def backward_batch_sharded(mesh):
    _check_backward(mesh, _inputs(4, 4, 2), [Shard(0)] * 3, is_causal=True)


def backward_heads_sharded_gqa(mesh):
    _check_backward(mesh, _inputs(2, 4, 2), [Shard(1)] * 3)


def backward_heads_sharded_mqa(mesh):
    # Each rank's query heads contribute to the one K/V head: dk, dv come back as partial sums.
    leaves = _check_backward(mesh, _inputs(2, 4, 1), [Shard(1), Replicate(), Replicate()], local=False)
    assert all(isinstance(p, Partial) for p in leaves[1].grad.placements), leaves[1].grad.placements


def backward_additive_mask_broadcast_over_batch(mesh):
    # The mask's gradient sums over the batch: each rank holds its batch shard's partial sum.
    mask = torch.randn(1, 2, 6, 7, generator=torch.Generator().manual_seed(5)).requires_grad_()
    _check_backward(mesh, _inputs(4, 2, 2), [Shard(0)] * 3, mask=mask, local=False)


def backward_additive_mask_sharded_with_heads(mesh):
    mask = torch.randn(2, 4, 6, 7, generator=torch.Generator().manual_seed(5)).requires_grad_()
    _check_backward(mesh, _inputs(2, 4, 2), [Shard(1)] * 3, mask=mask, mask_placement=Shard(1))


def backward_sequence_sharded(mesh):
    _check_backward(mesh, _inputs(2, 4, 2, seq_q=8, seq_k=8), [Shard(2)] * 3, is_causal=True, local=False)


def compiled_function_on_dtensors(mesh):
    """torch.compile traces the op on DTensors: the rules run at trace time, the graph runs on local shards."""
    tensors = _inputs(4, 4, 2)
    q, k, v = (distribute_tensor(t, mesh, [Shard(0)]).requires_grad_() for t in tensors)
    attention = torch.compile(lambda q, k, v: fa2_inductor.flash_attention(q, k, v, is_causal=True), backend="aot_eager")
    out = attention(q, k, v)
    out.sum().backward()
    ref = [t.clone().requires_grad_() for t in tensors]
    ref_out = fa2_inductor.flash_attention(*ref, is_causal=True)
    ref_out.sum().backward()
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), ref_out)
    torch.testing.assert_close(q.grad.full_tensor(), ref[0].grad)


def _attention_with_options():
    """An op shaped like the attention op with trailing options (a window and a flag, as the op may grow),
    to show the rules read the schema instead of counting arguments."""
    name = "fa2_inductor_tests::attention_with_options"
    if not hasattr(torch.ops.fa2_inductor_tests, "attention_with_options"):

        @torch.library.custom_op(name, mutates_args=())
        def attention_with_options(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, scale: float,
            is_causal: bool, window: int = -1, zero_empty_rows: bool = True,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = FWD(q, k, v, attn_mask, scale, is_causal)
            return out * (2.0 if window >= 0 else 1.0), lse

        @attention_with_options.register_fake
        def _(q, k, v, attn_mask, scale, is_causal, window=-1, zero_empty_rows=True):
            return FWD(q, k, v, attn_mask, scale, is_causal)

        sharding.register_attention_op(torch.ops.fa2_inductor_tests.attention_with_options.default, ("query", "query"))
    return torch.ops.fa2_inductor_tests.attention_with_options


def trailing_options_and_keyword_mask(mesh):
    op = _attention_with_options()
    tensors = _inputs(2, 4, 2)
    mask = _bool_mask((2, 1, 6, 7))
    q, k, v = (distribute_tensor(t, mesh, [Shard(1)]) for t in tensors)
    d_mask = distribute_tensor(mask, mesh, [Replicate()])
    results = []
    with CommDebugMode() as comms:
        for window in (-1, 3):  # same placements, another option value: a cache keyed wrongly would still pass
            results.append(op(q, k, v, scale=SCALE, is_causal=False, attn_mask=d_mask, window=window))
    assert comms.get_total_counts() == 0
    full = [_full(out) for out, _ in results]
    ref = FWD(*tensors, mask, SCALE, False)[0]
    torch.testing.assert_close(full[0], ref)
    torch.testing.assert_close(full[1], 2 * ref)


CASES = [
    batch_sharded,
    heads_sharded_gqa,
    heads_sharded_mqa,
    odd_batch_sharded_unevenly,
    gqa_heads_that_cannot_split_redistribute,
    sequence_sharded_redistributes,
    mixed_placements_redistribute,
    mask_batch_broadcast_stays_replicated,
    mask_head_broadcast_stays_replicated,
    mask_follows_batch_sharding,
    mask_follows_head_sharding,
    mask_without_batch_or_head_dims,
    mask_sharded_along_keys_redistributes,
    backward_batch_sharded,
    backward_heads_sharded_gqa,
    backward_heads_sharded_mqa,
    backward_additive_mask_broadcast_over_batch,
    backward_additive_mask_sharded_with_heads,
    backward_sequence_sharded,
    compiled_function_on_dtensors,
    trailing_options_and_keyword_mask,
]


def run_all(rank: int, world_size: int) -> dict:
    """Every case on this rank: {case name: None if it passed, else the traceback}."""
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for case in CASES:
        try:
            case(mesh)
            results[case.__name__] = None
        except Exception:
            results[case.__name__] = traceback.format_exc()
        dist.barrier()
    return results
