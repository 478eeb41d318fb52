"""Why a site stays with Inductor: the one set of refusal reasons, each with what it means.

A reason's value is the string users see: counters count ``refused:<value>`` and ``explain`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Refusal(str, Enum):
    def __new__(cls, value: str, meaning: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    # --- what the graph computes is not the op's attention ------------------------------------------
    SOFTMAX_NOT_LAST_DIM = "softmax_not_last_dim", "the softmax normalises over another dim than the keys"
    PROBS_USED_ELSEWHERE = "probs_used_elsewhere", "the attention probabilities are read by other ops too"
    PROBS_MODIFIED = "probs_modified", "the probabilities are changed between the softmax and P @ V"
    DROPOUT_ACTIVE = "dropout_active", "dropout with p > 0 on the probabilities"
    SOFTCAP = "softcap", "logit soft-capping (tanh) between the scores and the softmax"
    SCORE_TRANSFORM = "score_transform", "an op between q @ kᵀ and the softmax that is no scale, mask or cast"
    SCALE_AFTER_MASK = "scale_after_mask", "the scores are scaled after a mask was applied"
    NON_FLOAT_ADDITIVE_MASK = "non_float_additive_mask", "an integer or boolean tensor added to the scores"
    FINITE_FILL_VALUE = "finite_fill_value", "masked scores replaced by a value that is not exactly an additive mask"
    UNSUPPORTED_ARGUMENT = "unsupported_argument", "an op of the chain with an argument that changes its math"
    VALUE_CHANGING_CAST = "value_changing_cast", "a cast in the chain that changes values the op would keep"
    UNRECOGNISED_SCORES = "unrecognised_scores", "the softmax input is not traced back to q @ kᵀ"
    UNRECOGNISED_LAYOUT = "unrecognised_layout", "q, k, v or the output in a layout the op cannot take as a view"
    UNRECOGNISED_PROBS = "unrecognised_probs", "the probabilities of a softmax over scores reach no P @ V the pass can follow"
    ATTENTION_SINKS = "attention_sinks", "the softmax also normalises over sink logits that are not one per query head"
    # --- the decision about a recognised attention --------------------------------------------------
    INTERMEDIATE_USED_ELSEWHERE = "intermediate_used_elsewhere", "scores or probabilities are read outside the site"
    TRAINING_SHARED_INPUT = "training_shared_input", "q, k or v (or a view inside the site) also feed other ops"
    TRAINING_BACKWARD_UNRECOGNISED = "training_backward_unrecognised", "the site's backward has no single incoming gradient"
    TRAINING_GRADIENT_UNMAPPED = "training_gradient_unmapped", "a gradient the site's backward returns is not one the op computes"
    DTYPE = "dtype", "q, k, v in a dtype the op does not take"
    MASK_DTYPE = "mask_dtype", "a mask that is neither boolean nor floating"
    NOT_COMPUTABLE = "not_computable", "the op's input checks reject the call"
    OUTPUT_DTYPE = "output_dtype", "the site returns another dtype than the op would"
    OUTPUT_SHAPE = "output_shape", "the site returns another shape than the op would"
    # --- the device ---------------------------------------------------------------------------------
    DEVICE = "device", "a device the op has no rules for"
    CPU_DEVICE = "cpu_device", "a CPU graph while fa2_inductor.config.rewrite_on_cpu is off"
    KERNEL_UNSUPPORTED = "kernel_unsupported", "the CUDA kernel cannot run the call"
    DECODE_STEP = "decode_step", "few query rows against a short cache: the decode kernel's fixed cost, not measured to pay"
    SHORT_SEQUENCE = "short_sequence", "few keys: the op's fixed cost per call makes it slower than Inductor there"
    DENSE_ADDITIVE_MASK = "dense_additive_mask", "an additive mask with no proven structure: read per score, slower than Inductor"
    BACKWARD_UNSUPPORTED = "backward_unsupported", "the op's backward would run its slow reference"


@dataclass(frozen=True)
class Refused:
    """A refusal with what exactly triggered it (shown by ``explain``)."""

    reason: Refusal
    detail: str = ""
