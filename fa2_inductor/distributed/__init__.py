"""fa2_inductor inside PyTorch's own parallelism (DTensor, FSDP2, tensor and context parallel).

``sharding``: DTensor sharding rules for the op. They are registered as soon as DTensor is loaded, and no
sooner: ``torch.distributed.tensor`` costs about a third of a second to import, more than fa2_inductor
itself, and a single-GPU user should not pay it. ``ring``: ring attention over a process group (context
parallelism) built on the op's log-sum-exp.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_DTENSOR = "torch.distributed.tensor"


def _register_sharding_rules() -> None:
    try:
        from . import sharding

        sharding.register()
    except Exception as error:  # a torch whose DTensor internals moved: DTensor calls of the op fail as before
        warnings.warn(f"fa2_inductor: DTensor sharding rules not registered: {error!r}", stacklevel=2)


class _AfterDTensorImport(importlib.abc.MetaPathFinder):
    """Runs the registration right after ``torch.distributed.tensor`` finishes importing (once)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_sharding_rules()

        spec.loader.exec_module = exec_then_register
        return spec


def register_sharding_rules_with_dtensor() -> None:
    """Registers the op's sharding rules now if DTensor is loaded, else when it is."""
    if _DTENSOR in sys.modules:
        _register_sharding_rules()
    elif not any(isinstance(finder, _AfterDTensorImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterDTensorImport())


from .ring import gather_sequence, ring_attention, shard_sequence  # noqa: E402  (torch.distributed only: cheap)

__all__ = ["gather_sequence", "register_sharding_rules_with_dtensor", "ring_attention", "shard_sequence"]
