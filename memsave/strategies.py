"""Strategies written as functions of the ForwardGraph (the interface before planners).

A strategy ``fn(fg, **options) -> Selection`` registered with
:func:`register` keeps working: it is wrapped into a planner
(:mod:`memsave.planners`), so ``memsave.gradients(checkpoints=name)`` finds
it. New code can register a planner directly, which reads the whole
:class:`~memsave.problem.Problem` (costs, candidate cuts, the cached
evaluator) and returns the Plan: ``memsave.planners.register``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

from memsave import planners
from memsave.errors import ArgumentError
from memsave.planners.strategies import EXPENSIVE_OP_TYPES, MIN_SAVING_FRACTION, budget_refused

__all__ = ["Selection", "register", "unregister", "get", "available", "EXPENSIVE_OP_TYPES",
           "MIN_SAVING_FRACTION"]


@dataclasses.dataclass(frozen=True)
class Selection:
    """Tensors a strategy chose, and why.

    Attributes
    ----------
    checkpoints : tuple of int
        Tensor ids of the ForwardGraph.
    reasons : dict of int to str
        Why each tensor was chosen.
    note : str
        Empty, or what the user should know (e.g. nothing was found, and why).
    """

    checkpoints: tuple[int, ...]
    reasons: dict[int, str]
    note: str = ""


Strategy = Callable[..., Selection]


def register(name: str) -> Callable[[Strategy], Strategy]:
    """Register ``fn(fg, **options) -> Selection`` under ``name`` (a decorator).

    ``fn`` receives the :class:`~memsave.graph.ForwardGraph` and the
    ``strategy_options``; when it takes a ``costs`` parameter it also gets
    the problem's :class:`~memsave.costs.Costs`. It returns the function
    unchanged.
    """

    def deco(fn: Strategy) -> Strategy:
        if not callable(fn):
            raise ArgumentError(
                f"memsave.strategies.register: strategy={fn!r} for {name!r} is not callable; "
                "pass a function (fg, **options) -> Selection")
        planners.register(name, _as_planner(name, fn))
        return fn

    return deco


def _as_planner(name: str, fn: Strategy):
    try:
        wants_costs = "costs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        wants_costs = False

    @functools.wraps(fn)
    def planner(problem, *, budget=None, **options):
        if budget is not None:
            raise budget_refused(f"checkpoints={name!r}", "memsave")
        if wants_costs and "costs" not in options:
            options["costs"] = problem.costs
        sel = fn(problem.fg, **options)
        if not isinstance(sel, Selection):
            raise ArgumentError(
                f"memsave: strategy {name!r} returned {type(sel).__name__}; a strategy registered "
                "with memsave.strategies.register returns a memsave.strategies.Selection")
        return problem.plan(name, sel.checkpoints, sel.reasons, note=sel.note)

    planner.memsave_options_of = fn  # strategy_options are checked against fn's parameters
    return planner


def unregister(name: str) -> Strategy:
    """Remove the strategy (or planner) registered under ``name``; return it as :func:`get` would."""
    return _as_strategy(name, planners.unregister(name))


def get(name: str) -> Strategy:
    """The strategy registered under ``name``, as a function ``(fg, **options) -> Selection``.

    A strategy registered here is returned as it was; a planner (the
    built-in ``'memory'``, say) is wrapped: it runs on a
    :class:`~memsave.problem.Problem` of ``fg`` (with ``costs=`` when given).
    """
    return _as_strategy(name, planners.get(name))


def available() -> list[str]:
    """Names of the registered strategies and planners."""
    return planners.available()


def _as_strategy(name: str, planner) -> Strategy:
    original = getattr(planner, "memsave_options_of", None)
    if original is not None:
        return original

    @functools.wraps(planner)
    def strategy(fg, *, costs=None, **options) -> Selection:
        from memsave.problem import Problem

        plan = planners.run(planner, Problem(fg, costs=costs), options=options)
        return Selection(plan.checkpoint_ids, dict(plan.reason_of), plan.note)

    return strategy
