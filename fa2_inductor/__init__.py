"""fa2_inductor: FlashAttention-2 for Hopper behind a torch.library op and an Inductor pass.

Importing never initialises CUDA and never fails when the compiled kernel is missing.
"""

from . import config
from .ops import flash_attention
from .reference import EmptyRows, attention_reference

__all__ = ["EmptyRows", "attention_reference", "config", "flash_attention"]
__version__ = "0.1.0"
from .backend import disable, enable, enabled
from .explain import explain
from .distributed import register_sharding_rules_with_dtensor

register_sharding_rules_with_dtensor()

__all__ += ["disable", "enable", "enabled", "explain"]
