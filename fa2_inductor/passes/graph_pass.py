"""The Inductor joint-graph pass: find attention sites, decide, rewrite, count.

It runs as ``joint_custom_pre_pass``, i.e. on the ATen graph AOTAutograd hands to Inductor (forward
only for inference, forward + backward for training), before Inductor's own attention fusion.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import _extension, config
from ..reference import EmptyRows
from . import report
from .concat_keys import match_concatenated_keys
from .fx_utils import erase_unused, forward_users, is_backward_node, tensor_val
from .inductor_guards import shield_attention_chains
from .match_sdpa import is_sdpa, match_sdpa
from .match_softmax import match_softmax_attention, not_over_scores, softmax_at
from . import mask_structure
from .refusals import Refusal
from .rewrite import BackwardRegion, backward_region, forward_region, rewrite_site
from .site import AttentionSite
from .support import backward_refusal_reason, refusal_reason

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def match_site(node: fx.Node, graph_kind: str) -> Optional[AttentionSite]:
    """The attention site whose SDPA call or softmax is ``node``, if any; a softmax over no q·kᵀ scores
    is reported as such."""
    if node.op != "call_function" or is_backward_node(node):
        return None
    if is_sdpa(node):
        return match_sdpa(node)
    softmax = softmax_at(node)
    if softmax is None:
        return None
    site = match_concatenated_keys(softmax) or match_softmax_attention(softmax)
    why_not = not_over_scores(softmax) if site is None else None
    if why_not:
        shape = list(tensor_val(softmax.input).shape)
        report.record_other_softmax(f"softmax over dim {softmax.dim} of {shape}", why_not, graph_kind)
    return site


def _sequence_lengths(site: AttentionSite) -> tuple:
    q_shape, k_shape = site.q.meta["val"].shape, site.k.meta["val"].shape
    return q_shape[site.layouts["q"][-2]], k_shape[site.layouts["k"][-2]]


def _simplify_mask(site: AttentionSite) -> None:
    """A mask whose construction is proven becomes structure: causal/window positions as op arguments,
    the remaining (data) terms as a bool mask (see mask_structure)."""
    if site.mask is None or site.is_causal or site.extra_masks:
        return
    structure = mask_structure.analyse(site.mask, site.mask_negated, *_sequence_lengths(site))
    if structure is None:
        return
    site.mask, site.mask_negated, site.mask_terms = None, False, structure.terms
    site.is_causal, site.window_left = structure.is_causal, structure.window_left
    site.empty_rows = int(structure.empty_rows)
    if site.sinks is not None and site.empty_rows == EmptyRows.MEAN_V:
        # A fill that absorbs every score leaves the sink alone in the row: exp(fill - sink) is 0.
        site.empty_rows = int(EmptyRows.ZERO)
    site.notes.extend(structure.notes)


def _decide(site: AttentionSite) -> Optional[BackwardRegion]:
    """Sets the site's refusal if it must stay; returns its backward region in a training graph."""
    if site.refusal:
        return None
    _simplify_mask(site)
    refused = refusal_reason(site)
    if refused:
        site.refuse_as(refused)
        return None
    region = forward_region(site)
    site.forward_nodes = region
    shared = [n for n in region if n is not site.anchor and any(u not in region for u in forward_users(n))]
    inputs_of = _inputs_reaching(site, region)
    if any(len(inputs_of[n]) > 1 for n in shared):  # scores or probabilities that someone else reads
        site.refuse(Refusal.INTERMEDIATE_USED_ELSEWHERE)
        return None
    backward = backward_region(site, region)
    if backward is None:
        return None
    if shared:  # the shared view's backward would carry both users' gradients
        site.refuse(Refusal.TRAINING_SHARED_INPUT)
        return None
    refused = backward_refusal_reason(site)
    if refused:
        site.refuse_as(refused)
        return None
    return backward


def _inputs_reaching(site: AttentionSite, region: set) -> dict:
    """For each region node, which of q, k, v it is computed from."""
    reaching = {site.q: {"q"}, site.k: {"k"}, site.v: {"v"}}
    for node in site.anchor.graph.nodes:
        if node in region:
            reaching[node] = set().union(*(reaching.get(a, set()) for a in node.all_input_nodes))
    return reaching


class AttentionPass(CustomGraphPass):
    """Rewrites every attention the op computes exactly into ``fa2_inductor::flash_attention_fwd``."""

    def __call__(self, graph: fx.Graph) -> None:
        graph_kind = "training" if any(is_backward_node(n) for n in graph.nodes) else "inference"
        found_site = False
        # Matched one at a time, in graph order: a site fed by an earlier one sees it already rewritten.
        for node in list(graph.nodes):
            site = None if node._erased else match_site(node, graph_kind)
            if site is None:
                continue
            backward = _decide(site)
            if site.refusal is None:
                rewrite_site(site, backward)
            elif site.replaces is not None:  # a site rebuilt beside the graph (concat_keys) stays: drop it
                erase_unused(site.anchor)
            found_site = True
            report.record(site, graph_kind)
        # Rewrites leave the replaced nodes dead, and so may a refused site's matcher.
        if shield_attention_chains(graph) or found_site:
            graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        # The pass's sources, the op's support rules (in the built extension, when there is one) and every
        # knob it reads decide its output.
        files = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "passes", "*.py")))
        files += [os.path.join(_PACKAGE_DIR, name) for name in ("_cuda.py", "ops.py", "reference.py", "config.py")]
        build = "none" if _extension.C is None else os.stat(_extension.C.__file__).st_mtime_ns
        state = f"rewrite_on_cpu={config.rewrite_on_cpu};kernel_build={build}"
        return get_hash_for_files(tuple(files), state)


class ComposedPass(CustomGraphPass):
    """Several passes in one hook: torch 2.11 takes a single pass object per hook, later versions a list."""

    def __init__(self, passes) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Optional[tuple]:
        ids = []
        for graph_pass in self.passes:
            if not isinstance(graph_pass, CustomGraphPass) or graph_pass.uuid() is None:
                return None  # an opaque user pass: Inductor must not cache
            ids.append(graph_pass.uuid())
        return tuple(ids)


ATTENTION_PASS = AttentionPass()


def _passes_in(hook_value) -> list:
    """The passes a hook value holds (None, one pass, a list or tuple, or our ComposedPass), flattened."""
    if hook_value is None:
        return []
    if isinstance(hook_value, ComposedPass):
        return list(hook_value.passes)
    if isinstance(hook_value, (list, tuple)):
        return [p for item in hook_value for p in _passes_in(item)]
    return [hook_value]


def with_attention_pass(hook_value) -> CustomGraphPass:
    """Our pass first, then whatever the user configured for the same hook (idempotent)."""
    others = [p for p in _passes_in(hook_value) if p is not ATTENTION_PASS]
    return ComposedPass([ATTENTION_PASS, *others])


def without_attention_pass(hook_value):
    """The hook value with our pass taken out: None, the user's single pass, or a composition."""
    others = [p for p in _passes_in(hook_value) if p is not ATTENTION_PASS]
    if not others:
        return None
    return others[0] if len(others) == 1 else ComposedPass(others)
