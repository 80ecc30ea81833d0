"""Planners: every way of choosing checkpoints, one signature, one registry (no TensorFlow).

A planner is a function ``(problem, *, budget=None, **options) -> Plan``:
it reads a :class:`~memsave.problem.Problem` (the graph, its costs, the
memory model, candidate cuts, the cached evaluator) and returns the
:class:`~memsave.record.Plan` that :func:`memsave.gradients` rewrites and
:func:`memsave.plan` shows. ``budget`` is ``memory_budget=`` (bytes, or a
fraction of the forecast plain peak) or None.

Registered here by name (``gradients(checkpoints=name)`` looks them up):

``'collection'``, ``'memory'``, ``'speed'``
    the strategies (:mod:`memsave.planners.strategies`); ``'memory'`` and
    ``'collection'`` given a budget hand it to ``'auto'``.
``'dp'``, ``'milp'``, ``'greedy'``, ``'auto'``
    the budget solvers (:mod:`memsave.planners.budget`); they need a budget.

A user's planner is registered with :func:`register`; a strategy written
for :func:`memsave.strategies.register` (a function of the ForwardGraph
returning a ``Selection``) is wrapped into one.

Examples
--------
>>> @memsave.planners.register("every_other")  # doctest: +SKIP
... def every_other(problem, *, budget=None):
...     keep = problem.keepable()[::2]
...     return problem.plan("every_other", keep, {t: "every other" for t in keep})
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from memsave.errors import ArgumentError, GraphMismatchError, MemoryBudgetError, OptionsError, \
    UnknownStrategyError
from memsave.record import Plan
from memsave.simulate import paused_gc

__all__ = ["Planner", "register", "unregister", "get", "available", "run", "check"]

Planner = Callable[..., Any]  # (problem, *, budget=None, **options) -> Plan

_REGISTRY: dict[str, Planner] = {}


def register(name: str, planner: Planner | None = None):
    """Register ``planner`` under ``name``; without ``planner``, a decorator.

    Raises ``ValueError`` when the name is taken (:func:`unregister` first),
    and when ``planner`` is not callable.
    """

    def deco(fn: Planner) -> Planner:
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"memsave.planners.register: name={name!r}; pass a non-empty string")
        if not callable(fn):
            raise ArgumentError(
                f"memsave.planners.register: planner={fn!r} for {name!r} is not callable; pass "
                "a function (problem, *, budget=None, **options) -> Plan")
        if not _takes_budget(fn):
            raise ArgumentError(
                f"memsave.planners.register: planner {fn!r} for {name!r} takes no budget= "
                "keyword; write it as (problem, *, budget=None, **options) -> Plan")
        if name in _REGISTRY:
            raise ArgumentError(f"memsave.planners.register: {name!r} is registered already; "
                             "unregister it first")
        _REGISTRY[name] = fn
        return fn

    return deco if planner is None else deco(planner)


def _takes_budget(fn) -> bool:
    """Whether ``fn`` can be called with ``budget=`` (True when its signature
    cannot be read)."""
    try:
        # (not the function a wrapper names: memsave.strategies.register's adapter takes budget=)
        params = inspect.signature(fn, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind == p.VAR_KEYWORD or (p.name == "budget" and p.kind in (
        p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)) for p in params)


def unregister(name: str) -> Planner:
    """Remove the planner registered under ``name`` and return it (built-ins too)."""
    try:
        return _REGISTRY.pop(name)
    except KeyError:
        raise UnknownStrategyError(
            f"memsave.planners.unregister: {name!r} is not registered; registered: "
            f"{available()}") from None


def get(name: str, *, api: str = "memsave.gradients",
        instead: str | None = "a list of tensors") -> Planner:
    """The planner registered under ``name``. ``instead``: what the caller
    also takes as ``checkpoints=``, for the error (None: nothing else)."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownStrategyError(
            f"{api}: checkpoints={name!r} is not a known strategy; use one of {available()}"
            + (f" or pass {instead}" if instead else "")) from None


def available() -> list[str]:
    """Names of the registered planners."""
    return sorted(_REGISTRY)


def run(name: str | Planner, problem, *, budget=None, options: Mapping[str, Any] | None = None,
        api: str = "memsave.gradients"):
    """Run the planner ``name`` (or a planner itself) on ``problem``: the one way
    memsave calls a planner.

    ``options`` (``strategy_options=``) are checked against the planner's
    keyword parameters first, so a misspelt option is an
    :class:`~memsave.errors.OptionsError` naming the accepted ones, not a
    TypeError from deep inside. Planners that take ``api`` get it, for
    their error messages. What the planner returns must be a Plan of
    ``problem`` (:meth:`memsave.problem.Problem.plan`).
    """
    planner = get(name, api=api) if isinstance(name, str) else name
    name = name if isinstance(name, str) else getattr(planner, "__name__", "planner")
    options = _as_options(options, api)
    if _check_options(planner, name, options, api):
        options["api"] = api
    checked = _checking(planner, name, api)
    # A planner builds and keeps many schedules (tuples, no cycles): paused,
    # the collector does not walk the process's TensorFlow objects again and
    # again (see memsave.simulate.paused_gc).
    with paused_gc():
        if _loops.decides_loops(name, budget, options) and problem.loops:
            # A planner that judges loops by a budget of its own ('speed')
            # says it with a ``loop_budget_bytes(problem, options, api)``.
            own = getattr(planner, "loop_budget_bytes", None)
            within = own(problem, options, api) if own is not None and budget is None else None
            return _loops.run(checked, problem, budget=budget, options=options, api=api,
                              within_bytes=within)
        return checked(problem, budget=budget, **options)


