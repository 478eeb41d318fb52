"""Masks as structure: what a mask built in the graph hides, proven from how it is built.

Hugging Face (and most code) builds an attention mask as a conjunction: positions (causal, a sliding
window) AND data (the tokenizer's key padding), turned into an additive mask by ``where(mask, 0, fill)``.
Given to the op as one dense ``[B, 1, Sq, Sk]`` tensor it costs a read per score and a block
classification per layer. Taken apart it costs almost nothing: the positions become ``is_causal`` and
``window_left`` (arithmetic in the kernel), and the data terms, usually ``[B, 1, 1, Sk]``, stay a small
bool mask whose blocks the kernel skips.

Exact by construction:
* a conjunction is split only through ``bitwise_and``/``logical_and`` (and, under a negation, ``or``), and
  broadcasting ``expand``s, which all compute the same elementwise value;
* a term counts as a position term only if its subgraph reads no graph input and has static shapes: it
  is then evaluated once on CPU, and the resulting pattern is compared element by element with the
  causal/window pattern it is said to be; a static graph is specialised to these shapes, so this is a
  proof for every call of the graph;
* every other term is kept as it is, a bool tensor the op ANDs in;
* an additive mask is read as ``where(mask, 0, fill)`` (or its swapped form) only with a literal 0 and a
  fill that hides a key exactly as -inf does wherever the row has a visible key: -inf itself, or a finite
  fill at or below ``HIDING_FILL``. What a row with no visible key computes then depends on the fill, and
  the op is told (``EmptyRows``): -inf leaves it empty (0); a fill that absorbs any score added to it
  (``ABSORBING_FILL``: HF's finfo.min) makes every score of the row the fill, a uniform average of V; a
  fill between the two (cuDNN's -65504 for bool masks) shifts the whole row equally, which softmax ignores:
  attention over all keys, unmasked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..reference import EmptyRows
from .fx_utils import aten, is_op, prims, tensor_val

# Patterns with more elements are not evaluated (the proof would cost more than it saves at compile
# time): 2**28 covers a [1, 1, 16k, 16k] mask, a quarter of a second and 256 MiB of bools, once per compile.
MAX_EVALUATED_ELEMENTS = 1 << 28
# A finite fill at or below this absorbs any score it is added to (|scale * score| < 2**76 is absorbed in
# float32, bfloat16 and float16 alike: the fill's spacing there is >= 2**77), so every masked score of
# a row equals the fill. finfo(bfloat16/float32).min are far below; finfo(float16).min (-65504) is not.
ABSORBING_FILL = -(2.0**100)
# A fill at or below this hides a key exactly: exp(fill + (score - row max)) is 0 in float32 unless a hidden
# score exceeds the row's largest visible one by more than 9900 (then eager's own softmax is meaningless).
HIDING_FILL = -1.0e4

_AND_OPS = (aten.bitwise_and, aten.logical_and)
_OR_OPS = (aten.bitwise_or, aten.logical_or)
_NOT_OPS = (aten.bitwise_not, aten.logical_not)


@dataclass
class MaskStructure:
    """What the op is given for a mask: positions as arguments, the rest as bool terms to AND."""

    is_causal: bool = False
    window_left: int = -1
    terms: list = field(default_factory=list)  # (bool node, negated): the op's mask is their AND
    empty_rows: EmptyRows = EmptyRows.ZERO
    notes: list = field(default_factory=list)


@dataclass
class _Visibility:
    """``visible = AND of terms``; a row with no visible key computes ``empty_rows``."""

    terms: list
    empty_rows: EmptyRows


def analyse(mask: fx.Node, negated: bool, seq_q, seq_k) -> Optional[MaskStructure]:
    """The structure of a site's mask (bool: True = attend unless ``negated``; float: additive), or None
    when it cannot be proven (the mask then stays as it is)."""
    # The pass runs under the graph's fake mode; the proof needs real (small, CPU) tensors.
    with torch.utils._python_dispatch._disable_current_modes():
        visibility = _visibility(mask, negated)
        return None if visibility is None else _structure(visibility, seq_q, seq_k)


def _structure(visibility: "_Visibility", seq_q, seq_k) -> MaskStructure:
    positional, data = [], []
    for term in visibility.terms:
        value = _evaluate_positions(term[0], seq_q, seq_k)
        (data if value is None else positional).append((term, value))
    structure = MaskStructure(terms=[term for term, _ in data])
    pattern = _conjunction([(value, negate) for (_, negate), value in positional], seq_q, seq_k)
    if pattern is not None:
        _read_positions(structure, pattern, [term for term, _ in positional])
    else:  # no position term, or one that varies over batch or heads: they stay mask terms
        structure.terms.extend(term for term, _ in positional)
    empty_rows_possible = bool(structure.terms) or (pattern is not None and not bool(pattern.any(dim=-1).all()))
    if empty_rows_possible:
        structure.empty_rows = visibility.empty_rows
    return structure


def _read_positions(structure: MaskStructure, pattern: torch.Tensor, terms: list) -> None:
    """Turns the evaluated position pattern [Sq, Sk] into op arguments, or keeps its terms as mask terms."""
    if bool(pattern.all()):
        structure.notes.append("positions hide nothing")
        return
    window_left = _causal_window(pattern)
    if window_left is None:
        structure.terms.extend(terms)
        structure.notes.append("positions kept as a mask")
        return
    structure.is_causal, structure.window_left = True, window_left
    structure.notes.append("positions proven causal" + (f", window {window_left + 1}" if window_left >= 0 else ""))


def _causal_window(pattern: torch.Tensor) -> Optional[int]:
    """window_left (-1: none) when ``pattern`` is top-left causal, optionally with a left window; else None."""
    seq_q, seq_k = pattern.shape
    rows = torch.arange(seq_q).unsqueeze(1)
    cols = torch.arange(seq_k).unsqueeze(0)
    causal = cols <= rows
    if bool((pattern == causal).all()):
        return -1
    last_visible = pattern[-1].nonzero()
    if last_visible.numel() == 0:
        return None
    window_left = (seq_q - 1) - int(last_visible[0])
    if window_left < 0:
        return None
    return window_left if bool((pattern == (causal & (cols >= rows - window_left))).all()) else None


def _conjunction(values: list, seq_q, seq_k) -> Optional[torch.Tensor]:
    """AND of evaluated terms as an [Sq, Sk] pattern, or None when some term varies over batch or heads."""
    if not values:
        return None
    pattern = torch.ones(seq_q, seq_k, dtype=torch.bool)
    for value, negated in values:
        value = ~value if negated else value
        if any(size != 1 for size in value.shape[:-2]):
            return None
        pattern &= value.reshape(value.shape[-2:]) if value.dim() >= 2 else value
    return pattern


# ---- reading the mask's construction ------------------------------------------------------------


def _visibility(mask: fx.Node, negated: bool) -> Optional[_Visibility]:
    value = tensor_val(mask)
    if value is None:
        return None
    if value.dtype == torch.bool:
        return _Visibility(_conjunction_terms(mask, negated), EmptyRows.ZERO)
    if not value.dtype.is_floating_point or negated:
        return None
    where, casts = strip_value_preserving(mask)
    if not (is_op(where, aten.where) and len(where.args) == 3):
        return None
    condition, if_true, if_false = where.args
    if not _is_bool_node(condition):
        return None
    dtypes = [tensor_val(where).dtype, *casts]
    for zero, fill, cond_negated in ((if_true, if_false, False), (if_false, if_true, True)):
        empty_rows = _empty_rows_of_fill(_cast(constant_value(fill), dtypes))
        if _cast(constant_value(zero), dtypes) == 0.0 and empty_rows is not None:
            return _Visibility(_conjunction_terms(condition, cond_negated), empty_rows)
    return None


def strip_value_preserving(node: fx.Node) -> tuple[fx.Node, list]:
    """(source, casts): through ops that keep every value the mask broadcasts to — expand, copies, SDPA's
    alignment padding (a ``slice`` of a ``constant_pad_nd`` back to the original length) — and float
    casts, whose target dtypes are returned (innermost first) so the fill can be followed through them."""
    casts = []
    while True:
        if is_op(node, aten.expand, aten.alias, aten.clone, aten.contiguous):
            node = node.args[0]
        elif is_op(node, aten.slice) and is_op(node.args[0], aten.constant_pad_nd) and _undoes_padding(node):
            node = node.args[0].args[0]
        elif is_op(node, prims.convert_element_type) and tensor_val(node.args[0]).dtype.is_floating_point:
            casts.insert(0, node.args[1])
            node = node.args[0]
        else:
            return node, casts


def _undoes_padding(slice_node: fx.Node) -> bool:
    padded = slice_node.args[0]
    source = tensor_val(padded.args[0])
    args = list(slice_node.args) + [None] * (5 - len(slice_node.args))
    dim, start, end, step = args[1] or 0, args[2] or 0, args[3], args[4] or 1
    pad = list(padded.args[1])
    if dim % source.dim() != source.dim() - 1 or start != 0 or step != 1 or len(pad) != 2 or pad[0] != 0:
        return False
    return isinstance(end, int) and end == source.shape[-1]


def constant_value(node) -> Optional[float]:
    """The single value of a number, a 0-d constant op, or a graph constant whose elements are all equal."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if is_op(node, aten.scalar_tensor):
        return constant_value(node.args[0])
    if is_op(node, aten.full) and len(node.args) > 1:
        return constant_value(node.args[1])
    if is_op(node, aten.lift_fresh_copy, aten.clone, aten.alias):
        return constant_value(node.args[0])
    if is_op(node, prims.convert_element_type):
        return _cast(constant_value(node.args[0]), [node.args[1]])
    if isinstance(node, fx.Node) and node.op == "get_attr":
        constant = getattr(node.graph.owning_module, node.target, None)
        if isinstance(constant, torch.Tensor) and constant.numel() > 0:
            with torch.utils._python_dispatch._disable_current_modes():  # a real tensor, read under fake mode
                flat = constant.detach().reshape(-1).cpu()
                return float(flat[0]) if bool((flat == flat[0]).all()) else None
    return None


