"""Whether the op should take a site on its device: computable exactly, and fast there."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _cuda, config, ops
from .fx_utils import same_shape, tensor_val
from .leading_dims import leading_dims_agree, merges
from .refusals import Refusal, Refused
from .rewrite import mask_value_in_op_layout, value_in_op_layout
from .site import AttentionSite

# Dtypes the pass hands to the op on any device (float64 is the CPU reference's, for gradcheck only);
# whether the kernel runs a dtype is the device rule's question.
_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Decode steps (at most this many query rows) run the split-KV decode kernel. Measured faster than Inductor's own
# attention from 2k keys on (the Llama-shaped model's decode step, ``bench_e2e --phases decode decode_dynamic``,
# H200: 1.39-1.81x at 2k-8k); per call (``bench --decode``) its fixed cost (two launches, ~16 us) is most of the
# time at 512 keys, so shorter caches stay with Inductor until measured.
DECODE_MAX_QUERY_ROWS = 16  # the kernel's dispatch limit, _C.limits()["decode_max_seqlen_q"]
DECODE_MIN_KEYS = 512
# Short sequences stay with Inductor on CUDA: below these key counts the op's fixed cost per call (its
# launches: a mask's pre-pass, the empty-row passes) outweighs what its kernel saves. Measured with
# ``python -m fa2_inductor.bench --sites`` (H200, bf16, 12-32 heads, GPU time per call against SDPA with Hugging
# Face's dense mask; docs/results.md): without a mask the op is never slower from 64 keys (causal) or 128; with
# a mask from 128 keys at head dim 128, but at head dim 64, where a score costs half as much, only from 512
# (256 keys read 1.00-1.13x) and, for cross-attention (a quarter as many queries as keys), from 1024
# (512 keys read 1.05x at 12 heads, 0.82x at 32).
MIN_KEYS = 128
SMALL_HEAD_DIM = 64  # up to this head dim (padded ones included) a masked site needs the longer sequences below
MIN_KEYS_SMALL_HEADS_WITH_MASK = 512
MIN_KEYS_SMALL_HEADS_CROSS_WITH_MASK = 1024


def min_keys(head_dim: int, seq_q: int, seq_k: int, masked: bool) -> int:
    """The fewest keys from which the op takes a (non-decode) site on CUDA."""
    if not masked or head_dim > SMALL_HEAD_DIM:
        return MIN_KEYS
    return MIN_KEYS_SMALL_HEADS_CROSS_WITH_MASK if seq_q < seq_k else MIN_KEYS_SMALL_HEADS_WITH_MASK


def _hint(size) -> int:
    """The example value of a size (``SymNode.hint`` exists on every supported torch version)."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return 1 if hint is None else int(hint)  # unbacked: any value; the op re-checks at run time


def _with_size_hints(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A fake tensor with the example sizes of a symbolic one: the kernel's rules are about numbers."""
    if t is None or all(isinstance(s, int) for s in (*t.shape, *t.stride())):
        return t
    shape = [_hint(s) for s in t.shape]
    stride = [_hint(s) for s in t.stride()]
    with torch._guards.detect_fake_mode([t]) or contextlib.nullcontext():  # never a real (CUDA) allocation
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)


@dataclass(frozen=True)
class OpCall:
    """The op call a rewrite would make: its tensors (fake, in the op's layout) and position arguments."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    is_causal: bool
    window_left: int = -1
    softcap: float = 0.0
    sinks: Optional[torch.Tensor] = None


def _kernel_reason(call: OpCall) -> Optional[str]:
    q, k, v, mask = (_with_size_hints(t) for t in (call.q, call.k, call.v, call.mask))
    return _cuda.kernel_unsupported_reason(q, k, v, mask, call.is_causal, call.window_left, call.softcap, call.sinks)


def _cpu_refusal(call: OpCall) -> Optional[Refused]:
    """CPU graphs run the op's reference: only where the user asked for it (tests, demos)."""
    return None if config.rewrite_on_cpu else Refused(Refusal.CPU_DEVICE, "set fa2_inductor.config.rewrite_on_cpu")


