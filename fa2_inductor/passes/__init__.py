"""The Inductor graph pass that puts attention on ``torch.ops.fa2_inductor.flash_attention_fwd``.

Imported lazily (on first compile), so ``import fa2_inductor`` stays light.
"""

from .graph_pass import (
    ATTENTION_PASS,
    AttentionPass,
    ComposedPass,
    match_site,
    with_attention_pass,
    without_attention_pass,
)

__all__ = [
    "ATTENTION_PASS",
    "AttentionPass",
    "ComposedPass",
    "match_site",
    "with_attention_pass",
    "without_attention_pass",
]
