"""The op's DTensor sharding rules on 2 CPU ranks (gloo), and their lazy registration.

One launch (conftest.two_cpu_ranks) runs every case of tests/distributed/sharding_cases.py on both ranks;
each case is reported as its own test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from tests.distributed import sharding_cases  # noqa: E402


@pytest.mark.parametrize("case", [c.__name__ for c in sharding_cases.CASES])
def test_sharding_case(case, two_cpu_ranks):
    for rank, results in enumerate(two_cpu_ranks):
        assert results["sharding"][case] is None, f"rank {rank}:\n{results['sharding'][case]}"


def _run_python(code: str) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=120)


def test_rules_registered_when_dtensor_is_imported_later():
    """Importing fa2_inductor does not load DTensor; loading DTensor afterwards registers the rules."""
    _run_python("""
        import sys
        import fa2_inductor
        assert "torch.distributed.tensor" not in sys.modules
        import torch
        from torch.distributed.tensor import DTensor
        strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
        assert torch.ops.fa2_inductor.flash_attention_fwd.default in strategies
        assert torch.ops.fa2_inductor.flash_attention_bwd.default in strategies
    """)


def test_rules_registered_when_dtensor_was_imported_first():
    _run_python("""
        import torch
        from torch.distributed.tensor import DTensor
        import fa2_inductor
        strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
        assert torch.ops.fa2_inductor.flash_attention_fwd.default in strategies
        assert torch.ops.fa2_inductor.flash_attention_bwd.default in strategies
    """)


def test_every_option_of_the_op_is_part_of_dtensors_cache_key():
    """scale, is_causal (and compute_mask_grad, which decides the dmask output) key DTensor's cached decisions."""
    import torch

    from fa2_inductor.distributed import sharding

    for op in (torch.ops.fa2_inductor.flash_attention_fwd.default, torch.ops.fa2_inductor.flash_attention_bwd.default):
        info = sharding._schema_info(op)
        non_tensor = [a.name for a in op._schema.arguments if not sharding._is_tensor_argument(a)]
        keyed_by_position = [a.name for a in op._schema.arguments[info.static_argnum :]]
        assert all(name in keyed_by_position for name in non_tensor)
        assert info.static_kwargkey == non_tensor


def test_unknown_tensor_argument_is_refused_at_registration():
    import torch

    from fa2_inductor.distributed import sharding

    lib = torch.library.Library("fa2_inductor_tests_unknown", "FRAGMENT")
    lib.define("attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor bias, float scale) -> (Tensor, Tensor)")
    op = torch.ops.fa2_inductor_tests_unknown.attention.default
    with pytest.raises(NotImplementedError, match="'bias'"):
        sharding.register_attention_op(op, ("query", "query"))
