"""The fa2_inductor op as a transformers attention implementation, named "fa2_inductor".

    import fa2_inductor.hf
    fa2_inductor.hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fa2_inductor")

No torch.compile is needed: every attention layer calls ``torch.ops.fa2_inductor.flash_attention_fwd``
(the Hopper kernel on CUDA, the reference elsewhere). transformers is imported only by ``register()``.

Masks: the model builds them as for "sdpa" (boolean, True = attend, sliding windows included), except that
a mask which is causal by construction is left out (None + is_causal), even under torch.compile. K/V keep
their own heads (native GQA, no repeat). Logit softcapping (Gemma 2) and attention sinks (gpt-oss's
``s_aux``) are the op's ``softcap`` and ``sinks``; attention dropout during training is refused with an
error that says what to use instead.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .ops import flash_attention

NAME = "fa2_inductor"


def register() -> None:
    """Makes ``attn_implementation="fa2_inductor"`` available to every transformers model (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    # Without a mask function of its own, transformers would hand a custom implementation no mask at all.
    AttentionMaskInterface.register(NAME, build_mask)


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, **kwargs) -> Optional[Tensor]:
    """transformers' SDPA mask (bool, True = attend), or None where plain causal attention is all it says.

    transformers always materialises the mask while tracing (torch.compile); here a mask that is causal
    by construction (no padding mask given, no window or other pattern, no offsets) stays None even then,
    so the kernel runs its mask-free causal path.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain_causal = (
        kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        and kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
        and kwargs.get("allow_is_causal_skip", True)
        and isinstance(q_offset, int) and isinstance(kv_offset, int)
        and q_offset == kv_offset == 0
        and q_length == kv_length
    )
    if plain_causal:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, **kwargs)


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] -> ([B, Sq, Hq, D], None)."""
    if dropout > 0.0:
        raise NotImplementedError(
            f"attn_implementation='{NAME}' has no attention dropout (got p={dropout} in training mode); "
            "set the config's attention dropout to 0.0 or train with attn_implementation='sdpa'"
        )
    seq_q, seq_k = query.shape[2], key.shape[2]
    if attention_mask is not None:
        # Static caches can hand a mask longer than the keys filled so far.
        attention_mask = attention_mask[..., :seq_k]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # As transformers' SDPA path: a missing mask means causal only for a real (Sq > 1) causal layer.
    # Top-left alignment then equals HF's cropping of K/V to the first Sq keys.
    is_causal = bool(is_causal) and seq_q > 1 and attention_mask is None
    if position_bias is not None:
        attention_mask = _bias_with_mask(position_bias, attention_mask, is_causal, seq_q, seq_k)
        is_causal = False
    out = flash_attention(query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=is_causal,
                          softcap=softcap or 0.0, sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _bias_with_mask(
    position_bias: Tensor, attention_mask: Optional[Tensor], is_causal: bool, seq_q: int, seq_k: int
) -> Tensor:
    """One additive mask from a position bias (T5) and the model's mask, with the SDPA path's meaning."""
    masked = torch.finfo(position_bias.dtype).min
    if attention_mask is None and is_causal:
        q_pos = torch.arange(seq_q, device=position_bias.device)[:, None]
        k_pos = torch.arange(seq_k, device=position_bias.device)[None, :]
        attention_mask = k_pos <= q_pos
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, masked)
    return position_bias + attention_mask
