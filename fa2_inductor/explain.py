"""``fa2_inductor.explain(model_or_fn, *example_inputs)``: every attention site found, and its fate."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AttentionReport:
    sites: list  # passes.report.SiteRecord, in compile order
    other_softmaxes: list = field(default_factory=list)  # passes.report.OtherSoftmax: softmaxes over no q·kᵀ scores

    @property
    def rewritten(self) -> list:
        return [s for s in self.sites if s.rewritten]

    @property
    def refused(self) -> list:
        return [s for s in self.sites if not s.rewritten]

    def __str__(self) -> str:
        if self.sites:
            lines = [f"fa2_inductor: {len(self.rewritten)} of {len(self.sites)} attention sites rewritten"]
            lines += [f"  {i}. {site}" for i, site in enumerate(self.sites, 1)]
        else:
            lines = ["fa2_inductor: no attention found"]
        if self.other_softmaxes:
            lines.append(f"softmax calls over no q·kᵀ scores ({len(self.other_softmaxes)}):")
            lines += [f"  - {softmax}" for softmax in self.other_softmaxes]
        return "\n".join(lines)


def explain(model_or_fn, *example_inputs, **example_kwargs) -> AttentionReport:
    """Compiles and runs ``model_or_fn`` once with the fa2_inductor backend and reports every site.

    Inputs that require grad give the training graph (forward and backward). The pass runs on every
    compile, cached or not (see ``backend``), so Inductor's caches stay on.
    """
    import torch

    from .backend import fa2_inductor_backend
    from .passes import report

    def backend(gm, inputs):  # a fresh backend object: Dynamo recompiles even if the model ran before
        return fa2_inductor_backend(gm, inputs)

    with report.collecting() as records:
        torch.compile(model_or_fn, backend=backend)(*example_inputs, **example_kwargs)
    return AttentionReport(list(records), list(records.other_softmaxes))
