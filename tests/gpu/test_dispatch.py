"""The op's CUDA implementation in C++ (csrc/api.cpp, registered when fa2_inductor._C loads).

It must give the bits of the launches it makes when they are called one by one from Python (what the op's
CUDA path did before it moved to C++), raise ops.check_inputs's ValueErrors word for word, decide support
with the reasons the graph pass and explain see, fall back to the reference counted and announced once per
reason, pass opcheck, and run under CUDA-graph capture and torch.compile. Skipped without an sm_90 GPU and
the built kernel.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from fa2_inductor import EmptyRows, _cuda, _extension, ops, reference  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.bad_calls import bad_calls  # noqa: E402
from tests.gpu.kernel_inputs import COMPILED, DEV, DTYPES, HEAD_DIMS, make_qkv, needs_kernel  # noqa: E402

C = _extension.C
op = torch.ops.fa2_inductor.flash_attention_fwd.default
D, DT = (64, "bf16") if (64, "bf16") in COMPILED else sorted(COMPILED)[0]


@pytest.fixture
def fresh_counters():
    counters["fa2_inductor"].clear()
    yield counters["fa2_inductor"]
    counters["fa2_inductor"].clear()


def launches_from_python(q, k, v, mask, scale, is_causal, window_left=-1, empty_rows=0, softcap=0.0, sinks=None):
    """The op's CUDA path as it was in Python: the same special cases and launches, one call at a time."""
    out, lse = reference.empty_outputs(q, v)
    b, hq, sq, _ = q.shape
    if b == 0 or hq == 0 or sq == 0:
        return out, lse
    if k.shape[2] == 0:
        out.zero_()
        if sinks is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(sinks.float().view(1, -1, 1).expand_as(lse))
        return out, lse
    if scale == 0:
        reference.attention_forward(q, k, v, mask, 0.0, is_causal, out, lse, window_left, empty_rows, softcap, sinks)
        return out, lse
    if scale < 0:
        q, scale = -q, -scale
    if sq <= C.limits()["decode_max_seqlen_q"]:
        C.fwd_decode(q, k, v, out, lse, scale, None if mask is None else mask.expand(b, hq, sq, k.shape[2]), is_causal,
                     window_left, softcap, sinks)
    elif mask is not None:
        C.fwd_masked(q, k, v, out, lse, scale, mask.expand(b, hq, sq, k.shape[2]), is_causal, window_left, softcap,
                     sinks)
    else:
        C.fwd(q, k, v, out, lse, scale, is_causal, window_left, None, softcap, sinks)
    if empty_rows == EmptyRows.MEAN_V:
        C.fill_empty_rows(out, lse, v)
    elif empty_rows == EmptyRows.ALL_KEYS:
        unmasked, unmasked_lse = reference.empty_outputs(q, v)
        C.fwd(q, k, v, unmasked, unmasked_lse, scale, False, -1, lse, softcap)
        C.fill_empty_rows(out, lse, v, unmasked)
    return out, lse


