"""The compiled kernels, listed once. setup.py generates from this table, for the head dims and dtypes
a build selects, the instantiation sources (csrc/generated/*.cu, one compile unit each, so they build
in parallel) and the binding's table (csrc/generated/kernel_table.inc, included by csrc/api.cpp).

Every selected (head dim, dtype) compiles all of VARIANTS; the binding's entry for it points at each.
"""

from __future__ import annotations

HEAD_DIMS = (64, 128, 256)
DTYPES = {"bf16": "kBF16", "fp16": "kFP16"}

# Variant name -> (what it is, its explicit instantiations).
VARIANTS = {
    "plain": ("no mask", ["FA2_INSTANTIATE_FWD({d}, {t}, false)"]),
    "causal": ("causal (top-left), optional left window", ["FA2_INSTANTIATE_FWD({d}, {t}, true)"]),
    "maskbool": ("boolean mask (True = attend) with its pre-pass",
                 ["FA2_INSTANTIATE_FWD_MASKED({d}, {t}, kBool, false)", "FA2_INSTANTIATE_MASK_WORKSPACE({d}, {t}, kBool)"]),
    "maskbool_causal": ("boolean mask and causal/window positions",
                        ["FA2_INSTANTIATE_FWD_MASKED({d}, {t}, kBool, true)"]),
    "maskadd": ("additive float mask with its pre-pass",
                ["FA2_INSTANTIATE_FWD_MASKED({d}, {t}, kAdditive, false)",
                 "FA2_INSTANTIATE_MASK_WORKSPACE({d}, {t}, kAdditive)"]),
}

# Compile units that every build has once (not per head dim).
SHARED_UNITS = {
    "empty_rows": ("the empty-row fix-up (empty_rows)",
                   '#include "../fa2/empty_rows.hpp"\n'
                   "template cudaError_t fa2::run_fill_empty_rows<fa2::DType::kBF16>(const fa2::EmptyRowsParams&, cudaStream_t);\n"
                   "template cudaError_t fa2::run_fill_empty_rows<fa2::DType::kFP16>(const fa2::EmptyRowsParams&, cudaStream_t);\n"),
}

GENERATED_DIR = "csrc/generated"


def compile_units(head_dims, dtypes) -> dict[str, str]:
    """{path relative to the repo: source} of every compile unit of a build."""
    units = {}
    for d in sorted(head_dims):
        for name in sorted(dtypes):
            for variant, (what, lines) in VARIANTS.items():
                body = "\n".join(line.format(d=d, t=DTYPES[name]) for line in lines)
                units[f"{GENERATED_DIR}/fwd_hdim{d}_{name}_{variant}.cu"] = (
                    f"// Generated from csrc/kernel_table.py: forward, head dim {d}, {name}, {what}.\n"
                    f'#include "../fa2/launch.hpp"\n{body}\n')
    for unit, (what, source) in SHARED_UNITS.items():
        units[f"{GENERATED_DIR}/{unit}.cu"] = f"// Generated from csrc/kernel_table.py: {what}.\n{source}"
    return units


def binding_table(head_dims, dtypes) -> str:
    """The rows of api.cpp's kernel table, one FA2_ENTRY per compiled (head dim, dtype)."""
    rows = [f'FA2_ENTRY({d}, {DTYPES[name]}, "{name}")' for d in sorted(head_dims) for name in sorted(dtypes)]
    return "// Generated from csrc/kernel_table.py.\n" + "\n".join(rows) + "\n"
