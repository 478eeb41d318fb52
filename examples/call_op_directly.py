"""Call the attention op directly: causal GQA, a padding mask, and the raw op with its log-sum-exp.

    python examples/call_op_directly.py

On a Hopper GPU with the kernel built the op runs the kernel (bf16); anywhere else it runs the
reference implementation (float32 here). Each result is compared with torch's SDPA.
"""

import torch
import torch.nn.functional as F

import fa2_inductor

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
batch, q_heads, kv_heads, seqlen, head_dim = 2, 16, 4, 1024, 128

q = torch.randn(batch, q_heads, seqlen, head_dim, device=device, dtype=dtype)
k = torch.randn(batch, kv_heads, seqlen, head_dim, device=device, dtype=dtype)
v = torch.randn(batch, kv_heads, seqlen, head_dim, device=device, dtype=dtype)


def report(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    error = (ours.float() - theirs.float()).abs().max().item()
    print(f"{name:<34} max |ours - SDPA| = {error:.2e}")
    assert error < tolerance, name


# 1. Causal GQA: K/V keep their 4 heads, no repeat needed.
out = fa2_inductor.flash_attention(q, k, v, is_causal=True)
report("causal, GQA 16/4", out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

# 2. A boolean padding mask (True = attend), broadcast over heads and queries: row 1 has 1000 real keys.
keep = torch.ones(batch, 1, 1, seqlen, dtype=torch.bool, device=device)
keep[1, ..., 1000:] = False
out = fa2_inductor.flash_attention(q, k, v, attn_mask=keep)
report("padding mask", out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True))

# 3. The torch.library op itself, as the compiler pass emits it: (out, lse), lse in float32 natural log.
scale = head_dim**-0.5
out, lse = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, None, scale, True)
_, expected_lse = fa2_inductor.attention_reference(q, k, v, scale=scale, is_causal=True)
report("raw op, causal", out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
print(f"{'raw op lse':<34} max |lse - reference| = {(lse - expected_lse).abs().max().item():.2e}")