def key_padding(b, sk, seed=0):
    """[B, 1, 1, Sk] bool: batch 0 left-padded (its first rows see no key under causal), the others right-padded."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lengths = torch.randint(sk // 2, sk, (b,), generator=g, device=DEV)
    j = torch.arange(sk, device=DEV)[None, :]
    keep = j < lengths[:, None]
    keep[0] = j[0] >= sk - lengths[0]
    return keep[:, None, None, :]


def additive(mask, dtype, fill=float("-inf")):
    return torch.where(mask, 0.0, fill).to(dtype)


def _call(name, dt=DT, d=D):
    """(q, k, v, mask, scale, is_causal, window_left, empty_rows) for one named case."""
    dtype = DTYPES[dt]
    q, k, v = make_qkv(2, 4, 2, 300, 333, d, dtype, seed=len(name))
    sq, sk = q.shape[2], k.shape[2]
    pad = key_padding(2, sk)
    g = torch.Generator(device=DEV).manual_seed(7)
    dense = torch.rand(2, 4, sq, sk, generator=g, device=DEV) > 0.3
    cases = {
        "plain": (q, k, v, None, 0.125, False, -1, 0),
        "causal": (q, k, v, None, 0.125, True, -1, 0),
        "causal_window": (q, k, v, None, 0.125, True, 40, 0),
        "window_empty_rows_mean_v": (*make_qkv(1, 2, 2, 400, 200, d, dtype, seed=3), None, 0.125, True, 10, 1),
        "gqa_bshd": (*make_qkv(2, 8, 2, 257, 129, d, dtype, layout="bshd", seed=4), None, 0.1, True, -1, 0),
        "key_padding": (q, k, v, pad, 0.125, False, -1, 0),
        "key_padding_causal_window_zero": (q, k, v, pad, 0.125, True, 60, 0),
        "key_padding_causal_mean_v": (q, k, v, pad, 0.125, True, -1, 1),
        "key_padding_causal_all_keys": (q, k, v, pad, 0.125, True, -1, 2),
        "key_padding_causal_window_all_keys": (q, k, v, pad, 0.125, True, 30, 2),
        "dense_bool": (q, k, v, dense, 0.125, False, -1, 0),
        "dense_bool_2d_causal": (q, k, v, dense[0, 0], 0.125, True, -1, 0),
        "additive_f32": (q, k, v, additive(dense[:, :1], torch.float32), 0.125, False, -1, 0),
        "additive_in_dtype_mean_v": (q, k, v, additive(dense, dtype, torch.finfo(dtype).min), 0.125, False, -1, 1),
        "additive_all_keys": (q, k, v, additive(pad, torch.float16), 0.125, False, -1, 2),
        "negative_scale": (q, k, v, pad, -0.2, True, -1, 2),
        "scale_zero": (q, k, v, pad, 0.0, True, 5, 2),
        "no_keys": (q, k[:, :, :0], v[:, :, :0], None, 0.125, False, -1, 1),
        "no_keys_masked": (q, k[:, :, :0], v[:, :, :0], pad[..., :0], 0.125, True, -1, 2),
        "no_queries": (q[:, :, :0], k, v, pad, 0.125, True, -1, 2),
        "no_batch": (q[:0], k[:0], v[:0], None, 0.125, False, -1, 0),
        "single_row": (q[:, :, :1], k, v, pad, 0.125, False, -1, 0),
    }
    return cases[name]


CASES = ["plain", "causal", "causal_window", "window_empty_rows_mean_v", "gqa_bshd", "key_padding",
         "key_padding_causal_window_zero", "key_padding_causal_mean_v", "key_padding_causal_all_keys",
         "key_padding_causal_window_all_keys", "dense_bool", "dense_bool_2d_causal", "additive_f32",
         "additive_in_dtype_mean_v", "additive_all_keys", "negative_scale", "scale_zero", "no_keys", "no_keys_masked",
         "no_queries", "no_batch", "single_row"]


def _assert_same_bits(got, expected):
    (out, lse), (ref_out, ref_lse) = got, expected
    assert out.shape == ref_out.shape and out.stride() == ref_out.stride() and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.stride() == ref_lse.stride() and lse.dtype == torch.float32
    assert torch.equal(out, ref_out), (out.double() - ref_out.double()).abs().max().item()
    assert torch.equal(lse, ref_lse)


def test_the_cuda_implementations_of_both_ops_are_the_extensions():
    def cuda_kernel(name):
        dump = torch._C._dispatch_dump(f"fa2_inductor::{name}")
        return next(line for line in dump.splitlines() if line.startswith("CUDA:"))

    for name in ("flash_attention_fwd", "flash_attention_bwd"):
        assert "api.cpp" in cuda_kernel(name), cuda_kernel(name)
    assert C.limits()["max_head_dim"] == ops.MAX_HEAD_DIM  # the op's limit and the kernels' are one number


@pytest.mark.parametrize("name", CASES)
def test_same_bits_as_the_launches_called_from_python(name, fresh_counters):
    args = _call(name)
    assert _cuda.kernel_unsupported_reason(*args[:4], args[5], args[6]) is None
    _assert_same_bits(op(*args), launches_from_python(*args))
    assert not fresh_counters, dict(fresh_counters)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("name", ["causal_window", "key_padding_causal_all_keys", "additive_in_dtype_mean_v"])
def test_same_bits_for_every_compiled_kernel(name, d, dt):
    needs_kernel(d, dt)
    args = _call(name, dt, d)
    _assert_same_bits(op(*args), launches_from_python(*args))


def test_forward_into_given_outputs_is_the_op():
    args = _call("key_padding_causal_window_all_keys")
    q, k, v, mask, scale, is_causal, window_left, empty_rows = args
    out, lse = reference.empty_outputs(q, v)
    _cuda.forward(q, k, v, scale, is_causal, out, lse, mask, window_left, empty_rows)
    _assert_same_bits((out, lse), op(*args))


def test_runs_on_the_current_stream():
    args = _call("key_padding_causal_all_keys")
    expected = op(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = op(*args)
    torch.cuda.current_stream().wait_stream(side)
    _assert_same_bits(got, expected)


@pytest.mark.parametrize("name", sorted(bad_calls(DEV)))
def test_input_errors_are_ops_check_inputs_word_for_word(name):
    q, k, v, mask, is_causal, window_left, empty_rows, softcap, sinks = bad_calls(DEV)[name]
    with pytest.raises(ValueError) as expected:
        ops.check_inputs(q, k, v, mask, is_causal, window_left, empty_rows, softcap, sinks)
    with pytest.raises(ValueError) as got:
        op(q, k, v, mask, 0.5, is_causal, window_left, empty_rows, softcap, sinks)
    assert str(got.value) == str(expected.value)


def _reason_cases():
    q, k, v = make_qkv(1, 4, 2, 17, 16, D, DTYPES[DT])  # 17 query rows: more than a decode step
    mask = torch.ones(17, 16, dtype=torch.bool, device=DEV)
    flat = torch.zeros(q.numel() + 1, dtype=q.dtype, device=DEV)
    name = DT
    wide = torch.zeros(1, 65536, 1, D, dtype=q.dtype, device=DEV)
    one = torch.zeros(1, 1, 1, D, dtype=q.dtype, device=DEV)
    q100, k100, v100 = make_qkv(1, 4, 2, 17, 16, 100, DTYPES[DT])  # not a multiple of 8: no kernel pads it
    return {
        "supported": ((q, k, v, mask, True, 3), None),
        "softcap": ((q, k, v, mask, True, -1, 30.0), None),
        "sinks": ((q, k, v, mask.float(), False, -1, 0.0, torch.zeros(4, device=DEV)), None),
        "window_without_causal": ((q, k, v, None, False, 5), "window_left without is_causal"),
        "mask_float64": ((q, k, v, mask.double(), False), "attn_mask dtype torch.float64 not supported by the kernel"),
        "mask_int32": ((q, k, v, mask.int(), False), "attn_mask dtype torch.int32 not supported by the kernel"),
        "additive_with_causal": ((q, k, v, mask.float(), True), "additive attn_mask together with is_causal"),
        "mask_on_cpu": ((q, k, v, mask.cpu(), False), "attn_mask on another device"),
        "mask_not_broadcast": ((q, k, v, mask[:3], False), "attn_mask does not broadcast to [B, Hq, Sq, Sk]"),
        "mask_grid": ((wide, one, one, torch.ones(1, 65536, 1, 1, dtype=torch.bool, device=DEV), False),
                      "attn_mask too large for the block classification grid"),
        "cpu": ((q.cpu(), k.cpu(), v.cpu(), None, False), "not a CUDA tensor"),
        "float32": ((q.float(), k.float(), v.float(), None, False), "dtype torch.float32 not supported by the kernel"),
        "dtypes_differ": ((q, k.to(torch.float16 if DT == "bf16" else torch.bfloat16), v, None, False),
                          "q, k, v dtypes differ"),
        "three_dims": ((q[0], k[0], v[0], None, False), "inputs must be 4-D"),
        "head_dim_100": ((q100, k100, v100, None, False), f"no kernel compiled for head dim 100 {name}"),
        "heads_above_grid": ((wide, one, one, None, False), "batch or heads above 65535"),
        "heads_not_grouped": ((q[:, :3], k, v, None, False), "Hq must be a multiple of Hkv"),
        "last_dim_strided": ((q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, None, False),
                             "q last dim not contiguous"),
        "misaligned": ((flat[1:].view(q.shape), k, v, None, False), "q not 16-byte aligned"),
        "row_stride": ((torch.zeros(1, 4, 24, D + 3, dtype=q.dtype, device=DEV)[:, :, :17, :D], k, v, None, False),
                       f"q stride {D + 3} of dim 2 is not a positive multiple of 8 elements"),
    }


@pytest.mark.parametrize("name", sorted(_reason_cases()))
def test_support_reasons(name):
    args, reason = _reason_cases()[name]
    assert _cuda.kernel_unsupported_reason(*args) == reason


def test_masked_kernels_can_be_switched_off(monkeypatch, fresh_counters):
    q, k, v, pad = _call("key_padding")[:4]
    monkeypatch.setenv("FA2_INDUCTOR_DISABLE_MASK_KERNEL", "1")
    reason = "masked kernels disabled (FA2_INDUCTOR_DISABLE_MASK_KERNEL=1)"
    assert _cuda.kernel_unsupported_reason(q, k, v, pad, True) == reason
    with pytest.warns(UserWarning, match=r"FA2_INDUCTOR_DISABLE_MASK_KERNEL=1"):
        op(q, k, v, pad, 0.125, True)
    assert fresh_counters[f"reference_fallback:{reason}"] == 1


def test_fake_tensors_are_judged_without_an_address():
    """The graph pass asks about fake tensors: what only the real call can know (alignment) is left to it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        flat = torch.empty(4 * 16 * D + 1, dtype=DTYPES[DT], device=DEV)
        q = flat[1:].view(1, 4, 16, D)
        assert _cuda.kernel_unsupported_reason(q, q, q, None, True) is None
        assert _cuda.kernel_unsupported_reason(q.float(), q.float(), q.float(), None, True) is not None


