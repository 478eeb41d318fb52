"""Small kernel calls for compute-sanitizer: every compiled kernel kind on shapes with ragged tails.

    compute-sanitizer --tool memcheck python scripts/sanitize_cases.py [--all-dtypes]
    compute-sanitizer --tool racecheck python scripts/sanitize_cases.py

For each compiled head dim (bf16 only unless --all-dtypes): no mask and causal, a bool mask and an
additive mask, with GQA (4 query heads on 2 KV heads), Sq = 200 and Sk = 135 (neither a multiple of a
tile) and strided [B, S, H, D] inputs; then decode steps (the split-KV kernel): one and 5 query rows against
135 keys (several splits, a combine) and 40 (one split), with no mask and a static cache's key mask (a
filled prefix), and one query row against 4200 keys in one split (FA2_INDUCTOR_DECODE_SPLITS=1: an unmasked
split walks 66 blocks, past one 64-block window; the masked call then takes the two splits its scan needs).
Each call goes through the public op; the run fails if any call fell back to the reference (the kernel would
not have been checked) or gave a non-finite output.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch
from torch._dynamo.utils import counters

import fa2_inductor  # noqa: F401  (registers the op)
from fa2_inductor import _extension
from fa2_inductor.bench.decode import SPLITS_VARIABLE

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH, Q_HEADS, KV_HEADS, SEQ_Q, SEQ_K = 1, 4, 2, 200, 135
# (Sq, Sk, forced split count or None): several splits and a combine; one split; one split of 66 blocks
DECODE_SHAPES = ((1, 135, None), (5, 135, None), (1, 40, None), (1, 4200, 1))


def _bshd(seqlen: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A [B, H, S, D] view of a [B, S, H, D] buffer: the strided layout models hand to attention."""
    return torch.randn(BATCH, seqlen, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)


def _masks(dtype: torch.dtype) -> dict:
    keep = torch.rand(BATCH, 1, SEQ_Q, SEQ_K, device="cuda") < 0.7
    keep[..., 0] = True  # no fully masked row: those take a separate path, covered by tests/gpu
    bias = torch.randn(1, Q_HEADS, SEQ_Q, SEQ_K, device="cuda").masked_fill(~keep, float("-inf"))
    return {"no mask": None, "bool mask": keep, "additive mask": bias.to(dtype)}


def _cases(head_dim: int, dtype: torch.dtype) -> list:
    """(name, q, k, v, mask, is_causal, forced decode splits or None) of every call to check at one head dim and
    dtype."""
    q = _bshd(SEQ_Q, Q_HEADS, head_dim, dtype)
    k, v = (_bshd(SEQ_K, KV_HEADS, head_dim, dtype) for _ in range(2))
    cases = [(name, q, k, v, mask, False, None) for name, mask in _masks(dtype).items()]
    cases += [("causal", q, k, v, None, True, None)]
    for seq_q, seq_k, splits in DECODE_SHAPES:
        dq = _bshd(seq_q, Q_HEADS, head_dim, dtype)
        dk, dv = (_bshd(seq_k, KV_HEADS, head_dim, dtype) for _ in range(2))
        filled = torch.arange(seq_k, device="cuda").view(1, 1, 1, seq_k) < seq_k * 2 // 3
        named = f"decode Sq={seq_q} Sk={seq_k}" + (f" splits={splits}" if splits else "")
        cases += [(named, dq, dk, dv, None, False, splits),
                  (f"{named} static cache", dq, dk, dv, filled, False, splits)]
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all-dtypes", action="store_true", help="fp16 kernels too (twice the calls)")
    args = parser.parse_args()
    if _extension.C is None or not torch.cuda.is_available():
        print(f"nothing to check: {_extension.status}; CUDA available: {torch.cuda.is_available()}")
        return 1
    op = torch.ops.fa2_inductor.flash_attention_fwd
    failed = False
    for head_dim, dtype_name in sorted(_extension.C.compiled_kernels()):
        if dtype_name != "bf16" and not args.all_dtypes:
            continue
        for name, q, k, v, mask, causal, splits in _cases(head_dim, DTYPES[dtype_name]):
            counters.clear()
            with mock.patch.dict(os.environ, {SPLITS_VARIABLE: str(splits)} if splits else {}):
                out, _ = op(q, k, v, mask, head_dim**-0.5, causal)
            torch.cuda.synchronize()
            fallbacks = {key: n for key, n in counters["fa2_inductor"].items() if key.startswith("reference_fallback")}
            finite = bool(out.isfinite().all())
            ok = finite and not fallbacks
            failed |= not ok
            print(f"hdim{head_dim} {dtype_name} {name}: {'ok' if ok else 'FAILED'} "
                  f"(finite={finite}{', reference fallback: ' + str(fallbacks) if fallbacks else ''})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
