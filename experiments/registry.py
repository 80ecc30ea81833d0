"""What the study measures: one entry per gradient method, one per model.

Adding a method to the study is one :func:`method` call below; adding a
model is one :class:`models.Model` in ``models.MODELS`` (it carries its
default sweep, batch size and title). ``study.py`` reads nothing else (importing this imports TensorFlow, through models): its
command line, the child processes, the tables and the plots all come from
these two registries.

A method is

- ``arch``: the forward-pass hooks (``models.Arch`` and subclasses: tagging
  for ``'collection'``, ``tf.recompute_grad`` groups), built per step;
- ``gradients(loss_fn, variables, ctx) -> (loss, grads)``: how it
  differentiates; ``ctx`` holds what other methods measured first in the
  same process (e.g. ``ctx["peak_bytes"]["recompute_grad"]``);
- ``after``: methods to measure before this one is built (their peaks go in
  ``ctx``), so a method can be defined relative to another;
- ``largest_only``: run only at the largest size of each sweep;
- ``models``: the models it runs on (None: all); ``default``: whether it is
  in the study when ``--methods`` is not given; ``search``: whether the
  max-depth search probes it; ``style``: matplotlib style;
  ``expected_errors``: exceptions that are a result (an infeasible budget
  is reported, not a failure).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import models

BASELINE = "GradientTape"


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    arch: Callable[[], models.Arch]
    gradients: Callable  # (loss_fn, variables, ctx) -> (loss, grads)
    style: dict
    models: tuple[str, ...] | None = None  # None: every model
    default: bool = True
    search: bool = True  # take part in the max-depth search (ResNet under a memory cap)
    largest_only: bool = False  # run at the largest size of each sweep only (the Pareto depth)
    after: tuple[str, ...] = ()  # measured first; their peaks reach ``ctx``
    #: exception type names that are a result, not a failure (an infeasible budget)
    expected_errors: tuple[str, ...] = ()

    def runs_on(self, model: str) -> bool:
        return self.models is None or model in self.models

    def expects(self, exc: BaseException) -> bool:
        """Whether ``exc`` (or what it wraps: tf.function re-raises as StagingError) is expected."""
        seen = exc
        while seen is not None:
            if type(seen).__name__ in self.expected_errors:
                return True
            seen = seen.__cause__ or seen.__context__
        return any(f"{name}:" in str(exc) for name in self.expected_errors)


METHODS: dict[str, Method] = {}


def method(name: str, arch: Callable[[], models.Arch], gradients: Callable, style: dict,
           **kw) -> Method:
    """Register a method (one entry); its position is its column and legend order."""
    if name in METHODS:
        raise ValueError(f"registry: method {name!r} is registered already")
    METHODS[name] = Method(name, arch, gradients, style, **kw)
    return METHODS[name]


# -- gradient functions -----------------------------------------------------------------


def _tape(loss_fn, variables, ctx):
    import tensorflow as tf

    with tf.GradientTape() as t:
        loss = loss_fn()
    return loss, t.gradient(loss, variables)


def _symbolic(loss_fn, variables, ctx):
    import tensorflow as tf

    loss = loss_fn()
    return loss, tf.gradients(loss, variables)


def memsave_gradients(checkpoints="memory", *, memory_budget=None,
                      budget_from: str | None = None) -> Callable:
    """``memsave.gradients`` with a strategy, a budget, or another method's measured peak as budget.

    With a budget, ``ctx["plan"]`` gets the budget in bytes (a fraction times
    the forecast plain peak, as memsave resolves it), for the report's
    measured peak / budget. The forecast comes from a plan with
    ``checkpoints='memory'``, cheap next to the budget solver's.
    """

    def gradients(loss_fn, variables, ctx):
        import memsave

        budget = memory_budget
        if budget_from is not None:
            budget = int(ctx["peak_bytes"][budget_from])
        loss = loss_fn()
        if budget is None:
            return loss, memsave.gradients(loss, variables, checkpoints=checkpoints)
        plain_bytes = memsave.plan(loss, variables, checkpoints="memory").baseline_peak_bytes
        ctx["plan"] = {"forecast_plain_peak_bytes": plain_bytes,
                       "budget_bytes": budget if isinstance(budget, int) else int(budget * plain_bytes)}
        return loss, memsave.gradients(loss, variables, memory_budget=budget)

    return gradients


# -- the methods ------------------------------------------------------------------------

method("GradientTape", models.Arch, _tape, dict(color="black", marker="o"))
method("tf.gradients", models.Arch, _symbolic, dict(color="grey", marker=".", linestyle=":"))
method("memsave-memory", models.Arch, memsave_gradients("memory"),
       dict(color="tab:blue", marker="s"))
method("memsave-speed", models.Arch, memsave_gradients("speed"),
       dict(color="tab:orange", marker="^"))
method("memsave-collection", models.TaggingArch, memsave_gradients("collection"),
       dict(color="tab:green", marker="D"))
method("recompute_grad", models.RecomputeArch, _tape, dict(color="tab:red", marker="v"))

#: Fractions of the forecast plain peak given as ``memory_budget`` (issue 9).
BUDGET_FRACTIONS = (0.2, 0.35, 0.5, 0.75)
_BUDGET_SHADES = ("#08306b", "#2171b5", "#6baed6", "#c6dbef")
for _f, _shade in zip(BUDGET_FRACTIONS, _BUDGET_SHADES):
    method(f"memsave-budget-{_f:g}", models.Arch, memsave_gradients(memory_budget=_f),
           dict(color=_shade, marker="P", linestyle="--"), models=("resnet", "unet"),
           search=False, largest_only=True, expected_errors=("MemoryBudgetError",))
method("memsave-budget=recompute_grad", models.Arch,
       memsave_gradients(budget_from="recompute_grad"),
       dict(color="tab:purple", marker="*", linestyle="--"), models=("resnet", "unet"),
       search=False, largest_only=True, after=("recompute_grad",), expected_errors=("MemoryBudgetError",))


def methods_for(model: str, names, *, largest: bool = True) -> list[str]:
    """The names in ``names`` that run on ``model`` (at its largest size or not), plus what
    they need measured first."""
    out: list[str] = []
    for n in names:
        m = METHODS[n]
        if not m.runs_on(model) or (m.largest_only and not largest):
            continue
        for dep in m.after:
            if dep not in out:
                out.append(dep)
        if n not in out:
            out.append(n)
    return out


def default_methods() -> list[str]:
    return [n for n, m in METHODS.items() if m.default]


MODELS = models.MODELS
