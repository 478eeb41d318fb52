"""The "fa2_inductor" torch.compile backend, and switching the pass on for the default backend.

``torch.compile(model, backend="fa2_inductor")`` finds ``fa2_inductor_backend`` through the
``torch_dynamo_backends`` entry point. It is Inductor (same ``mode`` and ``options``) with the attention
pass in ``joint_custom_pre_pass``, composed with any pass the user already put there.

For ``torch.compile(model)`` with the default backend: ``fa2_inductor.enable()`` / ``disable()``, or
``with fa2_inductor.enabled(): ...``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

_HOOK = "joint_custom_pre_pass"


def fa2_inductor_backend(gm, example_inputs, mode: Optional[str] = None, options: Optional[dict[str, Any]] = None):
    import torch
    from torch._inductor import config as inductor_config

    from .passes import with_attention_pass

    options = dict(options or {})
    options[_HOOK] = with_attention_pass(options.get(_HOOK, getattr(inductor_config, _HOOK)))
    # Inductor's own torch.compile wrapper turns mode and options into config exactly as for backend="inductor".
    inductor = torch._TorchCompileInductorWrapper(mode, options, None)
    return inductor(gm, example_inputs)


def enable() -> None:
    """Adds the attention pass to Inductor's config, so the default backend rewrites attention too."""
    from torch._inductor import config as inductor_config

    from .passes import with_attention_pass

    setattr(inductor_config, _HOOK, with_attention_pass(getattr(inductor_config, _HOOK)))


def disable() -> None:
    """Takes the attention pass out of Inductor's config again, keeping the user's own passes."""
    from torch._inductor import config as inductor_config

    from .passes import without_attention_pass

    setattr(inductor_config, _HOOK, without_attention_pass(getattr(inductor_config, _HOOK)))


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """The attention pass is on for compiles started inside the block (config is restored after)."""
    from torch._inductor import config as inductor_config

    from .passes import with_attention_pass

    with inductor_config.patch({_HOOK: with_attention_pass(getattr(inductor_config, _HOOK))}):
        yield
