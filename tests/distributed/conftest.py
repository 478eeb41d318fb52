"""One 2-rank CPU launch (gloo) shared by the sharding and ring-attention tests: starting processes costs more
than the cases themselves."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.launch import run_ranks


def run_cpu_cases(rank: int, world_size: int) -> dict:
    from tests.distributed import ring_cases, sharding_cases

    return {"sharding": sharding_cases.run_all(rank, world_size), "ring": ring_cases.run_all(rank, world_size)}


@pytest.fixture(scope="session")
def two_cpu_ranks() -> list:
    """Per rank: {"sharding": {case: error or None}, "ring": {case@group: error or None}}."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    return run_ranks(run_cpu_cases, 2, timeout_s=300)
