"""Same-run timing of the fa2_inductor kernel against SDPA's FLASH and cuDNN backends.

Shapes follow the project's target: batch*seqlen = 16384, heads*head_dim = 2048. Median of CUDA-event
timings after warm-up; inputs rotate among several sets so L2 does not hold them. Prints a table and
writes JSON to argv[1] if given. Temporary until fa2_inductor.bench exists.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa2_inductor import _cuda

SEQLENS = [int(s) for s in (sys.argv[2].split(",") if len(sys.argv) > 2 else "512,1024,2048,4096,8192,16384".split(","))]
import os

HEAD_DIMS = [int(x) for x in os.environ.get("TIMING_HEAD_DIMS", "64,128,256").split(",")]
DTYPES = {k: v for k, v in {"bf16": torch.bfloat16, "fp16": torch.float16}.items()
          if k in os.environ.get("TIMING_DTYPES", "bf16,fp16").split(",")}
IMPLS = os.environ.get("TIMING_IMPLS", "ours,flash,cudnn").split(",")


def median_ms(fn, reps=20, warmup=5):
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def main():
    rows = []
    for dt_name, dtype in DTYPES.items():
        for d in HEAD_DIMS:
            for causal in (False, True):
                for s in SEQLENS:
                    b, h = 16384 // s, 2048 // d
                    sets = []
                    for _ in range(3):
                        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
                        sets.append((q, k, v))
                    out = torch.empty(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
                    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
                    scale = 1.0 / math.sqrt(d)
                    it = [0]

                    def nxt():
                        it[0] = (it[0] + 1) % len(sets)
                        return sets[it[0]]

                    def ours():
                        q, k, v = nxt()
                        _cuda.forward(q, k, v, scale, causal, out, lse)

                    def sdpa(backend):
                        def run():
                            q, k, v = nxt()
                            with sdpa_kernel(backend):
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
                        return run

                    q0, k0, v0 = sets[0]
                    _cuda.forward(q0, k0, v0, scale, causal, out, lse)
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        ref = F.scaled_dot_product_attention(q0, k0, v0, is_causal=causal, scale=scale)
                    maxdiff = (out.float() - ref.float()).abs().max().item()
                    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
                    res = {"dtype": dt_name, "d": d, "causal": causal, "seqlen": s, "batch": b, "heads": h,
                           "maxdiff_vs_flash": maxdiff}
                    for name, fn in (("ours", ours), ("flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                                     ("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))):
                        if name not in IMPLS:
                            res[name] = None
                            continue
                        try:
                            ms = median_ms(fn)
                            res[name] = flops / ms / 1e9
                        except Exception as exc:  # a backend may refuse a shape
                            res[name] = None
                            res[name + "_error"] = str(exc).splitlines()[0][:120]
                    rows.append(res)
                    del sets
    print(f"{'dtype':5} {'d':>4} {'causal':>6} {'seqlen':>6} {'ours':>7} {'flash':>7} {'cudnn':>7} {'x_fl':>5} {'x_cd':>5} {'maxdiff':>8}")
    for r in rows:
        f = lambda x: f"{x:7.1f}" if x else "    n/a"
        rf = r["ours"] / r["flash"] if r["ours"] and r["flash"] else float("nan")
        rc = r["ours"] / r["cudnn"] if r["ours"] and r["cudnn"] else float("nan")
        print(f"{r['dtype']:5} {r['d']:>4} {str(r['causal']):>6} {r['seqlen']:>6} {f(r['ours'])} {f(r['flash'])} {f(r['cudnn'])} {rf:5.2f} {rc:5.2f} {r['maxdiff_vs_flash']:8.1e}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