def check(name: str, *, budget=None, options: Mapping[str, Any] | None = None,
          api: str = "memsave.gradients", instead: str | None = "a list of tensors") -> None:
    """What :func:`run` checks before it reads a graph: ``name`` is
    registered, ``options`` are its options (and, for the built-in
    strategies, their values) and ``budget`` is bytes or a fraction. For
    callers that plan later (``memsave.keras.checkpointed`` plans when
    ``fit`` traces the step) and want a mistake reported now.
    ``instead``: as for :func:`get`."""
    planner = get(name, api=api, instead=instead)
    options = _as_options(options, api)
    _check_options(planner, name, options, api)
    if budget is not None:
        if getattr(planner, "refuses_budget", False):
            raise _strategies.budget_refused(f"checkpoints={name!r}", api)
        _budget.check_budget(budget, api=api)
    values = getattr(planner, "memsave_check_options", None)
    if values is not None:  # a built-in strategy's checks that need no graph
        values(budget=budget, api=api, **{k: v for k, v in options.items() if k != "api"})


def _checking(planner: Planner, name: str, api: str) -> Planner:
    """``planner``, raising when what it returns is not a Plan of the problem
    it was given (memsave would otherwise rewrite the graph by another
    graph's tensor ids, and leave every gradient None, or fail deep inside),
    or is above the budget it was given."""

    def checked(problem, **kwargs):
        plan = planner(problem, **kwargs)
        if not isinstance(plan, Plan):
            raise ArgumentError(
                f"{api}: planner {name!r} returned {type(plan).__name__}; a planner returns a "
                "memsave Plan of the problem it is given: problem.plan(name, checkpoint_ids, "
                "reasons)")
        if not _of(plan, problem):
            raise GraphMismatchError(
                f"{api}: planner {name!r} returned a Plan of another forward graph (made for "
                "another problem); a planner returns a Plan of the problem it is given: "
                "problem.plan(name, checkpoint_ids, reasons)")
        problem.checkpoint_ids(plan.checkpoint_ids, who=f"planner {name!r}", api=api)
        budget = kwargs.get("budget")
        if budget is not None and plan.budget is None:
            # The built-in planners that take a budget meet it or raise, and
            # say so in Plan.budget; a planner that does not is checked here.
            _fits(plan, budget, name, api)
        return plan

    return checked


def _fits(plan: Plan, budget, name: str, api: str) -> None:
    """Raise :class:`MemoryBudgetError` when ``plan``'s forecast peak is above ``budget``."""
    budget_bytes = _budget.resolve_budget(budget, plan.baseline_peak_bytes, api=api)
    peak = plan.predicted_peak_bytes
    if peak > budget_bytes:
        raise MemoryBudgetError(
            f"{api}: planner {name!r} returned a plan whose forecast peak, {peak:,} bytes, is "
            f"above memory_budget={budget!r} ({budget_bytes:,} bytes); pass memory_budget >= "
            f"{peak}, or plan with one that meets a budget (checkpoints='memory' with "
            "memory_budget=)",
            min_peak_bytes=peak)


def _of(plan: Plan, problem) -> bool:
    """Whether ``plan`` is a plan of ``problem``'s forward graph (of it, of one
    of its loop variants, or of a problem of an equal graph)."""
    base = getattr(plan.problem, "base", None)
    if base is problem.base:
        return True
    fg = getattr(base, "fg", None)
    return fg is not None and fg.numbering_key() == problem.base.fg.numbering_key()


def _as_options(options, api: str) -> dict:
    """``strategy_options`` as a dict, or an :class:`OptionsError` when it is
    not a mapping of option names."""
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise OptionsError(
            f"{api}: strategy_options must be a dict of option names to values "
            f"(e.g. {{'num_checkpoints': 4}}), got {options!r}")
    return dict(options)


def _check_options(planner: Planner, name: str, options: Mapping[str, Any], api: str) -> bool:
    """Raise :class:`OptionsError` for an option ``planner`` does not take;
    return whether it takes ``api``."""
    accepted = _keywords(planner)
    if accepted is None:
        return False
    unknown = sorted(set(options) - accepted - {"budget"})
    if unknown:
        raise OptionsError(
            f"{api}: strategy_options {unknown} are not options of {name!r}; it takes "
            f"{sorted(accepted - {'budget', 'api'}) or 'none'}")
    return "api" in accepted


def _keywords(fn) -> set[str] | None:
    """The keyword parameters ``fn`` takes, or None when it takes any (``**kwargs``)."""
    target = getattr(fn, "memsave_options_of", fn)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"problem", "fg"}


# The built-in planners register themselves on import.
from memsave.planners import budget as _budget  # noqa: E402
from memsave.planners import loops as _loops  # noqa: E402
from memsave.planners.loops import decides_loops  # noqa: E402,F401
from memsave.planners import strategies as _strategies  # noqa: E402,F401


def _solver_planner(core_name: str) -> Planner:
    def planner(problem, *, budget=None, time_limit_s: float | None = None,
                api: str = "memsave.gradients"):
        if budget is None:
            raise OptionsError(
                f"{api}: checkpoints={core_name!r} is a budget solver: pass memory_budget= "
                "(bytes, or a fraction of the forecast plain peak), or use a strategy such as "
                "checkpoints='memory'")
        return _budget.solve(problem, budget, solver=core_name, time_limit_s=time_limit_s,
                             api=api)

    planner.__name__ = planner.__qualname__ = core_name
    planner.__doc__ = (f"The {core_name!r} budget solver as a planner "
                       "(:func:`memsave.planners.budget.solve`).")
    return planner


for _name in ("auto", *_budget.CORES):
    register(_name, _solver_planner(_name))
