"""Ring attention (context parallel) on 1, 2 and 3 CPU ranks (gloo) against the op on the full sequence."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from tests.distributed import ring_cases  # noqa: E402
from tests.distributed.launch import run_ranks  # noqa: E402

WORLD_SIZES = (1, 2, 3)


@pytest.fixture(scope="module")
def results():
    return {n: run_ranks(ring_cases.run_all, n, timeout_s=300) for n in WORLD_SIZES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", [c.__name__ for c in ring_cases.CASES])
def test_ring_attention(case, world_size, results):
    for rank, per_case in enumerate(results[world_size]):
        assert per_case[case] is None, f"rank {rank} of {world_size}:\n{per_case[case]}"


def test_causal_needs_an_even_local_length():
    from fa2_inductor.distributed import ring_attention

    q = torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="load-balanced"):
        ring_attention(q, q, q, is_causal=True)
