"""Prints the ATen op chain of every distinct attention site in the tiny HF models (docs/hf_graphs.md).

    python scripts/dump_hf_graphs.py [family ...] [--impl eager|sdpa] [--train] [--dtype bfloat16] [--device cuda]

Graphs are traced by AOTAutograd with Inductor's decomposition table, so they show the ops the
fa2_inductor pass sees. For each softmax (amax after decomposition) / SDPA node the script prints its backward slice (stopping at
projections, i.e. mm/addmm, and graph inputs) plus the matmul that consumes the probabilities.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.hf_families import FAMILIES, model_output  # noqa: E402

# Inductor decomposes softmax (amax, sub, exp, sum, div), so amax marks an eager attention site.
ANCHORS = ("amax", "_softmax", "scaled_dot_product")
# Where a backward slice ends: projections, embeddings, and rotary tables (long and not attention).
SLICE_STOP = {"mm", "addmm", "convolution", "embedding", "cos", "sin"}


def _op_name(node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)) if node.op == "call_function" else node.op


def _describe(node) -> str:
    def arg(a):
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        return repr(a)

    args = ", ".join([arg(a) for a in node.args] + [f"{k}={arg(v)}" for k, v in node.kwargs.items()])
    val = node.meta.get("val")
    meta = ""
    if isinstance(val, torch.Tensor):
        meta = f"  # {list(val.shape)} {str(val.dtype).replace('torch.', '')}"
    return f"{node.name} = {_op_name(node)}({args}){meta}"


def _is_anchor(node) -> bool:
    return node.op == "call_function" and any(a in _op_name(node) for a in ANCHORS)


def _backward_slice(anchor) -> set:
    seen, stack = set(), [anchor]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is not anchor and node.op == "call_function" and _op_name(node).split(".")[0] in SLICE_STOP:
            continue
        stack.extend(node.all_input_nodes)
    return seen


def _forward_until_matmul(anchor) -> set:
    """The nodes after a softmax up to the P @ V matmul (casts, dropout, views), with V's chain."""
    seen, frontier = set(), [anchor]
    for _ in range(12):
        nxt = []
        for node in frontier:
            for user in node.users:
                if user not in seen:
                    seen.add(user)
                    if _op_name(user).split(".")[0] == "bmm":
                        seen |= _backward_slice(user)
                    else:
                        nxt.append(user)
        frontier = nxt
    return seen


def attention_chains(gm: torch.fx.GraphModule) -> list[list[str]]:
    """One printed chain per distinct attention site (layers with identical chains are printed once)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chains, signatures = [], set()
    for anchor in filter(_is_anchor, gm.graph.nodes):
        nodes = _backward_slice(anchor)
        if "scaled_dot_product" not in _op_name(anchor):
            nodes |= _forward_until_matmul(anchor)
        ordered = sorted(nodes, key=order.__getitem__)
        signature = tuple(_op_name(n) for n in ordered if n.op == "call_function")
        if signature not in signatures:
            signatures.add(signature)
            chains.append([_describe(n) for n in ordered])
    return chains


def dump(family_name: str, impl: str, train: bool, dtype: torch.dtype, device: torch.device) -> str:
    family = FAMILIES[family_name]
    model = family.build(impl, dtype=dtype, device=device)
    inputs = family.make_inputs(model.config, device)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=capture, decompositions=select_decomp_table())
    compiled = torch.compile(model, backend=backend, fullgraph=False)
    if train:
        model.train()
        model_output(compiled(**inputs)).sum().backward()
    else:
        with torch.no_grad():
            compiled(**inputs)
    mode = "train" if train else "inference"
    lines = [f"### {family_name} / {impl} / {mode} / {str(dtype).replace('torch.', '')} / {device.type}  ({len(graphs)} graph(s))"]
    for gi, gm in enumerate(graphs):
        for ci, chain in enumerate(attention_chains(gm)):
            lines.append(f"-- graph {gi}, distinct site {ci}")
            lines.extend("    " + line for line in chain)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--impl", choices=("eager", "sdpa"), action="append")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu", help="cuda shows the CUDA SDPA overloads (default %(default)s)")
    args = parser.parse_args()
    for name in args.families:
        for impl in args.impl or ("eager", "sdpa"):
            torch._dynamo.reset()
            print(dump(name, impl, args.train, getattr(torch, args.dtype), torch.device(args.device)), flush=True)


if __name__ == "__main__":
    main()
