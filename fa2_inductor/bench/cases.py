"""The sweep's problems: the FlashAttention papers' shapes, their FLOP count and random inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PAPER_TOKENS = 16384  # batch · seqlen in the FlashAttention papers' forward benchmarks
PAPER_HIDDEN = 2048  # heads · head_dim
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CAUSAL_CHOICES = {"both": (False, True), "no": (False,), "yes": (True,)}


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs as the FlashAttention papers count them: QKᵀ and PV at 2·Sq·Sk·D each, half when causal."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def tflops(flops: float, milliseconds: float) -> float:
    return flops / (milliseconds * 1e-3) / 1e12


@dataclass(frozen=True)
class Cell:
    """One problem of the sweep."""

    dtype: str
    causal: bool
    head_dim: int
    seqlen: int
    batch: int
    heads: int

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)

    @property
    def group(self) -> tuple:
        """Cells sharing a table section and a subplot."""
        return (self.dtype, self.causal, self.head_dim)


def sweep_cells(
    seqlens: Sequence[int],
    head_dims: Sequence[int],
    dtypes: Sequence[str],
    causal_flags: Sequence[bool],
    tokens: int = PAPER_TOKENS,
    hidden: int = PAPER_HIDDEN,
) -> list[Cell]:
    """Every combination, seqlen innermost; batch = tokens // seqlen and heads = hidden // head_dim (at least 1)."""
    return [
        Cell(dtype, causal, head_dim, seqlen, max(1, tokens // seqlen), max(1, hidden // head_dim))
        for dtype in dtypes
        for causal in causal_flags
        for head_dim in head_dims
        for seqlen in seqlens
    ]


def random_input_sets(cell: Cell, device: torch.device, count: int, seed: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``count`` independent (q, k, v) sets of standard normals (zeros would flatter the softmax)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (cell.batch, cell.heads, cell.seqlen, cell.head_dim)
    dtype = DTYPES[cell.dtype]
    return [
        tuple(torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(3))
        for _ in range(count)
    ]
