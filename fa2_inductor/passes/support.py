"""Whether the op should take a site on its device: computable exactly, and fast there."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _cuda, config, ops
from .fx_utils import tensor_val
from .rewrite import mask_value_in_op_layout, value_in_op_layout
from .site import AttentionSite

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def refusal_reason(site: AttentionSite) -> Optional[tuple[str, str]]:
    """(reason, detail) when the site must stay as it is; None when the op takes it."""
    q, k, v = (value_in_op_layout(tensor_val(n), site.layouts[name]) for name, n in zip("qkv", (site.q, site.k, site.v)))
    mask = mask_value_in_op_layout(site)
    if q.dtype not in _KERNEL_DTYPES:
        return "dtype", str(q.dtype)
    if mask is not None and mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return "mask_dtype", str(mask.dtype)
    try:
        ops.check_inputs(q, k, v, mask, site.is_causal)
    except ValueError as error:
        return "not_computable", str(error)
    if tensor_val(site.anchor).dtype != q.dtype:
        return "output_dtype", f"{tensor_val(site.anchor).dtype} output from {q.dtype} inputs"
    if q.device.type == "cpu":
        return None if config.rewrite_on_cpu else ("cpu_device", "set fa2_inductor.config.rewrite_on_cpu")
    if q.device.type != "cuda":
        return "device", q.device.type
    reason = _cuda.kernel_unsupported_reason(q, k, v, mask, site.is_causal)
    return None if reason is None else ("kernel_unsupported", reason)
