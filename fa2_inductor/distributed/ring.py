"""Ring attention over a process group (context parallelism), built on the op's log-sum-exp.

Each of the N ranks holds a slice of the sequence of q, k and v. K/V travel around the ring (rank r sends to
r+1) while every rank attends its queries to the K/V block it holds; the partial outputs are merged by their
log-sum-exp. Communication is PyTorch's own point-to-point (``torch.distributed.batch_isend_irecv``), posted
before each step's attention so that it overlaps with it.

Causal attention is load-balanced: the sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r
(``shard_sequence``; PyTorch's context parallel uses the same head-tail layout), so every rank does the same
work at every step. Non-causal attention works with any split of the sequence.

    q, k, v = (shard_sequence(t, group) for t in (q_full, k_full, v_full))
    out = ring_attention(q, k, v, group=group, is_causal=True)   # differentiable
    out_full = gather_sequence(out, group)

Runs eagerly (the point-to-point calls are not traced by torch.compile: a compiled model breaks its graph
around it).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

SEQ_DIM = 2  # [B, H, S, D]


def _chunk_order(world_size: int, rank: int) -> tuple[int, int]:
    """Which two of the sequence's 2N chunks a rank holds, in its local order."""
    return rank, 2 * world_size - 1 - rank


def shard_sequence(x: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """This rank's load-balanced slice of a full [B, H, S, D] tensor (S divisible by 2 x world size)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[SEQ_DIM] % (2 * world_size):
        raise ValueError(f"ring attention: sequence length {x.shape[SEQ_DIM]} is not divisible by 2 x {world_size} ranks")
    chunks = x.chunk(2 * world_size, dim=SEQ_DIM)
    return torch.cat([chunks[i] for i in _chunk_order(world_size, rank)], dim=SEQ_DIM)


def gather_sequence(x: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The full tensor back from every rank's ``shard_sequence`` slice (an all-gather)."""
    world_size = dist.get_world_size(group)
    slices = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(slices, x.contiguous(), group=group)
    chunks: list[Optional[Tensor]] = [None] * (2 * world_size)
    for rank, piece in enumerate(slices):
        for index, chunk in zip(_chunk_order(world_size, rank), piece.chunk(2, dim=SEQ_DIM)):
            chunks[index] = chunk
    return torch.cat(chunks, dim=SEQ_DIM)


class _Ring:
    """The neighbours of this rank and one exchange step: send to the next rank, receive from the previous."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = self._global_rank((self.rank + 1) % self.size)
        self.prev = self._global_rank((self.rank - 1) % self.size)

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def start_exchange(self, send: Tensor) -> tuple[Tensor, "_Exchange"]:
        """Posts the send of ``send`` and the receive of the previous rank's tensor; returns the receive buffer."""
        recv = torch.empty_like(send)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ])
        return recv, _Exchange(works, send)


class _Exchange:
    """Pending point-to-point work; keeps the sent tensor alive until it completes."""

    def __init__(self, works: list, sent: Tensor):
        self.works, self.sent = works, sent

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.sent = None


def _block(ring: _Ring, step: int, is_causal: bool, local_len: int):
    """Which part of the local queries and of the K/V block held at ``step`` attend to each other.

    Returns (query rows, key rows, causal) as slices of the local sequence. With the load-balanced layout
    the block is causal at step 0 (this rank's own chunks: top-left causal over both is exact), and else
    either every query against the block's first chunk (it comes from an earlier rank: all of it is in the
    past of both our chunks) or our second chunk against the whole block (a later rank's chunks are past
    only for our second chunk).
    """
    everything = slice(0, local_len)
    if not is_causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    half = local_len // 2
    source = (ring.rank - step) % ring.size
    if source < ring.rank:
        return everything, slice(0, half), False
    return slice(half, local_len), everything, False


def _rows(x: Tensor, rows: slice, dim: int = SEQ_DIM) -> Tensor:
    return x.narrow(dim, rows.start, rows.stop - rows.start)


def _with_rows(x: Tensor, rows: slice, value: Tensor, dim: int = SEQ_DIM) -> Tensor:
    """x with ``rows`` along ``dim`` replaced by value (out of place: the accumulators stay functional, which
    torch.compile traces correctly where it traces the ring at all)."""
    return x.slice_scatter(value, dim=dim, start=rows.start, end=rows.stop)


