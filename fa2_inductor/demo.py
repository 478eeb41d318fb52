"""``python -m fa2_inductor.demo``: the main job — what this install runs, and a check that it is right."""

from __future__ import annotations

import torch

from . import flash_attention
from .info import describe


def check_op(device: str) -> float:
    """Max abs difference between the op and torch SDPA on a random GQA causal problem."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(2, 8, 333, 128, device=device, dtype=dtype)
    k, v = (torch.randn(2, 2, 333, 128, device=device, dtype=dtype) for _ in range(2))
    ours = flash_attention(q, k, v, is_causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return (ours.float() - theirs.float()).abs().max().item()


def main() -> None:
    print(describe())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    error = check_op(device)
    print(f"op vs torch SDPA on {device}: max abs difference {error:.2e}")
    if error > 2e-2:
        raise SystemExit("the op disagrees with torch SDPA")


if __name__ == "__main__":
    main()
