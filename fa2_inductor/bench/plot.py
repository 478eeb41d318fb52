"""The PNG: TFLOP/s against seqlen, as the FlashAttention papers plot it, drawn from the JSON records alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _seqlen_label(seqlen: int) -> str:
    return f"{seqlen // 1024}k" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


def plot_title(env: dict) -> str:
    return f"Attention forward, {env.get('gpu') or env['device']} (torch {env['torch']})"


def draw_plot(records: Sequence[dict], impls: Sequence[str], path: Path, title: str) -> bool:
    """TFLOP/s against seqlen per implementation, one subplot per (dtype, causal) row and head dim column.

    Returns False (and says so) when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the GPU machine
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was drawn: pip install matplotlib (or the 'bench' extra)")
        return False
    rows = list(dict.fromkeys((r["dtype"], r["causal"]) for r in records))
    head_dims = sorted({r["head_dim"] for r in records})
    figure, axes = plt.subplots(
        len(rows), len(head_dims), figsize=(4.5 * len(head_dims), 3.4 * len(rows)), squeeze=False
    )
    for (dtype, causal), row_axes in zip(rows, axes):
        for head_dim, ax in zip(head_dims, row_axes):
            group = [r for r in records if (r["dtype"], r["causal"], r["head_dim"]) == (dtype, causal, head_dim)]
            _plot_group(ax, group, impls)
            ax.set_title(f"{dtype}, {'causal' if causal else 'non-causal'}, head dim {head_dim}", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", ncol=len(impls), bbox_to_anchor=(0.5, 1.0))
    figure.suptitle(title, y=1.04)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return True


def _plot_group(ax, group: Sequence[dict], impls: Sequence[str]) -> None:
    seqlens = sorted({r["seqlen"] for r in group})
    for index, impl in enumerate(impls):
        points = [
            (r["seqlen"], r["measurements"][impl]["tflops"])
            for r in group
            if r["measurements"].get(impl, {}).get("status") == "ok"
        ]
        # Every implementation keeps its label and colour even where it ran nowhere, so the legend is whole.
        xs, ys = zip(*sorted(points)) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=impl, color=f"C{index}")
    ax.set_xscale("log", base=2)
    if seqlens:
        ax.set_xticks(seqlens, [_seqlen_label(s) for s in seqlens])
    ax.set_xlabel("seqlen")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
