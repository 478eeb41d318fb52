"""FSDP2 and tensor parallel with the compiled tiny Llama, on 2 ranks, against 1 rank / 1 device.

On 2+ CUDA GPUs (NCCL, bf16) they always run. On CPU (gloo, float32, config.rewrite_on_cpu) they compile the
model once per process, which takes minutes on a small machine, so they run only with
FA2_INDUCTOR_TEST_DISTRIBUTED_CPU=1.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from tests.distributed import llama_flows, report  # noqa: E402
from tests.distributed.launch import run_ranks  # noqa: E402


def _devices():
    cpu_skip = pytest.mark.skipif(
        os.environ.get("FA2_INDUCTOR_TEST_DISTRIBUTED_CPU") != "1" or not dist.is_gloo_available(),
        reason="multi-process compile on CPU is slow: set FA2_INDUCTOR_TEST_DISTRIBUTED_CPU=1",
    )
    cuda_skip = pytest.mark.skipif(
        torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 CUDA GPUs and NCCL"
    )
    return [pytest.param("cpu", marks=cpu_skip), pytest.param("cuda", marks=cuda_skip)]


def _launch(flow, world_size, device_type):
    ranks = run_ranks(llama_flows.FLOWS[flow], world_size, device_type, device_type=device_type, timeout_s=1200)
    return {"flow": flow, "world_size": world_size, "ranks": ranks}


@pytest.mark.parametrize("device_type", _devices())
def test_fsdp2_training_matches_one_rank(device_type):
    one_rank = _launch("fsdp2", 1, device_type)
    two_ranks = _launch("fsdp2", 2, device_type)
    print(report.fsdp2_table(one_rank, two_ranks), report.counters_table(two_ranks, "FSDP2"), sep="\n")
    assert report.fsdp2_problems(one_rank, two_ranks) == []


@pytest.mark.parametrize("device_type", _devices())
def test_tensor_parallel_matches_one_device(device_type):
    result = _launch("tp", 2, device_type)
    print(report.tp_table(result), report.counters_table(result, "TP"), sep="\n")
    assert result["ranks"][0]["local_query_heads"] == llama_flows.FAMILIES["llama"].make_config(64).num_attention_heads // 2
    assert report.tp_problems(result) == []
