"""Ring attention (context parallel) on CPU ranks (gloo) against the op on the full sequence.

Every case runs on the 2-rank world of the shared launch (conftest.two_cpu_ranks) and on each rank alone; with
FA2_INDUCTOR_TEST_DISTRIBUTED_CPU=1 also on a 3-rank world and on a group of its last two ranks (global ranks
that differ from group ranks).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from tests.distributed import ring_cases  # noqa: E402
from tests.distributed.launch import run_ranks  # noqa: E402

CASE_NAMES = [c.__name__ for c in ring_cases.CASES]


def _assert_passed(results_per_rank: list, key: str) -> None:
    ran = [rank for rank, results in enumerate(results_per_rank) if key in results]
    assert ran, f"{key} ran on no rank"
    for rank in ran:
        assert results_per_rank[rank][key] is None, f"rank {rank}:\n{results_per_rank[rank][key]}"


@pytest.mark.parametrize("group", ("world", "alone"))
@pytest.mark.parametrize("case", CASE_NAMES)
def test_ring_attention_two_ranks(case, group, two_cpu_ranks):
    _assert_passed([r["ring"] for r in two_cpu_ranks], f"{case}@{group}")


@pytest.fixture(scope="module")
def three_cpu_ranks():
    if os.environ.get("FA2_INDUCTOR_TEST_DISTRIBUTED_CPU") != "1":
        pytest.skip("another 3-process launch: set FA2_INDUCTOR_TEST_DISTRIBUTED_CPU=1")
    return run_ranks(ring_cases.run_all, 3, timeout_s=300)


@pytest.mark.parametrize("group", ("world", "last_two"))
@pytest.mark.parametrize("case", CASE_NAMES)
def test_ring_attention_three_ranks(case, group, three_cpu_ranks):
    _assert_passed(three_cpu_ranks, f"{case}@{group}")


def test_causal_needs_an_even_local_length():
    from fa2_inductor.distributed import ring_attention

    q = torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="load-balanced"):
        ring_attention(q, q, q, is_causal=True)