def constant_after_casts(node, casts: list) -> Optional[float]:
    """The single value of ``node`` (see ``constant_value``) as it comes out of ``casts``."""
    return _cast(constant_value(node), casts)


def _cast(value: Optional[float], dtypes: list) -> Optional[float]:
    """``value`` as it comes out of casts to each of ``dtypes`` in turn."""
    if value is None:
        return None
    t = torch.tensor(value, dtype=torch.float64)
    for dtype in dtypes:
        t = t.to(dtype)
    return float(t)


def _empty_rows_of_fill(value: Optional[float]) -> Optional[EmptyRows]:
    """What a row whose every key is hidden by ``value`` computes; None for a fill that does not hide."""
    if value is None or math.isnan(value) or value > HIDING_FILL:
        return None
    if value == -math.inf:
        return EmptyRows.ZERO
    return EmptyRows.MEAN_V if value <= ABSORBING_FILL else EmptyRows.ALL_KEYS


def finite_by_construction(mask: fx.Node) -> bool:
    """Whether every value of ``mask`` is finite by how the graph builds it: a ``where`` (or a constant)
    whose branches are finite constants, through value-preserving views and float casts."""
    source, casts = strip_value_preserving(mask)
    if is_op(source, aten.where) and len(source.args) == 3:
        branches = [_cast(constant_value(b), casts) for b in source.args[1:]]
        return all(b is not None and math.isfinite(b) for b in branches)
    value = _cast(constant_value(source), casts)
    return value is not None and math.isfinite(value)