@pytest.mark.parametrize("name", ["head_dim_100", "float32", "additive_with_causal", "misaligned", "row_stride",
                                  "last_dim_strided"])
def test_unsupported_calls_run_the_reference_counted(name, fresh_counters):
    (q, k, v, mask, is_causal, *window), reason = _reason_cases()[name]
    window_left = window[0] if window else -1
    with pytest.warns(UserWarning, match="reference implementation: " + re.escape(reason)):
        out, lse = op(q, k, v, mask, 0.3, is_causal, window_left, 1)
    expected = reference.empty_outputs(q, v)
    reference.attention_forward(q, k, v, mask, 0.3, is_causal, *expected, window_left, 1)
    _assert_same_bits((out, lse), expected)
    assert dict(fresh_counters) == {f"reference_fallback:{reason}": 1}


def test_each_reason_is_announced_once_and_every_call_counted(fresh_counters):
    (q100, k100, v100, *_), reason_100 = _reason_cases()["head_dim_100"]
    (qf, kf, vf, *_), reason_f32 = _reason_cases()["float32"]
    with pytest.warns(UserWarning, match="head dim 100"):
        op(q100, k100, v100, None, 0.1, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(q100, k100, v100, None, 0.1, False)
        op(q100, k100, v100, None, 0.1, True)
    with pytest.warns(UserWarning, match="float32"):
        op(qf, kf, vf, None, 0.1, False)
    assert dict(fresh_counters) == {f"reference_fallback:{reason_100}": 3, f"reference_fallback:{reason_f32}": 1}


@pytest.mark.parametrize("name", ["causal", "gqa_bshd", "key_padding_causal_window_all_keys", "key_padding_causal_mean_v",
                                  "additive_f32", "negative_scale", "scale_zero", "no_keys"])
def test_opcheck(name):
    q, k, v, mask, scale, is_causal, window_left, empty_rows = _call(name)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(op, (q, k, v, mask, scale, is_causal, window_left, empty_rows))


def test_opcheck_of_a_reference_fallback():
    (q, k, v, *_), _ = _reason_cases()["head_dim_100"]
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(op, (q, k, v, None, 0.1, True))


@pytest.mark.parametrize("case", ["plain", "additive_mask", "sinks"])
def test_cuda_autograd_is_the_extensions_and_gives_the_ops_formula(case, fresh_counters):
    """CUDA tensors take the C++ autograd (AutogradCUDA in api.cpp), whose gradients are ops.py's formula:
    the backward op on the forward's (out, lse), the mask's and the sinks' gradients where they require it
    (deterministic mode: bit-equal)."""
    dump = torch._C._dispatch_dump("fa2_inductor::flash_attention_fwd")
    assert "api.cpp" in next(line for line in dump.splitlines() if line.startswith("AutogradCUDA:")), dump
    q, k, v = make_qkv(1, 4, 2, 200, 200, D, DTYPES[DT], requires_grad=True, seed=9)
    # A mask of every (batch, head): deterministic mode runs no kernel that sums its gradient over broadcast dims.
    mask = torch.randn(1, 4, 200, 200, device=DEV, requires_grad=True) if case == "additive_mask" else None
    sinks = torch.linspace(-1.0, 1.0, 4, device=DEV, requires_grad=True) if case == "sinks" else None
    leaves = [t for t in (q, k, v, mask, sinks) if t is not None]
    args = (0.125, case != "additive_mask", -1, 0, 0.0, sinks)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        out, lse = op(q, k, v, mask, *args)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, leaves, g)
        with torch.no_grad():
            out2, lse2 = op(q, k, v, mask, *args)
            dq, dk, dv, dmask, dsinks = torch.ops.fa2_inductor.flash_attention_bwd(
                g, q, k, v, out2, lse2, mask, 0.125, args[1], mask is not None, -1, 0.0, sinks)
    finally:
        torch.use_deterministic_algorithms(previous)
    want = [dq, dk, dv] + ([dmask] if mask is not None else []) + ([dsinks] if sinks is not None else [])
    assert torch.equal(out, out2) and not lse.requires_grad
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert not fresh_counters, dict(fresh_counters)


