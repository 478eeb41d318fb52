"""Small kernel calls for compute-sanitizer (memcheck / racecheck): tails, causal, GQA, strides."""

import torch

from fa2_inductor import _cuda, _extension

compiled = sorted(_extension.C.compiled_kernels())
for d, name in compiled:
    if name != "bf16":
        continue
    dtype = torch.bfloat16
    for causal in (False, True):
        b, hq, hkv, sq, sk = 1, 4, 2, 200, 135
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
        out = torch.empty(b, sq, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
        lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
        _cuda.forward(q, k, v, d ** -0.5, causal, out, lse)
        torch.cuda.synchronize()
        print(f"hdim{d} causal={causal}: finite={bool(out.isfinite().all())}")
