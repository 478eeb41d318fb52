"""Ring attention cases, run on every rank of one launch (see tests/distributed/test_ring_cpu.py).

Each case builds the same full q, k, v on every rank, runs ring attention on this rank's slice and compares the
gathered output and gradients with the op on the full tensors (float32: up to rounding).
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

import fa2_inductor
from fa2_inductor.distributed import gather_sequence, ring_attention, shard_sequence


def _check(group, *, batch=2, q_heads=4, kv_heads=2, seq_per_rank=6, head_dim=8, is_causal, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    seq = seq_per_rank * dist.get_world_size(group)
    full = [
        torch.randn(batch, heads, seq, head_dim, generator=gen, dtype=dtype)
        for heads in (q_heads, kv_heads, kv_heads)
    ]
    grad_out = torch.randn(batch, q_heads, seq, head_dim, generator=gen, dtype=dtype)

    local = [shard_sequence(t, group).requires_grad_() for t in full]
    out = ring_attention(*local, group=group, is_causal=is_causal)
    out.backward(shard_sequence(grad_out, group))
    got = [gather_sequence(t, group) for t in [out.detach()] + [t.grad for t in local]]

    ref_inputs = [t.clone().requires_grad_() for t in full]
    ref_out = fa2_inductor.flash_attention(*ref_inputs, is_causal=is_causal)
    ref_out.backward(grad_out)
    want = [ref_out.detach()] + [t.grad for t in ref_inputs]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


def causal_gqa(group):
    _check(group, is_causal=True)


def non_causal_gqa(group):
    _check(group, is_causal=False)


def causal_mqa(group):
    _check(group, q_heads=4, kv_heads=1, is_causal=True)


def causal_wider_heads(group):
    _check(group, is_causal=True, seq_per_rank=16, head_dim=16)


def causal_long_local_slices(group):
    _check(group, batch=1, seq_per_rank=64, is_causal=True)


def inside_a_compiled_function(group):
    """torch.compile around ring attention: the ring still runs (eagerly where Dynamo cannot trace it)."""
    gen = torch.Generator().manual_seed(0)
    world_size = dist.get_world_size(group)
    full = [torch.randn(1, 2, 4 * world_size, 8, generator=gen) for _ in range(3)]
    local = [shard_sequence(t, group) for t in full]

    def attend(q, k, v):
        return ring_attention(q * 2, k, v, group=group, is_causal=True).sin()

    q = local[0].clone().requires_grad_()
    torch._dynamo.reset()  # Dynamo does not guard on the process group a compiled function closes over
    out = torch.compile(attend, backend="aot_eager")(q, *local[1:])
    out.sum().backward()
    ref_q = local[0].clone().requires_grad_()
    ref = attend(ref_q, *local[1:])
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(q.grad, ref_q.grad)


def bf16_within_twice_the_one_device_error(group):
    """The benchmark's accuracy check (bf16, against float32 math) on these ranks, default group only."""
    from fa2_inductor.distributed import bench_cp

    if group is dist.group.WORLD:
        errors = bench_cp.accuracy(seq=8 * dist.get_world_size(), heads=2, head_dim=16)
        assert bench_cp.accuracy_problems({"accuracy": errors}) == [], errors


CASES = [inside_a_compiled_function, bf16_within_twice_the_one_device_error, causal_gqa, non_causal_gqa, causal_mqa, causal_wider_heads, causal_long_local_slices]


def groups(rank: int, world_size: int) -> dict:
    """The process groups every case runs on: the whole world, each rank alone, and with more than 2 ranks the
    last two (global ranks that are not group ranks). Every rank creates every group, in the same order."""
    named = {"world": dist.group.WORLD}
    if world_size > 2:
        last_two = dist.new_group([world_size - 2, world_size - 1])
        if rank >= world_size - 2:
            named["last_two"] = last_two
    for r in range(world_size):
        group = dist.new_group([r])
        if r == rank:
            named["alone"] = group
    return named


def run_all(rank: int, world_size: int) -> dict:
    """{"case@group": None if it passed, else the traceback} for the groups this rank belongs to."""
    results = {}
    for group_name, group in groups(rank, world_size).items():
        for case in CASES:
            try:
                case(group)
                results[f"{case.__name__}@{group_name}"] = None
            except Exception:
                results[f"{case.__name__}@{group_name}"] = traceback.format_exc()
    dist.barrier()
    return results
