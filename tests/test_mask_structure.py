"""Masks as structure (passes/mask_structure.py), on CPU: Hugging Face's masks — causal, key padding
(right and left), sliding window, encoder and cross-attention padding — reach the op as is_causal /
window_left arguments plus a [B, 1, 1, Sk] bool key mask, never as a dense additive tensor; rows with no
visible key average V where eager's finfo.min fill makes them do so; compiled equals eager everywhere.
Masks that are not provably structured keep their dense form (and the exact answer)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import fa2_inductor
from fa2_inductor import EmptyRows
from tests.hf_families import FAMILIES, model_output

FLASH_FWD = torch.ops.fa2_inductor.flash_attention_fwd.default


@dataclass(frozen=True)
class Call:
    is_causal: bool
    window_left: int
    mask_shape: tuple | None
    mask_dtype: torch.dtype | None
    empty_rows: int


class CaptureCalls(CustomGraphPass):
    """The op calls of each post-grad graph, with the arguments the structure decides."""

    def __init__(self):
        self.calls: list[Call] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and node.target is FLASH_FWD:
                mask, is_causal, window_left, empty_rows = node.args[3], *node.args[5:8]
                value = mask.meta["val"] if mask is not None else None
                self.calls.append(Call(is_causal, window_left, None if value is None else tuple(value.shape),
                                       None if value is None else value.dtype, empty_rows))

    def __deepcopy__(self, memo):
        return self

    def uuid(self):
        return None


@pytest.fixture
def capture(monkeypatch):
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", True)
    calls = CaptureCalls()
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(force_disable_caches=True, post_grad_custom_post_pass=calls):
        yield calls
    torch._dynamo.reset()
    counters.clear()


def _inputs(family, config, padding: str) -> dict:
    inputs = family.make_inputs(config, torch.device("cpu"))
    if padding == "none":
        inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    elif padding == "left":
        inputs["attention_mask"] = inputs["attention_mask"].flip(-1)
    return inputs


def _compile_and_compare(family, impl, padding):
    model = family.build(impl)
    inputs = _inputs(family, model.config, padding)
    with torch.no_grad():
        expected = model_output(model(**inputs))
        got = model_output(torch.compile(model, backend="fa2_inductor")(**inputs))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    return model


# HF eager fills hidden scores with finfo.min (an empty row averages V); SDPA's CPU path fills -inf.
EAGER_EMPTY_ROWS = {"eager": EmptyRows.MEAN_V, "sdpa": EmptyRows.ZERO}
# Llama in full; the others where they differ (MQA, GPT-2's own attention, a sliding window).
CASES = [("llama", impl, padding) for impl in ("eager", "sdpa") for padding in ("none", "right", "left")]
CASES += [("qwen2", "sdpa", "left"), ("gpt2", "eager", "right"), ("mistral", "eager", "left"), ("mistral", "sdpa", "none")]


@pytest.mark.parametrize("name, impl, padding", CASES, ids=["-".join(c) for c in CASES])
def test_decoder_masks_become_causal_plus_key_padding(capture, name, impl, padding):
    family = FAMILIES[name]
    model = _compile_and_compare(family, impl, padding)
    sites = family.count_attention_sites(model.config)
    window = getattr(model.config, "sliding_window", None)
    form = "is_causal" + ("+window" if window else "") + "+key_mask"
    assert counters["fa2_inductor"]["rewrites"] == counters["fa2_inductor"]["rewrites:" + form] == sites, \
        dict(counters["fa2_inductor"])
    batch, seq = _inputs(family, model.config, padding)["input_ids"].shape
    expected = Call(True, window - 1 if window else -1, (batch, 1, 1, seq), torch.bool, EAGER_EMPTY_ROWS[impl])
    assert capture.calls == [expected] * sites


ENCODERS = [("bert", "right"), ("bert", "left"), ("bart", "right")]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name, padding", ENCODERS, ids=["-".join(c) for c in ENCODERS])
def test_encoder_and_cross_attention_padding_becomes_a_key_mask(capture, name, padding, impl):
    family = FAMILIES[name]
    model = _compile_and_compare(family, impl, padding)
    sites = family.count_attention_sites(model.config)
    assert counters["fa2_inductor"]["rewrites"] == sites, dict(counters["fa2_inductor"])
    key_masked = [c for c in capture.calls if c.mask_shape is not None]
    assert all(len(c.mask_shape) == 4 and c.mask_shape[1:3] == (1, 1) and c.mask_dtype == torch.bool for c in key_masked)
    assert all(c.empty_rows == EAGER_EMPTY_ROWS[impl] for c in key_masked), capture.calls
    causal = [c for c in capture.calls if c.is_causal]  # BART's decoder self-attention (no decoder mask given)
    assert len(key_masked) + len(causal) == sites and all(c.mask_shape is None for c in causal)


# ---- hand-written masks: what is proven, what stays -----------------------------------------------

B, H, S, D = 2, 4, 24, 16


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, S, D, generator=g) for _ in range(3))


def _hf_style(window=None, pad_left=0, fill=None):
    """where(causal [& window] & key_padding, 0, fill) added to the scores, HF eager's construction."""

    def attention(q, k, v, attention_mask):
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        visible = (j <= i)[None, None]
        if window is not None:
            visible = visible & (j > i - window)[None, None]
        visible = visible & attention_mask.bool()[:, None, None, :]
        fill_value = torch.finfo(q.dtype).min if fill is None else fill
        bias = torch.where(visible, torch.tensor(0.0), fill_value)
        return torch.softmax(q @ k.transpose(-1, -2) * D**-0.5 + bias, -1) @ v

    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :pad_left] = 0
    return attention, mask


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("pad_left", [0, 7])
def test_hand_written_hf_mask_is_exact_with_empty_rows(capture, window, pad_left):
    fn, mask = _hf_style(window, pad_left)
    q, k, v = _qkv()
    expected = fn(q, k, v, mask)
    got = torch.compile(fn, backend="fa2_inductor")(q, k, v, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert capture.calls == [Call(True, window - 1 if window else -1, (B, 1, 1, S), torch.bool, EmptyRows.MEAN_V)]


def test_a_fill_that_does_not_hide_keeps_the_dense_mask(capture):
    """-50 leaves a hidden key a weight of exp(-50), not 0: no structure says that, so the additive mask
    stays as it is (and the answer exact)."""
    fn, mask = _hf_style(pad_left=7, fill=-50.0)
    q, k, v = _qkv()
    expected = fn(q, k, v, mask)
    got = torch.compile(fn, backend="fa2_inductor")(q, k, v, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    (call,) = capture.calls
    assert call.mask_dtype == torch.float32 and call.mask_shape == (B, 1, S, S) and not call.is_causal


def test_positions_that_are_not_causal_stay_a_mask(capture):
    """A bidirectional band is no causal window: its position term is kept as a bool mask, exactly."""

    def band(q, k, v):
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(i - j).abs() <= 3)

    q, k, v = _qkv()
    got = torch.compile(band, backend="fa2_inductor")(q, k, v)
    torch.testing.assert_close(got, band(q, k, v), atol=1e-5, rtol=1e-5)
    (call,) = capture.calls
    assert not call.is_causal and call.mask_shape == (S, S) and call.mask_dtype == torch.bool
    assert counters["fa2_inductor"]["rewrites:mask"] == 1


def test_sdpa_bool_mask_with_data_and_positions(capture):
    """A user's SDPA call with causal & padding given as one bool mask: the causal part becomes is_causal."""

    def attention(q, k, v, keep):
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & keep[:, None, None, :])

    q, k, v = _qkv()
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, -5:] = False
    got = torch.compile(attention, backend="fa2_inductor")(q, k, v, keep)
    torch.testing.assert_close(got, attention(q, k, v, keep), atol=1e-5, rtol=1e-5)
    assert capture.calls == [Call(True, -1, (B, 1, 1, S), torch.bool, EmptyRows.ZERO)]


@pytest.mark.parametrize("fill, empty_rows", [(-65504.0, EmptyRows.ALL_KEYS), (-1.0e4, EmptyRows.ALL_KEYS),
                                              (float("-inf"), EmptyRows.ZERO), (-3.0e38, EmptyRows.MEAN_V)])
@pytest.mark.parametrize("pad_left", [0, 7])
def test_the_fill_decides_what_empty_rows_compute(capture, fill, empty_rows, pad_left):
    """cuDNN's SDPA turns a bool mask into where(mask, 0, -65504): an empty row then attends to every key.
    (Eager's own float32 rounds scores by 2**-8 when it adds -65504, so the check is against its float64 math;
    a hand-written softmax over a row of -inf is NaN, where the op, as SDPA, gives 0.)"""
    fn, mask = _hf_style(pad_left=pad_left, fill=fill)
    q, k, v = _qkv()
    expected = fn(q.double(), k.double(), v.double(), mask).nan_to_num(0.0)
    got = torch.compile(fn, backend="fa2_inductor")(q, k, v, mask)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert capture.calls == [Call(True, -1, (B, 1, 1, S), torch.bool, empty_rows)]
