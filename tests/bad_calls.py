"""Calls the op's input checks must refuse, built on any device: every implementation of the op (the
Python ones and the extension's C++ CUDA one) raises ValueError with ``ops.check_inputs``'s message for each.
"""

from __future__ import annotations

import torch


def bad_calls(device: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
    """{name: (q, k, v, attn_mask, is_causal, window_left, empty_rows, softcap, sinks)}; the op's scale is any
    float."""

    def t(*shape, dt=dtype, dev=device):
        return torch.zeros(shape, dtype=dt, device=dev)

    q, kv = t(1, 4, 8, 64), t(1, 2, 8, 64)
    calls = {
        "q_3d": (t(4, 8, 64), kv, kv, None, False, -1, 0),
        "k_5d": (q, t(1, 1, 2, 8, 64), kv, None, False, -1, 0),
        "v_1d": (q, kv, t(64), None, False, -1, 0),
        "dtypes_differ": (q, t(1, 2, 8, 64, dt=torch.float16), kv, None, False, -1, 0),
        "integer_dtype": (q.int(), kv.int(), kv.int(), None, False, -1, 0),
        "batch_differs": (q, t(2, 2, 8, 64), t(2, 2, 8, 64), None, False, -1, 0),
        "head_dims_differ": (q, t(1, 2, 8, 32), kv, None, False, -1, 0),
        "head_dim_too_large": (t(1, 4, 8, 264), t(1, 2, 8, 264), t(1, 2, 8, 264), None, False, -1, 0),
        "head_dim_zero": (t(1, 4, 8, 0), t(1, 2, 8, 0), t(1, 2, 8, 0), None, False, -1, 0),
        "kv_lengths_differ": (q, kv, t(1, 2, 9, 64), None, False, -1, 0),
        "kv_heads_differ": (q, kv, t(1, 1, 8, 64), None, False, -1, 0),
        "heads_not_grouped": (t(1, 3, 8, 64), kv, kv, None, False, -1, 0),
        "no_kv_heads": (q, t(1, 0, 8, 64), t(1, 0, 8, 64), None, False, -1, 0),
        "window_without_causal": (q, kv, kv, None, False, 3, 0),
        "window_negative": (q, kv, kv, None, True, -2, 0),
        "empty_rows_unknown": (q, kv, kv, None, False, -1, 3),
        "empty_rows_negative": (q, kv, kv, None, False, -1, -1),
        "mask_integer": (q, kv, kv, t(8, 8, dt=torch.int32), False, -1, 0),
        "mask_not_broadcast": (q, kv, kv, t(3, 8, dt=torch.bool), False, -1, 0),
        "mask_1d_not_broadcast": (q, kv, kv, t(5, dt=torch.bool), False, -1, 0),
        "mask_5d": (q, kv, kv, t(1, 1, 1, 8, 8, dt=torch.bool), False, -1, 0),
    }
    if torch.device(device).type != "cpu":  # rules about devices other than the CPU
        calls["float64"] = (q.double(), kv.double(), kv.double(), None, False, -1, 0)
        calls["devices_differ"] = (q, kv.cpu(), kv, None, False, -1, 0)
        calls["mask_on_cpu"] = (q, kv, kv, t(8, 8, dt=torch.bool, dev="cpu"), False, -1, 0)
        calls["sinks_on_cpu"] = (q, kv, kv, None, False, -1, 0, 0.0, t(4, dt=torch.float32, dev="cpu"))
    calls["softcap_negative"] = (q, kv, kv, None, False, -1, 0, -1.0, None)
    calls["softcap_infinite"] = (q, kv, kv, None, False, -1, 0, float("inf"), None)
    calls["sinks_wrong_heads"] = (q, kv, kv, None, False, -1, 0, 0.0, t(3, dt=torch.float32))
    calls["sinks_integer"] = (q, kv, kv, None, False, -1, 0, 0.0, t(4, dt=torch.int32))
    calls["sinks_with_mean_v"] = (q, kv, kv, None, False, -1, 1, 0.0, t(4, dt=torch.float32))
    return {name: call if len(call) == 9 else (*call, 0.0, None) for name, call in calls.items()}
