"""Context parallel on N GPUs: ring attention on the fa2_inductor op against SDPA under PyTorch's own
context parallel (``torch.distributed.tensor.experimental.context_parallel``), in the same run.

    torchrun --nproc-per-node 2 -m fa2_inductor.distributed.bench_cp --out cp_2.json

1. Accuracy at a moderate length: forward and backward of ring attention (every rank's slice, gathered) and of
   the op on the whole sequence on one GPU, both against float32 math; the ring must stay within 2x the
   one-GPU error (plus bf16 rounding).
2. Speed at long contexts (default 32k, 64k, 128k tokens, causal, bf16): causal attention forward + backward
   per second, as tokens/s of the whole sequence, for ours and for PyTorch's context parallel SDPA (its
   head-tail load balancing is the same layout as ``shard_sequence``), and for the op alone on one GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fa2_inductor
from fa2_inductor.distributed.ring import gather_sequence, ring_attention, shard_sequence


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _inputs(seq: int, heads: int, head_dim: int, dtype, seed=0):
    """q, k, v, grad_out [1, heads, seq, head_dim], the same on every rank."""
    gen = torch.Generator(device=_device()).manual_seed(seed)
    return [torch.randn(1, heads, seq, head_dim, device=_device(), dtype=dtype, generator=gen) for _ in range(4)]


def _relative_error(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def _forward_backward(fn, q, k, v, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def accuracy(seq: int, heads: int, head_dim: int) -> dict:
    """Relative errors of (out, dq, dk, dv) against float32 math: ring on all ranks vs the op on one GPU
    (on CPU ranks too: the op's reference path)."""
    q, k, v, grad_out = _inputs(seq, heads, head_dim, torch.bfloat16)
    exact = _forward_backward(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q.float(), k.float(), v.float(), grad_out.float()
    )
    one_gpu = _forward_backward(lambda q, k, v: fa2_inductor.flash_attention(q, k, v, is_causal=True), q, k, v, grad_out)
    local = [shard_sequence(t) for t in (q, k, v, grad_out)]
    ring = _forward_backward(lambda q, k, v: ring_attention(q, k, v, is_causal=True), *local)
    ring = [gather_sequence(t) for t in ring]
    names = ("out", "dq", "dk", "dv")
    return {
        name: {"ring": _relative_error(r, e), "one_gpu": _relative_error(o, e)}
        for name, r, o, e in zip(names, ring, one_gpu, exact)
    }


def _time(fn, warmup: int, iters: int, all_ranks: bool = True) -> float:
    """Median seconds of fn() over iters runs; with all_ranks, every rank runs it and they start together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if all_ranks:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def speed(seq: int, heads: int, head_dim: int, warmup: int, iters: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v, grad_out = _inputs(seq, heads, head_dim, torch.bfloat16)
    local = [shard_sequence(t) for t in (q, k, v, grad_out)]
    ours = _time(lambda: _forward_backward(lambda q, k, v: ring_attention(q, k, v, is_causal=True), *local), warmup, iters)

    theirs = agreement = error = None
    try:
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        buffers = [t.clone() for t in (q, k, v, grad_out)]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
            sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            theirs = _time(functools.partial(_forward_backward, sdpa, *buffers), warmup, iters)
            cp_out = _forward_backward(sdpa, *buffers)[0]
        # Same head-tail layout on both sides: the local outputs agree up to rounding.
        with torch.no_grad():
            agreement = _relative_error(ring_attention(*local[:3], is_causal=True), cp_out)
        del buffers, cp_out
    except Exception as e:  # PyTorch's context parallel is experimental: keep our numbers if it fails
        error = f"{type(e).__name__}: {e}"[:500]

    one_gpu = None
    if dist.get_rank() == 0:
        one_gpu = _time(
            lambda: _forward_backward(lambda q, k, v: fa2_inductor.flash_attention(q, k, v, is_causal=True), q, k, v, grad_out),
            warmup, iters, all_ranks=False,
        )
    dist.barrier()
    return {
        "seq": seq,
        "ring_fa2_inductor_s": ours,
        "torch_cp_sdpa_s": theirs,
        "torch_cp_error": error,
        "one_gpu_fa2_inductor_s": one_gpu,
        "ring_vs_torch_cp_out_rel_diff": agreement,
    }


def table(result: dict) -> str:
    n, c = result["world_size"], result["config"]
    lines = [
        f"Context parallel on {n} GPUs: causal attention forward + backward, bf16, {c['heads']} heads x {c['head_dim']}, "
        "tokens/s of the whole sequence",
        "tokens | ring on fa2_inductor (ours) | PyTorch CP + SDPA | speedup | one GPU, fa2_inductor | out rel. diff ours vs PyTorch CP",
    ]
    for row in result["speed"]:
        seq, ours, theirs, one = row["seq"], row["ring_fa2_inductor_s"], row["torch_cp_sdpa_s"], row["one_gpu_fa2_inductor_s"]
        if theirs is None:
            lines.append(f"{seq} | {seq / ours:,.0f} | failed: {row['torch_cp_error']} | - | {seq / one:,.0f} | -")
            continue
        lines.append(
            f"{seq} | {seq / ours:,.0f} | {seq / theirs:,.0f} | {theirs / ours:.2f}x | {seq / one:,.0f} | "
            f"{row['ring_vs_torch_cp_out_rel_diff']:.1e}"
        )
    lines.append(f"accuracy at {c['accuracy_seq']} tokens (relative error vs float32 math): ring | one GPU")
    for name, errors in result["accuracy"].items():
        lines.append(f"  {name}: {errors['ring']:.2e} | {errors['one_gpu']:.2e}")
    return "\n".join(lines)


# bf16's rounding (its epsilon): the floor under the 2x rule for errors that are pure rounding.
_BF16_EPSILON = 7.9e-3


def accuracy_problems(result: dict) -> list[str]:
    return [
        f"{name}: ring error {e['ring']:.3g} > 2 x one-GPU {e['one_gpu']:.3g} + {_BF16_EPSILON}"
        for name, e in result["accuracy"].items()
        if e["ring"] > 2 * e["one_gpu"] + _BF16_EPSILON
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--accuracy-seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    try:
        result = {
            "world_size": dist.get_world_size(),
            "config": {"heads": args.heads, "head_dim": args.head_dim, "accuracy_seq": args.accuracy_seq},
            "accuracy": accuracy(args.accuracy_seq, args.heads, args.head_dim),
            "speed": [speed(s, args.heads, args.head_dim, args.warmup, args.iters) for s in args.seqs],
        }
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(table(result))
            problems = accuracy_problems(result)
            print("\n".join(problems) if problems else "ring attention accuracy: within 2x of one GPU")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