def _captured(run):
    """A CUDA graph of run() (warmed up on a side stream, outside the capture) and the outputs it writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    return graph, captured


@pytest.mark.parametrize("name", ["causal", "key_padding_causal_all_keys", "key_padding_causal_mean_v",
                                  "additive_f32", "dense_bool_2d_causal", "key_padding_causal_window_all_keys"])
def test_cuda_graph_capture_and_replay(name):
    q, k, v, mask, scale, is_causal, window_left, empty_rows = _call(name)
    static = [t.clone() for t in (q, k, v)]
    static_mask = None if mask is None else mask.clone()

    def run():
        return op(*static, static_mask, scale, is_causal, window_left, empty_rows)

    graph, captured = _captured(run)
    for seed in (1, 2):  # new contents in the same buffers, then replay
        fresh = make_qkv(*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, seed=100 + seed)
        for buffer, values in zip(static, fresh):
            buffer.copy_(values)
        if static_mask is not None and static_mask.dtype == torch.bool:
            static_mask.copy_(static_mask.roll(17, dims=-1))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_bits(captured, run())


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", ["plain", "causal", "key_padding_causal", "key_padding_causal_mean_v"])
def test_backward_cuda_graph_capture_and_replay(case, deterministic):
    """The backward's launches (preprocess, the mask pre-pass, then the main kernel and the postprocess as
    dependent launches; the main kernel on the persistent grid unless deterministic, striding here over more key
    tiles than SMs) captured in a CUDA graph and replayed on new contents give an eager call's gradients: dK and
    dV to the bit, dQ too when deterministic (else the order of its additions varies). Under MEAN_V the rows
    left padding empties get their gradients at every query position in the graph (it cannot wait to find
    them), at theirs alone eagerly: equal up to rounding."""
    shape = (4, 16, 8, 1100, 1100, D, DTYPES[DT])
    mask = key_padding(4, 1100) if case.startswith("key_padding") else None
    is_causal = case != "plain"
    empty_rows = int(EmptyRows.MEAN_V) if case.endswith("mean_v") else 0

    def inputs(seed):
        q, k, v = make_qkv(*shape, seed=seed)
        out, lse = op(q, k, v, mask, 0.125, is_causal, -1, empty_rows)
        return torch.randn_like(out), q, k, v, out, lse

    static = inputs(21)

    def run():
        return torch.ops.fa2_inductor.flash_attention_bwd(*static, mask, 0.125, is_causal, False, -1, 0.0, None,
                                                          empty_rows)[:3]

    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(deterministic)
        graph, captured = _captured(run)
        for seed in (1, 2):  # new contents in the same buffers, then replay
            for buffer, values in zip(static, inputs(30 + seed)):
                buffer.copy_(values)
            graph.replay()
            torch.cuda.synchronize()
            for name, got, want in zip(("dq", "dk", "dv"), captured, run()):
                if (name == "dq" and not deterministic) or empty_rows:
                    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
                else:
                    assert torch.equal(got, want), name
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.fixture
def fresh_compile():
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_calls_the_op(mode, fresh_compile):
    q, k, v, mask, scale, is_causal, window_left, empty_rows = _call("key_padding_causal_window_all_keys")

    def fn(q, k, v, mask):
        out, lse = op(q, k, v, mask, scale, is_causal, window_left, empty_rows)
        return out * 2, lse

    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    for seed in range(3):  # warm-up, record, replay (reduce-overhead)
        q, k, v = make_qkv(*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, seed=seed)
        got = [t.clone() for t in compiled(q, k, v, mask)]
        expected = fn(q, k, v, mask)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), f"call {seed}"
    assert not any(key.startswith("reference_fallback") for key in counters["fa2_inductor"])


def test_the_backend_rewrites_sdpa_into_the_op(fresh_compile):
    q, k, v = make_qkv(2, 8, 8, 256, 256, D, DTYPES[DT], seed=5)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    got = torch.compile(attention, backend="fa2_inductor")(q, k, v)
    assert counters["fa2_inductor"]["rewrites"] == 1, dict(counters["fa2_inductor"])
    assert not any(key.startswith("reference_fallback") for key in counters["fa2_inductor"])
    torch.testing.assert_close(got.float(), attention(q, k, v).float(), atol=3e-2, rtol=2e-2)


def test_softcap_and_sinks_run_on_the_kernel_through_the_cpp_path(fresh_counters):
    """Both arguments reach every launch the C++ path makes (masked, and the ALL_KEYS pass soft-capped too)."""
    q, k, v = make_qkv(2, 4, 2, 40, 40, D, DTYPES[DT])
    sinks = torch.linspace(-1.0, 2.0, 4, device=DEV)
    pad = key_padding(2, 40)
    for args in [(None, 0.125, True, -1, 0, 30.0, sinks), (pad, 0.125, True, 5, 0, 30.0, sinks),
                 (pad, 0.125, True, -1, int(EmptyRows.ALL_KEYS), 30.0, None)]:
        _assert_same_bits(op(q, k, v, *args), launches_from_python(q, k, v, *args))
    assert not any(key.startswith("reference_fallback") for key in fresh_counters), dict(fresh_counters)


def _backward_call(mask=None, is_causal=True):
    q, k, v = make_qkv(1, 4, 2, 200, 200, D, DTYPES[DT], seed=11)
    out, lse = op(q, k, v, mask, 0.125, is_causal)
    g = torch.randn_like(q)
    return g, q, k, v, out, lse


def test_backward_runs_the_kernel_through_the_cpp_path(fresh_counters):
    """The C++ CUDA implementation gives what the binding's launches give, in contiguous outputs (both in
    deterministic mode, which it follows: dQ's atomics would differ in the last bits otherwise)."""
    g, q, k, v, out, lse = _backward_call()
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        dq, dk, dv, dmask, dsinks = torch.ops.fa2_inductor.flash_attention_bwd(g, q, k, v, out, lse, None, 0.125,
                                                                               True, False)
        expected = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
        C.bwd(g, q, k, v, out, lse, *expected, 0.125, True, True, None, None, -1, 0.0)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(torch.equal(got, want) and got.is_contiguous() for got, want in zip((dq, dk, dv), expected))
    assert dmask.numel() == 0 and dsinks.numel() == 0
    assert not fresh_counters, dict(fresh_counters)