def _conjunction_terms(node: fx.Node, negated: bool) -> list:
    """``node`` (bool, negated if asked) as a conjunction: [(term, negated)]."""
    while is_op(node, aten.expand, aten.alias, aten.clone):
        node = node.args[0]
    if is_op(node, *_NOT_OPS):
        return _conjunction_terms(node.args[0], not negated)
    splits = _OR_OPS if negated else _AND_OPS
    if is_op(node, *splits) and len(node.args) == 2 and all(_is_bool_node(a) for a in node.args):
        return _conjunction_terms(node.args[0], negated) + _conjunction_terms(node.args[1], negated)
    return [(node, negated)]


def _is_bool_node(arg) -> bool:
    value = tensor_val(arg)
    return value is not None and value.dtype == torch.bool


# ---- evaluating position terms ------------------------------------------------------------------


def _evaluate_positions(term: fx.Node, seq_q, seq_k) -> Optional[torch.Tensor]:
    """The concrete value of a term computed from positions alone (no graph input, static shapes), at most
    [.., Sq, Sk]; None for anything else."""
    value = tensor_val(term)
    if not isinstance(seq_q, int) or not isinstance(seq_k, int) or value.dim() < 2:
        return None
    if not all(isinstance(s, int) for s in value.shape) or value.numel() > MAX_EVALUATED_ELEMENTS:
        return None
    if tuple(value.shape[-2:]) not in {(seq_q, seq_k), (1, seq_k), (seq_q, 1), (1, 1)}:
        return None
    nodes = _position_subgraph(term)
    if nodes is None:
        return None
    try:
        concrete = _evaluate(nodes)
    except Exception:  # an op that cannot run eagerly here: no proof, the term stays a mask
        return None
    if not isinstance(concrete, torch.Tensor) or concrete.dtype != torch.bool:
        return None
    return concrete.expand(*concrete.shape[:-2], seq_q, seq_k)


