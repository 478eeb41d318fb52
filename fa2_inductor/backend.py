"""The "fa2_inductor" torch.compile backend, and switching the pass on for the default backend.

``torch.compile(model, backend="fa2_inductor")`` finds ``fa2_inductor_backend`` through the
``torch_dynamo_backends`` entry point. It is Inductor (same ``mode`` and ``options``) with the attention
pass in ``joint_custom_pre_pass``, composed with any pass the user already put there.

For ``torch.compile(model)`` with the default backend: ``fa2_inductor.enable()`` / ``disable()``, or
``with fa2_inductor.enabled(): ...``.

Wherever the pass is on, AOTAutograd's cache is off. That cache stores what compiling produced *after* our
pass, so a hit skips the pass, and with it the counters and ``explain``'s report (a second run of a script
would say "0 sites rewritten" while the op runs). With it off the pass sees every graph; Inductor's own
FX-graph cache, keyed on the graph the pass produced, still spares the code generation (a warm compile of
examples/compile_hf_model.py: 4.0 s with both caches, 4.4 s with the FX-graph cache alone, 19 s cold).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

_HOOK = "joint_custom_pre_pass"
_AOT_CACHE = "enable_autograd_cache"  # torch._functorch.config
_aot_cache_before_enable: Optional[bool] = None


def fa2_inductor_backend(gm, example_inputs, mode: Optional[str] = None, options: Optional[dict[str, Any]] = None):
    import torch
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from .passes import with_attention_pass

    options = dict(options or {})
    options[_HOOK] = with_attention_pass(options.get(_HOOK, getattr(inductor_config, _HOOK)))
    # Inductor's own torch.compile wrapper turns mode and options into config exactly as for backend="inductor".
    inductor = torch._TorchCompileInductorWrapper(mode, options, None)
    with functorch_config.patch({_AOT_CACHE: False}):
        return inductor(gm, example_inputs)


def enable() -> None:
    """Adds the attention pass to Inductor's config, so the default backend rewrites attention too
    (and turns AOTAutograd's cache off until ``disable()``)."""
    global _aot_cache_before_enable
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from .passes import with_attention_pass

    setattr(inductor_config, _HOOK, with_attention_pass(getattr(inductor_config, _HOOK)))
    if _aot_cache_before_enable is None:
        _aot_cache_before_enable = getattr(functorch_config, _AOT_CACHE)
    setattr(functorch_config, _AOT_CACHE, False)


def disable() -> None:
    """Takes the attention pass out of Inductor's config again, keeping the user's own passes."""
    global _aot_cache_before_enable
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from .passes import without_attention_pass

    setattr(inductor_config, _HOOK, without_attention_pass(getattr(inductor_config, _HOOK)))
    if _aot_cache_before_enable is not None:
        setattr(functorch_config, _AOT_CACHE, _aot_cache_before_enable)
        _aot_cache_before_enable = None


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """The attention pass is on for compiles started inside the block (config is restored after)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from .passes import with_attention_pass

    with inductor_config.patch({_HOOK: with_attention_pass(getattr(inductor_config, _HOOK))}):
        with functorch_config.patch({_AOT_CACHE: False}):
            yield
