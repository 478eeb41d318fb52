"""Small backward-kernel calls for compute-sanitizer (memcheck / racecheck / synccheck): tails on both
sides, causal with Sq != Sk, GQA, strided inputs and outputs, bool and additive masks (partial blocks,
empty rows, a row-broadcast mask gradient), the deterministic mode and the persistent grid striding over
more key tiles than SMs (some without any query: causal with Sk > Sq), for every compiled bf16 head dim.

    compute-sanitizer --tool memcheck python scripts/backward_sanitize.py
"""

import torch

from fa2_inductor import _cuda, _extension


def strided(b, s, h, d):
    return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


def run(d, causal, mask=None, mask_grad=False, deterministic=False, shape=(2, 4, 2, 200, 135)):
    b, hq, hkv, sq, sk = shape
    q, k, v, g = strided(b, sq, hq, d), strided(b, sk, hkv, d), strided(b, sk, hkv, d), strided(b, sq, hq, d)
    out = torch.empty(b, sq, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    _cuda.forward(q, k, v, d ** -0.5, causal, out, lse, attn_mask=mask)
    dq, dk, dv = (torch.full_like(t.transpose(1, 2), float("nan")).transpose(1, 2) for t in (q, k, v))
    full = (b, hq, sq, sk)
    dmask = torch.zeros((1,) * (4 - mask.dim()) + tuple(mask.shape), device="cuda") if mask_grad else None
    _extension.C.bwd(g, q, k, v, out, lse, dq, dk, dv, d ** -0.5, causal, deterministic,
                     None if mask is None else mask.expand(full), None if dmask is None else dmask.expand(full))
    torch.cuda.synchronize()
    finite = all(bool(t.isfinite().all()) for t in (dq, dk, dv))
    kind = "none" if mask is None else str(mask.dtype).replace("torch.", "")
    print(f"hdim{d} {'x'.join(map(str, shape))} causal={causal} mask={kind} mask_grad={mask_grad} "
          f"deterministic={deterministic}: finite={finite}")


for d, name in sorted(_extension.C.compiled_kernels()):
    if name != "bf16":
        continue
    rows = torch.rand(1, 1, 200, 135, device="cuda") < 0.6
    rows[..., ::5, :] = False  # empty rows
    row_bias = torch.randn(2, 1, 1, 135, device="cuda")  # summed over heads and query rows
    for deterministic in (False, True):
        run(d, False, deterministic=deterministic)
        run(d, True, deterministic=deterministic)
        run(d, False, mask=rows, deterministic=deterministic)
    run(d, False, mask=torch.randn(1, 4, 200, 135, device="cuda"), mask_grad=True)
    run(d, False, mask=row_bias, mask_grad=True)
    run(d, True, shape=(2, 72, 72, 100, 300))  # 432-720 key tiles: several per CTA, most without a query
