"""The compiled kernels, listed once. setup.py generates from this table, for the head dims and dtypes
a build selects, the instantiation sources (csrc/generated/*.cu, one compile unit each, so they build
in parallel) and the binding's table (csrc/generated/kernel_table.inc, included by csrc/api.cpp).

Every selected (head dim, dtype) compiles all of VARIANTS (the backward ones where BACKWARD_HEAD_DIMS has the
head dim); the binding's entries for it point at each.
"""

from __future__ import annotations

HEAD_DIMS = (64, 96, 128, 192, 256)
# What a build compiles unless FA2_INDUCTOR_HEAD_DIMS says otherwise; any other head dim (a multiple of 8) runs
# on the next larger one. 96 is built on request: 8-14% faster than its padded run on 128 (H200), at five more
# compile units (the build's time: design.md §4).
DEFAULT_HEAD_DIMS = (64, 128, 192, 256)
# Head dims with backward kernels of their own; another's backward runs on the next larger one (96 on 128).
BACKWARD_HEAD_DIMS = (64, 128, 192, 256)
DTYPES = {"bf16": "kBF16", "fp16": "kFP16"}

FORWARD = "../fa2/launch.hpp"
BACKWARD = "../fa2/bwd_launch.hpp"
DECODE = "../fa2/decode.hpp"
# Unit name -> (what it is, the header its instantiations need, its explicit instantiations). Kernels that
# share a header share a unit in pairs: a pair costs about what one of its kernels alone does, with the same
# SASS (design.md §4), and pairs keep the units short enough to spread over a machine's cores.
VARIANTS = {
    "fwd_unmasked": ("forward, no mask; causal (top-left) with an optional left window", FORWARD,
                     ["FA2_INSTANTIATE_FWD({d}, {t}, false)", "FA2_INSTANTIATE_FWD({d}, {t}, true)"]),
    "fwd_masked": ("forward, boolean (True = attend) and additive masks with their pre-pass, causal/window "
                   "positions at run time", FORWARD,
                   ["FA2_INSTANTIATE_FWD_MASKED({d}, {t}, kBool)", "FA2_INSTANTIATE_MASK_WORKSPACE({d}, {t}, kBool)",
                    "FA2_INSTANTIATE_FWD_MASKED({d}, {t}, kAdditive)",
                    "FA2_INSTANTIATE_MASK_WORKSPACE({d}, {t}, kAdditive)"]),
    "fwd_decode": ("forward, split-KV for few query rows (every mask, causal/window)", DECODE,
                   ["FA2_INSTANTIATE_DECODE({d}, {t})"]),
    "bwd_unmasked": ("backward, no mask; causal (top-left)", BACKWARD,
                     ["FA2_INSTANTIATE_BWD({d}, {t}, false, kNone)", "FA2_INSTANTIATE_BWD({d}, {t}, true, kNone)"]),
    "bwd_masked": ("backward, boolean and additive masks (and the additive mask's gradient)", BACKWARD,
                   ["FA2_INSTANTIATE_BWD({d}, {t}, false, kBool)", "FA2_INSTANTIATE_BWD({d}, {t}, false, kAdditive)"]),
}

# Compile units that every build has once (not per head dim).
SHARED_UNITS = {
    "empty_rows": ("the empty-row fix-up (empty_rows)",
                   '#include "../fa2/empty_rows.hpp"\n'
                   "template cudaError_t fa2::run_fill_empty_rows<fa2::DType::kBF16>(const fa2::EmptyRowsParams&, cudaStream_t);\n"
                   "template cudaError_t fa2::run_fill_empty_rows<fa2::DType::kFP16>(const fa2::EmptyRowsParams&, cudaStream_t);\n"),
}

GENERATED_DIR = "csrc/generated"


# The build starts the units in this order of their headers, heaviest first, so that a parallel build ends
# on short jobs (backward units take the longest, decode units a tenth of that: design.md §4). setuptools
# compiles an extension's sources sorted by name (for reproducible builds), so a unit's name starts with its
# header's rank here; the shared units come last.
BUILD_ORDER = (BACKWARD, FORWARD, DECODE)


def compile_units(head_dims, dtypes) -> dict[str, str]:
    """{path relative to the repo: source} of every compile unit of a build, in BUILD_ORDER (names sort so)."""
    units = {}
    for rank, header in enumerate(BUILD_ORDER):
        for d in sorted(head_dims):
            for name in sorted(dtypes):
                for variant, (what, variant_header, lines) in VARIANTS.items():
                    if variant_header != header or (header == BACKWARD and d not in BACKWARD_HEAD_DIMS):
                        continue
                    body = "\n".join(line.format(d=d, t=DTYPES[name]) for line in lines)
                    units[f"{GENERATED_DIR}/{rank}_hdim{d}_{name}_{variant}.cu"] = (
                        f"// Generated from csrc/kernel_table.py: head dim {d}, {name}, {what}.\n"
                        f'#include "{header}"\n{body}\n')
    for unit, (what, source) in SHARED_UNITS.items():
        units[f"{GENERATED_DIR}/{len(BUILD_ORDER)}_{unit}.cu"] = (
            f"// Generated from csrc/kernel_table.py: {what}.\n{source}")
    return units


def binding_table(head_dims, dtypes) -> str:
    """The rows of api.cpp's kernel tables: FA2_ENTRY (forward) and FA2_BWD_ENTRY (backward) per compiled
    (head dim, dtype), each behind the macro of its table so one file serves both."""
    pairs = [(d, name) for d in sorted(head_dims) for name in sorted(dtypes)]
    forward = "\n".join(f'FA2_ENTRY({d}, {DTYPES[name]}, "{name}")' for d, name in pairs)
    backward = "\n".join(f"FA2_BWD_ENTRY({d}, {DTYPES[name]})" for d, name in pairs if d in BACKWARD_HEAD_DIMS)
    return ("// Generated from csrc/kernel_table.py.\n#if defined(FA2_ENTRY)\n" + forward + "\n#endif\n"
            "#if defined(FA2_BWD_ENTRY)\n" + backward + "\n#endif\n")


def host_cxx_standard(torch_version: str) -> str:
    """The C++ standard of the host code (api.cpp includes torch, whose headers need C++20 from torch 2.14 on,
    C++17 before)."""
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 14) else "-std=c++17"
