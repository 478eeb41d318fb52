"""Ring attention on 2 GPUs (NCCL, bf16, the Hopper kernel where built) against the op on one GPU.

Forward and backward of every rank's slice, gathered, are compared with float32 math next to the one-GPU
op: within 2x its error plus bf16 rounding (fa2_inductor.distributed.bench_cp.accuracy_problems).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

if torch.cuda.device_count() < 2 or not (dist.is_available() and dist.is_nccl_available()):
    pytest.skip("needs 2 CUDA GPUs and NCCL", allow_module_level=True)

from fa2_inductor.distributed import bench_cp  # noqa: E402
from tests.distributed.launch import run_ranks  # noqa: E402


def _accuracy(rank: int, world_size: int, seq: int, heads: int, head_dim: int) -> dict:
    return bench_cp.accuracy(seq, heads, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq", [1024, 4096 + 4])
def test_ring_attention_matches_one_gpu(seq, head_dim):
    per_rank = run_ranks(_accuracy, 2, seq, 8, head_dim, device_type="cuda", timeout_s=600)
    for rank, accuracy in enumerate(per_rank):
        assert bench_cp.accuracy_problems({"accuracy": accuracy}) == [], f"rank {rank}: {accuracy}"