def _converted(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in dtype, never a no-op ``.to()``: torch 2.11's Dynamo loses the gradient of an autograd.Function
    whose output is such an alias of an intermediate."""
    return x if x.dtype == dtype else x.to(dtype)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) float32 accumulators merged with one block's normalised output and LSE."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    old_weight = torch.exp(lse - finite).unsqueeze(-1)
    block_weight = torch.exp(block_lse - finite).unsqueeze(-1)
    return out * old_weight + block_out.float() * block_weight, new_lse


def _forward(q, k, v, scale, is_causal, ring):
    local_len = q.shape[SEQ_DIM]
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(ring.size):
        if step + 1 < ring.size:
            next_kv, exchange = ring.start_exchange(kv)
        rows, keys, causal = _block(ring, step, is_causal, local_len)
        block_out, block_lse = torch.ops.fa2_inductor.flash_attention_fwd(
            _rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys), None, scale, causal
        )
        if out is None:  # step 0 covers every row
            out, lse = _converted(block_out, torch.float32), block_lse
        else:
            merged_out, merged_lse = _merge(_rows(out, rows), _rows(lse, rows), block_out, block_lse)
            out, lse = _with_rows(out, rows, merged_out), _with_rows(lse, rows, merged_lse)
        if step + 1 < ring.size:
            exchange.wait()
            kv = next_kv
    return _converted(out, q.dtype), lse


def _backward(grad_out, q, k, v, out, lse, scale, is_causal, ring):
    local_len = q.shape[SEQ_DIM]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    # The K/V gradients travel with their K/V: the block held at a step collects this rank's part, then moves on.
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    for step in range(ring.size):
        last = step + 1 == ring.size
        if not last:
            next_kv, kv_exchange = ring.start_exchange(kv)
        rows, keys, causal = _block(ring, step, is_causal, local_len)
        # With the final out and LSE, each block's backward gives its exact share of the gradients.
        block_dq, block_dk, block_dv, *_ = torch.ops.fa2_inductor.flash_attention_bwd(
            _rows(grad_out, rows), _rows(q, rows), _rows(kv[0], keys), _rows(kv[1], keys),
            _rows(out, rows), _rows(lse, rows), None, scale, causal, False,
        )
        dq = _with_rows(dq, rows, _rows(dq, rows) + block_dq)
        kv_dim = SEQ_DIM + 1  # dkv is [2, B, H, S, D]
        dkv = _with_rows(dkv, keys, _rows(dkv, keys, kv_dim) + torch.stack([block_dk, block_dv]), kv_dim)
        if ring.size > 1:
            dkv, dkv_exchange = ring.start_exchange(dkv)
        if not last:
            kv_exchange.wait()
            kv = next_kv
        if ring.size > 1:
            dkv_exchange.wait()
    # After the last step every block's gradients have gone once around and are back with their owner.
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, is_causal, group):
        ring = _Ring(group)
        out, lse = _forward(q, k, v, scale, is_causal, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.is_causal, ctx.ring = scale, is_causal, ring
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(grad_out, q, k, v, out, lse, ctx.scale, ctx.is_causal, ctx.ring)
        return dq, dk, dv, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """Attention over the whole sequence from each rank's slice of it (differentiable).

    q: [B, Hq, S_local, D], k/v: [B, Hkv, S_local, D] (GQA as in the op), every rank the same S_local; for
    ``is_causal`` the slices must be ``shard_sequence``'s load-balanced ones (S_local even). Returns this
    rank's rows of the output, in q's layout. ``group`` defaults to the whole world.
    """
    if is_causal and q.shape[SEQ_DIM] % 2:
        raise ValueError("ring attention: causal needs the load-balanced layout (shard_sequence): even local length")
    if q.shape[SEQ_DIM] != k.shape[SEQ_DIM]:
        raise ValueError(f"ring attention: local q length {q.shape[SEQ_DIM]} != local k length {k.shape[SEQ_DIM]}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, float(scale), bool(is_causal), group)