def test_backward_fallbacks_through_the_cpp_path_are_counted(monkeypatch, fresh_counters):
    """With our backward kernel switched off, the C++ path runs PyTorch's flash backward where it can (no mask),
    the reference's C++ port where it cannot (an additive mask whose gradient is asked for); Python counts."""
    monkeypatch.setenv("FA2_INDUCTOR_DISABLE_BACKWARD_KERNEL", "1")
    reason = "backward kernel disabled (FA2_INDUCTOR_DISABLE_BACKWARD_KERNEL=1)"
    g, q, k, v, out, lse = _backward_call()
    got = torch.ops.fa2_inductor.flash_attention_bwd(g, q, k, v, out, lse, None, 0.125, True, False)
    for a, b in zip(got[:3], _cuda.backward(g, q, k, v, out, lse, 0.125, True)):
        torch.testing.assert_close(a, b)  # PyTorch's flash backward adds dQ with atomics
    assert dict(fresh_counters) == {f"backward_fallback:{reason}": 1}
    bias = torch.randn(1, 1, 200, 200, device=DEV)
    g, q, k, v, out, lse = _backward_call(bias, is_causal=False)
    with pytest.warns(UserWarning, match="reference implementation: backward: backward kernel disabled"):
        got = torch.ops.fa2_inductor.flash_attention_bwd(g, q, k, v, out, lse, bias, 0.125, False, True)
    want = reference.backward_outputs(g, q, k, v, out, lse, bias, 0.125, False, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert fresh_counters[f"backward_fallback:{reason}"] == 2
    assert fresh_counters[f"reference_fallback:backward: {reason}"] == 1


def test_flash_backward_through_the_cpp_path_takes_a_window_and_sinks(monkeypatch, fresh_counters):
    """The C++ path's boxed call of PyTorch's flash backward passes the window as Python's call does, and adds
    the sinks' gradient from the LSE."""
    monkeypatch.setenv("FA2_INDUCTOR_DISABLE_BACKWARD_KERNEL", "1")
    reason = "backward kernel disabled (FA2_INDUCTOR_DISABLE_BACKWARD_KERNEL=1)"
    q, k, v = make_qkv(1, 4, 2, 200, 200, D, DTYPES[DT], seed=11)
    why = _cuda.flash_backward_unsupported_reason(q, k, v, None, True, 16)
    if why is not None:
        pytest.skip(why)
    sinks = torch.linspace(-1.0, 2.0, 4, device=DEV)
    out, lse = op(q, k, v, None, 0.125, True, 16, 0, 0.0, sinks)
    g = torch.randn_like(q)
    dq, dk, dv, dmask, dsinks = torch.ops.fa2_inductor.flash_attention_bwd(g, q, k, v, out, lse, None, 0.125, True,
                                                                           False, 16, 0.0, sinks)
    for a, b in zip((dq, dk, dv), _cuda.backward(g, q, k, v, out, lse, 0.125, True, 16)):
        torch.testing.assert_close(a, b)  # PyTorch's flash backward adds dQ with atomics
    torch.testing.assert_close(dsinks, _cuda.sinks_gradient(g, out, lse, sinks))
    assert dmask.numel() == 0 and dsinks.shape == sinks.shape
    assert dict(fresh_counters) == {f"backward_fallback:{reason}": 1}


# The flash-backward rule has two owners by necessity: Python (installs without the extension) and C++ (calls
# without Python). With our backward kernel off, a call that the C++ path sends to the reference must be one
# that Python's rule refuses, and the other way round.
FLASH_RULE_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal_window": {"is_causal": True, "window_left": 16},
    "causal_sq_ne_sk": {"is_causal": True, "sk": 300},
    "sq_ne_sk": {"sk": 300},
    "softcap": {"softcap": 5.0},
    "bool_mask": {"mask": True},
    "fp16": {"dtype": torch.float16},
}


