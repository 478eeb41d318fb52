"""End-to-end benchmark of a Llama-shaped model: inference, and with ``--phases train train_padded`` a training
step (see fa2_inductor/bench_e2e.py).

    python examples/benchmark_hf_model.py            # H200: 4 layers, hidden 2048, 2k and 8k tokens, bf16
    python examples/benchmark_hf_model.py --tiny     # CPU: a 2-layer float32 model, to see it work

Same as ``python -m fa2_inductor.bench_e2e``; every option of that module is accepted. Without a GPU it
runs ``--tiny``.
"""

import sys

import torch

from fa2_inductor import bench_e2e

argv = sys.argv[1:]
if not torch.cuda.is_available() and "--tiny" not in argv:
    print("no CUDA device: running the tiny CPU model")
    argv.append("--tiny")
bench_e2e.main(argv)
