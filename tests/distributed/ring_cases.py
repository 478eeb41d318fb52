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


def _check(world_size, *, batch=2, q_heads=4, kv_heads=2, seq_per_rank=6, head_dim=8, is_causal, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    seq = seq_per_rank * world_size
    full = [
        torch.randn(batch, heads, seq, head_dim, generator=gen, dtype=dtype)
        for heads in (q_heads, kv_heads, kv_heads)
    ]
    grad_out = torch.randn(batch, q_heads, seq, head_dim, generator=gen, dtype=dtype)

    local = [shard_sequence(t).requires_grad_() for t in full]
    out = ring_attention(*local, is_causal=is_causal)
    out.backward(shard_sequence(grad_out))
    got = [gather_sequence(out.detach())] + [gather_sequence(t.grad) for t in local]

    ref_inputs = [t.clone().requires_grad_() for t in full]
    ref_out = fa2_inductor.flash_attention(*ref_inputs, is_causal=is_causal)
    ref_out.backward(grad_out)
    want = [ref_out.detach()] + [t.grad for t in ref_inputs]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


def causal_gqa(world_size):
    _check(world_size, is_causal=True)


def non_causal_gqa(world_size):
    _check(world_size, is_causal=False)


def causal_mqa(world_size):
    _check(world_size, q_heads=4, kv_heads=1, is_causal=True)


def causal_wider_heads(world_size):
    _check(world_size, is_causal=True, seq_per_rank=16, head_dim=16)


def causal_long_local_slices(world_size):
    _check(world_size, batch=1, seq_per_rank=64, is_causal=True)


CASES = [causal_gqa, non_causal_gqa, causal_mqa, causal_wider_heads, causal_long_local_slices]


def run_all(rank: int, world_size: int) -> dict:
    results = {}
    for case in CASES:
        try:
            case(world_size)
            results[case.__name__] = None
        except Exception:
            results[case.__name__] = traceback.format_exc()
        dist.barrier()
    return results