@pytest.mark.parametrize("name", list(FLASH_RULE_CASES))
def test_the_cpp_and_python_flash_backward_rules_agree(name, monkeypatch, fresh_counters):
    case = FLASH_RULE_CASES[name]
    monkeypatch.setenv("FA2_INDUCTOR_DISABLE_BACKWARD_KERNEL", "1")
    dtype = case.get("dtype", DTYPES[DT])
    q, k, v = make_qkv(1, 4, 2, 200, case.get("sk", 200), D, dtype, seed=13)
    is_causal, window = case.get("is_causal", False), case.get("window_left", -1)
    mask = torch.rand(1, 1, 200, k.shape[2], device=DEV) > 0.2 if case.get("mask") else None
    softcap = case.get("softcap", 0.0)
    python_refuses = _cuda.flash_backward_unsupported_reason(q, k, v, mask, is_causal, window, softcap)
    out, lse = op(q, k, v, mask, 0.125, is_causal, window, 0, softcap, None)
    torch.ops.fa2_inductor.flash_attention_bwd(torch.randn_like(q), q, k, v, out, lse, mask, 0.125, is_causal, False,
                                               window, softcap, None)
    cpp_refused = any(key.startswith("reference_fallback:backward: ") for key in fresh_counters)
    assert cpp_refused == (python_refuses is not None), (python_refuses, dict(fresh_counters))
