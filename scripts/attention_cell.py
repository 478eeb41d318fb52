"""One cell of `python -m fa2_inductor.bench` (its FlashAttention-paper shapes: batch·seqlen and
heads·head_dim fixed), run by fa2_inductor and then by SDPA's cuDNN backend, a few calls each: a workload to
profile, e.g. with Nsight Compute beside cuDNN (scripts/hopper_check.sh's ncu stage):

    ncu --kernel-name regex:'fwd_kernel|fprop' --launch-skip 2 --launch-count 4 \\
        python scripts/attention_cell.py --head-dim 64 --seqlen 512 --causal

profiles the last two of our four calls and the first two of cuDNN's. With --backward each call is a
forward and a backward (our main backward kernel is `bwd_kernel_sm90`, cuDNN's names hold `bprop`).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2_inductor
from fa2_inductor.bench import DTYPES, PAPER_HIDDEN, PAPER_TOKENS, sweep_cells


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--seqlen", type=int, required=True)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--backward", action="store_true", help="each call runs the backward too")
    parser.add_argument("--calls", type=int, default=4, help="calls of each implementation (default 4)")
    parser.add_argument("--tokens", type=int, default=PAPER_TOKENS, help=f"batch·seqlen (default {PAPER_TOKENS})")
    parser.add_argument("--hidden", type=int, default=PAPER_HIDDEN, help=f"heads·head_dim (default {PAPER_HIDDEN})")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_cell.py needs a CUDA GPU (it runs the kernels to be profiled)")
        return 2
    (cell,) = sweep_cells([args.seqlen], [args.head_dim], [args.dtype], [args.causal], args.tokens, args.hidden)
    q, k, v = (torch.randn(cell.batch, cell.heads, cell.seqlen, cell.head_dim, device="cuda",
                           dtype=DTYPES[args.dtype], requires_grad=args.backward) for _ in range(3))
    grad_out = torch.randn_like(q)

    def call(attention) -> None:
        out = attention(q, k, v, is_causal=args.causal)
        if args.backward:
            torch.autograd.grad(out, (q, k, v), grad_out)

    print(f"{args.dtype} {'causal' if args.causal else 'non-causal'} d{cell.head_dim} seqlen {cell.seqlen}"
          f"{', forward and backward' if args.backward else ''}: "
          f"batch {cell.batch}, heads {cell.heads}; {args.calls} calls of fa2_inductor, then of cuDNN")
    for _ in range(args.calls):
        call(fa2_inductor.flash_attention)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(args.calls):
            call(F.scaled_dot_product_attention)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
