"""A tiny Hugging Face Llama (random weights, built from a config) trained under PyTorch's own parallelism and
compiled with ``backend="fa2_inductor"``: FSDP2 (``fully_shard`` per layer) and tensor parallel
(``parallelize_module``: q/k/v column-parallel, o row-parallel).

Each flow runs on every rank and returns a JSON-able dict: what the pass counted on this rank and how often
the op ran in one profiled training step (so "every attention site rewritten" is checked at run time:
every layer's attention is the op, forward and backward, and no SDPA kernel is left).

Launched by the tests (tests/distributed/launch.py) or by torchrun:
    torchrun --nproc-per-node 2 -m tests.distributed.llama_flows fsdp2 --out fsdp2_2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import fa2_inductor
from tests.hf_families import FAMILIES

LAYERS = 2
GLOBAL_BATCH = 4
SEQ = 32
STEPS = 5
LR = 1e-3
# Head dim 16 keeps CPU runs fast; on GPUs 64, a head dim the Hopper kernel is built for.
HIDDEN = {"cpu": 64, "cuda": 256}
# bf16 runs on GPUs (the kernel's dtype); CPUs run float32 with float64 as the high-precision reference.
DTYPES = {"cpu": (torch.float32, torch.float64), "cuda": (torch.bfloat16, torch.float32)}
# FSDP2 vs 1 rank: the same arithmetic, only the reduction order differs.
LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
ATTENTION_OPS = ("fa2_inductor::flash_attention_fwd", "fa2_inductor::flash_attention_bwd")
# Ops that would mean some attention was left out of the op (the loss's log_softmax is not one of them).
LEFTOVER_ATTENTION_OPS = ("aten::_softmax", "aten::softmax", "aten::_softmax_backward_data")


def device_for(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count()) if device_type == "cuda" else torch.device("cpu")


def build_llama(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The same random weights on every rank (seeded), in training mode."""
    model = FAMILIES["llama"].build("sdpa", dtype=dtype, device=device, hidden=HIDDEN[device.type], num_hidden_layers=LAYERS)
    return model.train()


def token_batch(device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 128, (GLOBAL_BATCH, SEQ), generator=gen).to(device)


@contextmanager
def compile_settings(device: torch.device):
    """The pass on CPU graphs too; Inductor's caches off so the pass really runs (and counts) in every process."""
    saved = fa2_inductor.config.rewrite_on_cpu
    fa2_inductor.config.rewrite_on_cpu = device.type == "cpu"
    torch._dynamo.reset()
    counters.clear()
    options = {"force_disable_caches": True}
    if device.type == "cpu":
        options["cpp.vec_isa_ok"] = False  # scalar C++ compiles faster; the pass sees the same graph
    try:
        with torch._inductor.config.patch(options):
            yield
    finally:
        fa2_inductor.config.rewrite_on_cpu = saved
        torch._dynamo.reset()


def pass_counters() -> dict:
    return {key: int(value) for key, value in counters["fa2_inductor"].items()}


def count_op_calls(step) -> dict:
    """How often each attention op, and any SDPA or attention-softmax op, ran during ``step()``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    calls = {}
    for event in prof.key_averages():
        if event.key in ATTENTION_OPS + LEFTOVER_ATTENTION_OPS or "scaled_dot_product" in event.key:
            calls[event.key] = calls.get(event.key, 0) + event.count
    return calls


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def fsdp2_training(rank: int, world_size: int, device_type: str) -> dict:
    """STEPS AdamW steps of the compiled model under FSDP2 (each rank trains on its slice of one global
    batch); returns the global mean loss per step, identical on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = device_for(device_type, rank)
    low, _ = DTYPES[device_type]
    mesh = init_device_mesh(device_type, (world_size,))
    model = build_llama(device, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    tokens = token_batch(device).chunk(world_size)[rank]
    losses = []
    with compile_settings(device):
        # FSDP2's usual recipe: each decoder layer compiled, then sharded. Outside the layers the model runs
        # eagerly, where transformers leaves a purely causal mask out (is_causal) instead of materialising it.
        for layer in model.model.layers:
            layer.compile(backend="fa2_inductor")
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def step():
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(_mean_over_ranks(loss))

        for _ in range(STEPS - 1):
            step()
        op_calls = count_op_calls(step)
        return {"losses": losses, "counters": pass_counters(), "op_calls": op_calls, "dtype": str(low)}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _forward_backward(model, tokens):
    output = model(input_ids=tokens, labels=tokens)
    output.loss.backward()
    return output.logits.detach()


def _full_grads(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
        for name, p in model.named_parameters()
    }


def tensor_parallel_step(rank: int, world_size: int, device_type: str) -> dict:
    """One forward and backward of the compiled model with q/k/v column-parallel and o row-parallel.

    Errors are measured against the model in high precision on one device, next to the error of the plain
    (eager, SDPA) model in the same low precision: the project's rule is that ours stays within 2x of it.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    device = device_for(device_type, rank)
    low, high = DTYPES[device_type]
    mesh = init_device_mesh(device_type, (world_size,))
    model = build_llama(device, low)
    plain = copy.deepcopy(model)
    precise = copy.deepcopy(model).to(high)
    plan = {}
    for i in range(len(model.model.layers)):
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    tokens = token_batch(device)

    with compile_settings(device):
        compiled = torch.compile(model, backend="fa2_inductor")
        logits = _forward_backward(compiled, tokens)
        model.zero_grad()
        op_calls = count_op_calls(lambda: _forward_backward(compiled, tokens))
        result_counters = pass_counters()
    plain_logits = _forward_backward(plain, tokens)
    precise_logits = _forward_backward(precise, tokens)

    grads, plain_grads, precise_grads = _full_grads(model), _full_grads(plain), _full_grads(precise)
    errors = {"logits": (_relative_error(logits, precise_logits), _relative_error(plain_logits, precise_logits))}
    for name in precise_grads:
        errors[f"grad {name}"] = (
            _relative_error(grads[name], precise_grads[name]),
            _relative_error(plain_grads[name], precise_grads[name]),
        )
    local_heads = model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] // model.config.head_dim
    return {
        "errors": errors,
        "counters": result_counters,
        "op_calls": op_calls,
        "local_query_heads": local_heads,
        "dtype": str(low),
    }


FLOWS = {"fsdp2": fsdp2_training, "tp": tensor_parallel_step}


def main() -> None:
    """Under torchrun: one flow on every rank; rank 0 writes every rank's result to --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("flow", choices=sorted(FLOWS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        result = FLOWS[args.flow](rank, world_size, args.device)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, result)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"flow": args.flow, "world_size": world_size, "ranks": per_rank}, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
