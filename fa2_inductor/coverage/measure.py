"""One family × attention implementation, measured in this process (``run`` starts it as a child).

``python -m fa2_inductor.coverage.measure FAMILY RESULT_DIR IMPL...`` measures the implementations one
after the other; for each it writes ``IMPL.started`` when it begins, ``IMPL.built`` once the model runs
uncompiled (a time-out after that is the compile's, not the build's) and the row as ``IMPL.json``.
Inductor compiles scalar C++ here (vectorisation off): about twice as fast to compile, and the pass sees
the same graph.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ..passes.refusals import Refusal
from .results import TOLERANCE, Row, Status

_SDPA = torch.nn.functional.scaled_dot_product_attention
SAMPLING_SEED = 2


class CountAttentionCalls(TorchFunctionMode):
    """Counts softmax and SDPA calls at the torch API level (what the model asks for, before decompositions)."""

    def __init__(self):
        super().__init__()
        self.softmax = 0
        self.sdpa = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            self.sdpa += 1
        elif getattr(func, "__name__", "") == "softmax":  # torch.softmax, F.softmax, Tensor.softmax
            self.softmax += 1
        return func(*args, **(kwargs or {}))


def first_float_output(output) -> torch.Tensor:
    """The logits where the model returns them, else its first floating-point tensor (depth first)."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            return output
        raise ValueError("an integer tensor")
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else []
    for value in values:  # ModelOutput is a dict; caches and other objects are skipped
        try:
            return first_float_output(value)
        except ValueError:
            continue
    raise ValueError("the model returned no floating-point tensor")


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text[:200]


def measure(family: str, implementation: str, built_marker: Path | None = None) -> Row:
    from . import models

    start = time.perf_counter()
    row = Row(family, implementation, Status.BUILD_FAILED)
    try:
        row.model_class = models.model_class_name(family)
        if implementation not in models.implementations(family):
            row.status = Status.NOT_SUPPORTED
            return row
        model, inputs = models.build(family, implementation)
        if "use_cache" in _forward_parameters(model):
            inputs["use_cache"] = False  # one prefill forward: no cache objects in the graph
        calls = CountAttentionCalls()
        with torch.no_grad(), calls:
            expected = first_float_output(_run_seeded(model, inputs))
    except Exception as error:
        row.error = one_line(error)
        row.seconds = time.perf_counter() - start
        return row
    if built_marker is not None:
        built_marker.touch()
    if calls.softmax == calls.sdpa == 0:
        row.status = Status.ATTENTION_FREE
    else:
        _compile_and_compare(row, model, inputs, expected, calls)
    row.seconds = time.perf_counter() - start
    return row


def _forward_parameters(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _compile_and_compare(row: Row, model, inputs: dict, expected: torch.Tensor, calls: CountAttentionCalls) -> None:
    import fa2_inductor
    from fa2_inductor.passes import report

    fa2_inductor.config.rewrite_on_cpu = True
    torch._dynamo.reset()
    try:
        with report.collecting() as records, torch.no_grad():
            got = first_float_output(_run_seeded(torch.compile(model, backend="fa2_inductor"), inputs))
    except Exception as error:
        row.status, row.error = Status.CRASHED, one_line(error)
        row.note = _inductor_alone(model, inputs, expected)[0]
        return
    row.sites_total = len(records)
    row.sites_rewritten = sum(record.rewritten for record in records)
    row.refusals = dict(Counter(str(record.reason) for record in records if not record.rewritten))
    row.refusal_details = sorted({f"{record.reason}: {record.detail}" for record in records
                                  if not record.rewritten and record.detail})
    row.other_softmaxes = sorted({softmax.why for softmax in records.other_softmaxes})
    row.max_abs_diff = _max_abs_diff(got, expected)
    equal = _close(got, expected)
    if calls.sdpa > row.sites_total:
        row.note = f"{calls.sdpa} SDPA calls, {row.sites_total} sites recognised"
    elif row.sites_total == 0:
        seen = f", {len(records.other_softmaxes)} seen over no q·kᵀ scores" if records.other_softmaxes else ""
        row.note = f"{calls.softmax} softmax calls in the uncompiled forward{seen}"
    if not equal:
        row.note, inductor_diff = _inductor_alone(model, inputs, expected)
        # As close as plain Inductor gets (FlashAttention's rule: within twice its difference) is equal:
        # Inductor's own fusions round differently from eager, the pass is not the cause.
        equal = row.max_abs_diff <= 2 * inductor_diff
    if not equal:
        row.status = Status.LOGITS_DIFFER
    elif row.sites_total == 0 and calls.sdpa == 0 and len(records.other_softmaxes) >= calls.softmax:
        row.status = Status.SOFTMAX_ONLY
    elif row.sites_total == 0:
        row.status = Status.NO_ATTENTION
    else:
        row.status = Status.FULL if row.sites_rewritten == row.sites_total else _refused_status(row.refusals)


def _refused_status(refusals: dict) -> Status:
    """BEYOND_OP where the op's own input checks reject every refused site, PARTIAL otherwise."""
    return Status.BEYOND_OP if set(refusals) == {str(Refusal.NOT_COMPUTABLE)} else Status.PARTIAL


def _max_abs_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        return float("inf")
    both_nan = got.isnan() & expected.isnan()
    difference = (got.double() - expected.double()).abs().masked_fill(both_nan, 0.0)
    return difference.nan_to_num(nan=float("inf")).max().item() if got.numel() else 0.0


def _run_seeded(model, inputs: dict):
    """One forward from the same random state, so that models that sample (VITS's durations, ViT-MAE's
    masking) draw the same numbers in every run; the compiled runs draw them as eager does (fallback_random)."""
    torch.manual_seed(SAMPLING_SEED)
    with torch._inductor.config.patch(fallback_random=True):
        return model(**inputs)


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.shape == expected.shape and torch.allclose(got, expected, **TOLERANCE)


def _inductor_alone(model, inputs: dict, expected: torch.Tensor) -> tuple[str, float]:
    """(what plain Inductor gives, its max |diff| to eager: 0 where it matches, -1 where it raised)."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = first_float_output(_run_seeded(torch.compile(model, backend="inductor"), inputs))
    except Exception as error:
        return f"plain Inductor raised {one_line(error)}", -1.0
    if _close(got, expected):
        return "plain Inductor matches", 0.0
    diff = _max_abs_diff(got, expected)
    return f"plain Inductor differs too (max |diff| {diff:.3g})", diff


def main(argv: list[str]) -> None:
    family, result_dir, *implementations = argv
    result_dir = Path(result_dir)
    torch._inductor.config.compile_threads = 1  # the sweep runs its jobs side by side instead
    torch._inductor.config.cpp.vec_isa_ok = False
    for implementation in implementations:
        (result_dir / f"{implementation}.started").touch()
        try:
            row = measure(family, implementation, result_dir / f"{implementation}.built")
        except Exception as error:  # a bug of the sweep itself still gives a row
            traceback.print_exc()
            row = Row(family, implementation, Status.CRASHED, error=one_line(error))
        (result_dir / f"{implementation}.json").write_text(json.dumps(row.to_json()))


if __name__ == "__main__":
    main(sys.argv[1:])