def _cuda_refusal(call: OpCall) -> Optional[Refused]:
    """CUDA graphs: the kernel must run the call, and be at least as fast as Inductor there.

    A symbolic Sq is judged by its example value, so a graph traced at prefill length and later run with
    a few query rows keeps the op (correct, only not the fastest); Dynamo gives Sq = 1 a graph of its own.
    """
    reason = _kernel_reason(call)
    if reason is not None:
        return Refused(Refusal.KERNEL_UNSUPPORTED, reason)
    seq_q, seq_k = _hint(call.q.shape[-2]), _hint(call.k.shape[-2])
    if seq_q <= DECODE_MAX_QUERY_ROWS:
        if seq_k < DECODE_MIN_KEYS:
            return Refused(Refusal.DECODE_STEP, f"Sq={seq_q} query rows against Sk={seq_k} keys: below "
                                                f"{DECODE_MIN_KEYS} keys the decode kernel's fixed cost is not measured to pay")
        return None
    fewest = min_keys(_hint(call.q.shape[-1]), seq_q, seq_k, call.mask is not None)
    if seq_k < fewest:
        return Refused(Refusal.SHORT_SEQUENCE, f"Sk={seq_k} keys{' with a mask' if call.mask is not None else ''}: "
                                               f"below {fewest} the op's fixed cost per call makes it slower")
    if call.mask is not None and call.mask.dtype != torch.bool:
        return Refused(Refusal.DENSE_ADDITIVE_MASK, "an additive mask with no proven structure is read per score")
    return None


# The rules each device type adds to the op's own input checks (a table, so tests can swap one in).
_DEVICE_RULES = {"cpu": _cpu_refusal, "cuda": _cuda_refusal}


def _cuda_backward_refusal(call: OpCall) -> Optional[Refused]:
    """Training graphs on CUDA: the op's backward must run a fast kernel (ours, or PyTorch's flash backward);
    its other path, the reference, would make the training step slower than Inductor's own attention backward."""
    reason = _cuda.backward_unsupported_reason(call.q, call.k, call.v, call.mask, call.is_causal, call.window_left,
                                               call.softcap, call.sinks)
    return None if reason is None else Refused(Refusal.BACKWARD_UNSUPPORTED, reason)


# The rules each device type adds for training graphs (CPU: the reference both ways, by request).
_BACKWARD_RULES = {"cuda": _cuda_backward_refusal}


def _op_call(site: AttentionSite) -> OpCall:
    """The call the op would receive for this site (fake tensors)."""
    q, k, v = (value_in_op_layout(tensor_val(n), site.layouts[name]) for name, n in zip("qkv", (site.q, site.k, site.v)))
    sinks = None if site.sinks is None else tensor_val(site.sinks)
    return OpCall(q, k, v, mask_value_in_op_layout(site), site.is_causal, site.window_left, site.softcap, sinks)


def backward_refusal_reason(site: AttentionSite) -> Optional[Refused]:
    """The refusal when a site of a training graph must stay because the op's backward is slow there."""
    call = _op_call(site)
    rules = _BACKWARD_RULES.get(call.q.device.type)
    return None if rules is None else rules(call)


def refusal_reason(site: AttentionSite) -> Optional[Refused]:
    """The refusal when the site must stay as it is; None when the op takes it."""
    values = {name: tensor_val(node) for name, node in (("q", site.q), ("k", site.k), ("v", site.v), ("out", site.anchor))}
    if merges(site.layouts["q"]) and not leading_dims_agree(values, site.layouts):
        return Refused(Refusal.UNRECOGNISED_LAYOUT, "q, k, v and the output split their batched product's batch "
                       "into other leading dims")
    call = _op_call(site)
    q, k, v, mask = call.q, call.k, call.v, call.mask
    if q.dtype not in _OP_DTYPES:
        return Refused(Refusal.DTYPE, str(q.dtype))
    if mask is not None and mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return Refused(Refusal.MASK_DTYPE, str(mask.dtype))
    try:
        ops.check_inputs(q, k, v, mask, call.is_causal, call.window_left, int(site.empty_rows), call.softcap, call.sinks)
    except ValueError as error:
        return Refused(Refusal.NOT_COMPUTABLE, str(error))
    out = value_in_op_layout(tensor_val(site.anchor), site.layouts["out"])
    if out.dtype != q.dtype:
        return Refused(Refusal.OUTPUT_DTYPE, f"{out.dtype} output from {q.dtype} inputs")
    if not same_shape(out.shape, [*q.shape[:-1], v.shape[-1]]):  # e.g. a mask that broadcast the scores to a larger shape
        return Refused(Refusal.OUTPUT_SHAPE, f"{tuple(out.shape)}")
    rules = _DEVICE_RULES.get(q.device.type)
    if rules is None:
        return Refused(Refusal.DEVICE, q.device.type)
    return rules(call)
