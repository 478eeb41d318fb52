"""The split-KV decode kernel (calls with at most 16 query rows): numerics against the float64 reference with
FlashAttention's 2x rule into NaN-poisoned outputs, over head dims (padded ones too), dtypes, GQA groups packed
into one tile (Hq/Hkv 1, 4, 8), odd key counts up to 65537 (more blocks than a scanned split holds), causal and
window positions, masks as Hugging Face passes them during generation (a static cache with unfilled slots: bool,
-inf and finfo.min fills), fully masked rows, softcap and sinks, strided inputs; the op end to end with no
reference fallback and its empty-row policies; one split walking 128 unmasked blocks; split counts forced by
FA2_INDUCTOR_DECODE_SPLITS; bit-identical repeats; CUDA graph capture. Skipped unless an sm_90 GPU and
fa2_inductor._C exist.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

import fa2_inductor  # noqa: E402
from fa2_inductor import _extension  # noqa: E402
from fa2_inductor.reference import EmptyRows, attention_reference  # noqa: E402
from fa2_inductor.bench.decode import SPLITS_VARIABLE  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import DEV, DTYPES, HEAD_DIMS, make_qkv, needs_kernel  # noqa: E402
from tests.gpu.test_softcap_sinks_kernel import check_forward  # noqa: E402

DECODE_MAX_SQ = _extension.C.limits()["decode_max_seqlen_q"]
op = torch.ops.fa2_inductor.flash_attention_fwd.default

# (B, Hq, Hkv, Sq, Sk): one row and one key; a GQA group of 4 and of 8 packed into 16-row tiles; 16 rows x
# 8 heads (8 tiles); odd key counts around the 64-key blocks.
SHAPES = [
    (1, 2, 2, 1, 1),
    (2, 32, 8, 1, 1000),
    (1, 8, 1, 2, 4099),
    (3, 16, 2, 5, 97),
    (1, 8, 8, DECODE_MAX_SQ, 333),
    (2, 4, 4, 3, 17),
]


@pytest.fixture
def fresh_counters():
    counters["fa2_inductor"].clear()
    yield counters["fa2_inductor"]
    counters["fa2_inductor"].clear()


def static_cache_mask(b, sq, max_len, filled, fill):
    """HF's mask for a decode step into a static cache: row i of sequence n sees slots j <= filled[n] - sq + i
    (the rest are unfilled or future). fill: "bool", "-inf" or "finfo.min" (additive float32)."""
    pos = torch.tensor(filled, device=DEV).view(b, 1, 1, 1) - sq + torch.arange(sq, device=DEV).view(1, 1, sq, 1)
    keep = torch.arange(max_len, device=DEV).view(1, 1, 1, max_len) <= pos
    if fill == "bool":
        return keep
    hidden = float("-inf") if fill == "-inf" else torch.finfo(torch.float32).min
    return torch.zeros(keep.shape, device=DEV).masked_fill(~keep, hidden)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS + (96,))
def test_numerics(d, dt, is_causal, shape):
    needs_kernel(min(h for h in HEAD_DIMS if h >= d), dt)
    b, hq, hkv, sq, sk = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq * 31 + sk)
    check_forward(q, k, v, is_causal, 0.0, None)


@pytest.mark.parametrize("fill", ["bool", "-inf", "finfo.min"])
@pytest.mark.parametrize("sq", [1, 4])
def test_static_cache_masks(fill, sq):
    """Filled lengths 1 (one block visible), 3000 (mid-split) and the whole cache; GQA 32/8, d128."""
    needs_kernel(128, "bf16")
    b, max_len = 3, 8192
    q, k, v = make_qkv(b, 32, 8, sq, max_len, 128, torch.bfloat16, seed=sq)
    mask = static_cache_mask(b, sq, max_len, [max(sq, 1), 3000, max_len], fill)
    check_forward(q, k, v, False, 0.0, None, mask)


def test_one_split_writes_out_and_lse_itself():
    """Batch 32 x 8 KV heads fill the GPU with one split each at 700 keys, so the split kernel writes out and
    lse without the combine kernel: sinks, a padding mask and a sequence that sees no key included."""
    needs_kernel(128, "bf16")
    q, k, v = make_qkv(32, 32, 8, 1, 700, 128, torch.bfloat16, layout="bshd", seed=13)
    g = torch.Generator(device=DEV).manual_seed(0)
    mask = torch.rand(32, 1, 1, 700, device=DEV, generator=g) > 0.3
    mask[5] = False
    sinks = torch.linspace(-1.0, 2.0, 32, device=DEV)
    out, lse = check_forward(q, k, v, False, 0.0, sinks, mask)
    assert out[5].abs().max().item() == 0.0 and torch.equal(lse[5, :, 0], sinks)  # all its weight on the sink


def test_more_blocks_than_one_split_holds():
    """1025 blocks: unmasked, and with a mask whose blocks a split scans into a 64-bit set (at least 17 splits)."""
    needs_kernel(128, "bf16")
    q, k, v = make_qkv(1, 8, 1, 1, 65537, 128, torch.bfloat16, seed=3)
    check_forward(q, k, v, False, 0.0, None)
    keep = torch.rand(1, 1, 1, 65537, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)) > 0.1
    check_forward(q, k, v, False, 0.0, None, keep)


@pytest.mark.parametrize("variant", ["window", "bool_causal", "additive_causal", "softcap", "sinks", "empty_rows"])
def test_positions_masks_softcap_sinks(variant):
    needs_kernel(64, "bf16")
    q, k, v = make_qkv(2, 8, 2, 7, 700, 64, torch.bfloat16, layout="bshd", seed=11)
    g = torch.Generator(device=DEV).manual_seed(0)
    mask, is_causal, window, softcap, sinks = None, False, -1, 0.0, None
    if variant == "window":
        is_causal, window = True, 3
    elif variant == "bool_causal":
        is_causal, mask = True, torch.rand(2, 1, 7, 700, device=DEV, generator=g) > 0.5
    elif variant == "additive_causal":
        is_causal, mask = True, torch.randn(1, 8, 7, 700, device=DEV, generator=g)
    elif variant == "softcap":
        softcap, mask = 4.0, torch.rand(2, 1, 1, 700, device=DEV, generator=g) > 0.2
    elif variant == "sinks":
        sinks, mask = torch.linspace(-2.0, 3.0, 8, device=DEV), torch.rand(1, 1, 7, 700, device=DEV, generator=g) > 0.9
    else:  # rows 0 and 5 of sequence 1 see no key
        mask = torch.rand(2, 1, 7, 700, device=DEV, generator=g) > 0.5
        mask[1, :, [0, 5]] = False
    out, lse = check_forward(q, k, v, is_causal, softcap, sinks, mask, window)
    if variant == "empty_rows":
        assert torch.equal(lse[1, :, [0, 5]], torch.full_like(lse[1, :, [0, 5]], float("-inf")))
        assert out[1, :, [0, 5]].abs().max().item() == 0.0


@pytest.mark.parametrize("policy", [EmptyRows.ZERO, EmptyRows.MEAN_V, EmptyRows.ALL_KEYS])
def test_the_op_runs_decode_steps_on_the_kernel(policy, fresh_counters):
    needs_kernel(128, "bf16")
    q, k, v = make_qkv(4, 32, 8, 1, 2048, 128, torch.bfloat16, layout="bshd", seed=5)
    mask = static_cache_mask(4, 1, 2048, [1, 100, 1500, 2048], "bool")
    mask[0] = False  # sequence 0 sees nothing: the policy decides its rows
    out, lse = op(q, k, v, mask, 0.088, False, -1, int(policy), 0.0, None)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), mask, 0.088, False, -1, int(policy))
    assert not any(key.startswith("reference_fallback") for key in fresh_counters), dict(fresh_counters)
    assert (out.double() - ref).abs().max().item() < 2e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double() - ref_lse)[finite].abs().max().item() < 1e-2


@pytest.mark.parametrize("splits", [1, 3, 1000])
def test_forced_split_counts_keep_the_answer(splits, monkeypatch):
    """FA2_INDUCTOR_DECODE_SPLITS (a tuning knob, read at each call) within the plan's bounds, over 79 blocks
    (5000 keys): unmasked, 1 split walks all 79 (two 64-block windows); with a static cache's mask (filled to 70
    of the 5000 slots) the blocks are scanned into a 64-bit set, so 1 becomes 2; 1000 is one split per block."""
    needs_kernel(128, "bf16")
    monkeypatch.setenv(SPLITS_VARIABLE, str(splits))
    q, k, v = make_qkv(2, 32, 8, 1, 5000, 128, torch.bfloat16, seed=4)
    check_forward(q, k, v, False, 0.0, None)
    check_forward(q, k, v, False, 0.0, None, static_cache_mask(2, 1, 5000, [70, 5000], "bool"))


def test_a_full_batch_walks_every_block_in_one_split():
    """32 x 8 KV heads fill the GPU's CTA slots, so 8192 unmasked keys (128 blocks) are planned as one split per
    tile: no combine, the blocks visited 64 at a time."""
    needs_kernel(128, "bf16")
    q, k, v = make_qkv(32, 8, 8, 1, 8192, 128, torch.bfloat16, seed=21)
    check_forward(q, k, v, False, 0.0, None)


def test_repeats_are_bit_identical():
    needs_kernel(128, "bf16")
    q, k, v = make_qkv(2, 32, 8, 1, 30000, 128, torch.bfloat16, seed=9)
    first = op(q, k, v, None, 0.088, False, -1, 0, 0.0, None)
    for _ in range(3):
        again = op(q, k, v, None, 0.088, False, -1, 0, 0.0, None)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_cuda_graph_replays_decode_steps():
    needs_kernel(128, "bf16")
    q, k, v = make_qkv(2, 32, 8, 1, 4096, 128, torch.bfloat16, seed=2)
    mask = static_cache_mask(2, 1, 4096, [10, 10], "bool")
    op(q, k, v, mask, 0.088, False, -1, 0, 0.0, None)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = op(q, k, v, mask, 0.088, False, -1, 0, 0.0, None)
    for filled in (10, 3000, 4096):  # the cache fills between replays: same buffers, new mask
        mask.copy_(static_cache_mask(2, 1, 4096, [filled, filled], "bool"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attention_reference(q.double(), k.double(), v.double(), mask, 0.088)
        assert (out.double() - ref).abs().max().item() < 2e-2, filled


def test_the_pass_and_the_kernel_agree_on_what_a_decode_step_is():
    from fa2_inductor.passes import support

    assert support.DECODE_MAX_QUERY_ROWS == DECODE_MAX_SQ


def test_finfo_min_rows_average_v_over_every_split():
    """HF's finfo.min fill leaves a row of equal scores (a uniform softmax, not an empty row); its keys span many
    splits, each of which must count with its own number of keys."""
    needs_kernel(128, "bf16")
    q, k, v = make_qkv(2, 8, 2, 1, 4099, 128, torch.bfloat16, seed=13)
    mask = torch.zeros(2, 1, 1, 4099, device=DEV)
    mask[0] = torch.finfo(torch.float32).min
    check_forward(q, k, v, False, 0.0, None, mask)