def _position_subgraph(term: fx.Node) -> Optional[list[fx.Node]]:
    """The nodes computing ``term`` in graph order, or None if it reads a graph input or a symbolic size."""
    seen: dict[fx.Node, None] = {}
    stack = [term]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op not in ("call_function", "get_attr") or not _static(node):
            return None
        seen[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(term.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _static(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return all(isinstance(s, int) for s in value.shape)
    return node.op == "get_attr" or not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _on_cpu(arg):
    return torch.device("cpu") if isinstance(arg, torch.device) else arg


def _evaluate(nodes: list[fx.Node]):
    values: dict[fx.Node, object] = {}
    module = nodes[-1].graph.owning_module
    for node in nodes:
        if node.op == "get_attr":
            values[node] = getattr(module, node.target).cpu()
            continue
        args = fx.map_arg(node.args, values.__getitem__)
        kwargs = {k: _on_cpu(v) for k, v in fx.map_arg(node.kwargs, values.__getitem__).items()}
        values[node] = node.target(*args, **kwargs)
    return values[nodes[-1]]



def same_computation(a, b, depth: int = 8) -> bool:
    """``a`` and ``b`` compute the same values: one node, equal numbers or single-valued constants, or the
    same op on arguments that are the same computation (a mask built twice, e.g. ``mask == False`` once
    for the scores and once for the probabilities). Graph inputs and other nodes compare by identity."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_computation(x, y, depth) for x, y in zip(a, b))
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return type(a) is type(b) and a == b
    value_a, value_b = tensor_val(a), tensor_val(b)
    if value_a is not None and value_b is not None and value_a.dim() == value_b.dim() == 0 \
            and value_a.dtype == value_b.dtype:
        constant = constant_value(a)
        if constant is not None and constant == constant_value(b):
            return True
    if depth == 0 or a.op != "call_function" or b.op != "call_function" or a.target != b.target:
        return False
    if torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ()):  # two draws differ
        return False
    if a.kwargs.keys() != b.kwargs.keys():
        return False
    return same_computation(list(a.args), list(b.args), depth - 1) and all(
        same_computation(a.kwargs[key], b.kwargs[key], depth - 1) for key in a.kwargs)


def without_negations(condition, negated: bool) -> tuple:
    """(c, n) with ``condition`` read as ``c`` (negated when n) through bool negations."""
    while is_op(condition, *_NOT_OPS) and _is_bool_node(condition.args[0]):
        condition, negated = condition.args[0], not negated
    return condition, negated
