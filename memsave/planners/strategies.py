"""The named strategies: ``'collection'``, ``'memory'``, ``'speed'`` (no TensorFlow).

Each is a planner, ``(problem, *, budget=None, **options) -> Plan``
(:mod:`memsave.planners`). They return internal tensors produced by
recomputable ops that are not ys; outputs of stateful ops and the xs are
kept anyway and are not chosen.

Memory is judged by the one model, through the problem's evaluator: the
automatic strategies (``'memory'``, ``'speed'``) compare plans counting every
byte (:attr:`memsave.problem.Problem.judge`), and keep a plan only when it
is forecast to save at least ``min_saving_fraction`` of the step's working
memory (:func:`worth_it`), saying by how much when it does not. Time is the
time model's (:mod:`memsave.timemodel`): both choose, among the plans that
meet their memory target, the one with the least forecast recompute time,
through the budget solvers (:func:`memsave.planners.budget.solve`):

``'memory'``
    the lowest forecast peak of its candidate plans, within
    :data:`MEMORY_PEAK_TOLERANCE`, as fast as possible;
``'speed'``
    the fastest plan under :data:`SPEED_BUDGET_FRACTION` of the plain peak.

Some 600 lines: the three strategies, the user's list (:func:`given`) and
the checks they share (options, :func:`worth_it`, the refusal messages)
are read together; the graph analysis they stand on is
:mod:`memsave.candidates`', the search :mod:`memsave.planners.budget`'s.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable

from memsave.candidates import CUT_REASON, SEGMENT_LIVE_FRACTION, SMALL_TENSOR_FRACTION, spread
from memsave.errors import CheckpointError, MemoryBudgetError, OptionsError
from memsave.planners import budget as _budget
from memsave.planners.budget import MEMORY_SEARCH_OPS, search_simulations
from memsave.planners import register
from memsave.problem import Problem
from memsave.record import Plan

__all__ = ["collection", "memory", "speed", "given", "worth_it", "candidate_plan",
           "budget_refused",
           "EXPENSIVE_OP_TYPES",
           "MIN_SAVING_FRACTION", "MEMORY_PEAK_TOLERANCE", "SPEED_BUDGET_FRACTION",
           "MEMORY_SEARCH_OPS", "MEMORY_SEARCH_PLANS"]

#: Op types whose outputs ``checkpoints='speed'`` keeps when asked by rule
#: (``strategy_options={'op_types': EXPENSIVE_OP_TYPES}``, what ``'speed'``
#: did before it planned with the time model): convolutions of every kind
#: and matrix products, the ops that dominate a forward pass, so that what
#: is recomputed is only the cheap elementwise work between them. The
#: budget solvers pick a segment's expensive outputs by forecast seconds
#: instead (:data:`memsave.planners.segments.EXPENSIVE_FACTOR`).
EXPENSIVE_OP_TYPES = frozenset(
    {
        "Conv",
        "Conv2D",
        "Conv3D",
        "Conv2DBackpropInput",
        "Conv3DBackpropInputV2",
        "DepthwiseConv2dNative",
        "MatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "Einsum",
    }
)

#: Smallest fraction of the step's predicted working memory (plain peak minus
#: resident variables and inputs, both from the simulator) that an automatic
#: strategy's plan must save to be used. Recomputation costs up to a forward
#: pass; a plan predicted to save less than this pays that for a saving
#: within the forecast's error, so the strategy keeps nothing and memsave
#: falls back to tf.gradients with a warning. Measured: a U-Net-36 plan
#: predicted 3% and saved 1-5% for 1.3x step time. Override with
#: ``min_saving_fraction=`` (0 keeps any plan).
MIN_SAVING_FRACTION = 0.1

#: ``'memory'`` takes any plan whose forecast peak (every byte counted) is
#: within this fraction above the lowest of its candidate plans, and of
#: those the one with the least forecast recompute time. A peak a few
#: percent higher buys much: the segments processed last in the backward
#: pass (the network's first layers) set the peak, so the others can keep
#: their expensive outputs or be stored for free. On the study's ResNet-110
#: (batch 32) 5% took the forecast step from 1.36x to 1.2x tf.gradients'
#: (the measured figures are in experiments/study.py's report). Override
#: with ``peak_tolerance=`` (0: the lowest peak, then the least time).
MEMORY_PEAK_TOLERANCE = 0.05

#: Under XLA, ``'memory'`` counts candidate plans whose forecast peaks are
#: within this fraction of the lowest as tied (``peak_tolerance=`` does not
#: apply), and takes the lowest working memory among them (the peak with
#: each gradient freed when complete), then the fewest checkpoints. Where
#: a loss scale holds every gradient to the step's end
#: (:attr:`memsave.MemoryModel.xla_update_in_step`), plans' peaks differ by
#: a few bytes where their measured peaks do not follow: on
#: keras.applications MobileNetV2 (``mixed_float16``, 64x64, batch 32, SGD
#: in the step) a plan of 7 checkpoints forecast 512 bytes below one of 6
#: and measured 72.8 MiB above the resident bytes against 60.4.
XLA_PEAK_TIE = 0.01

#: The most plans ``'memory'``'s search for time may simulate, however small
#: the graph: a simulation's cost is proportional to the graph, and so is
#: ``tf.gradients``', so the search's cost relative to the build is about
#: plans x (simulation / build). With :data:`MEMORY_SEARCH_OPS` alone, the
#: test zoo's 26-op U-Net allowed 1,538 plans and ``'memory'`` planned for
#: 1.5 s of CPU (2,230 simulations) against 0.03 s for ``tf.gradients``.
#: Graphs of 625 ops or more (the study's ResNet-110: 725) are bounded by
#: :data:`MEMORY_SEARCH_OPS` as before. ``'speed'`` is not capped: where its
#: search finds no plan under its budget it saves nothing (with 64 plans it
#: fell back to ``tf.gradients`` on the zoo's dropout chains, where the
#: whole search keeps four matmul outputs and saves 22%), while
#: ``'memory'`` keeps its fastest candidate plan.
MEMORY_SEARCH_PLANS = 64

#: ``'speed'``'s memory budget, as a fraction of the forecast plain step's
#: working memory: its peak (every byte counted) above the bytes every plan
#: holds (:meth:`Problem.floor`: inputs, weights, their gradients), so that
#: a model whose weights dominate its peak still gets a plan. A generous
#: one, so that the plan recomputes only
#: what is cheap to recompute and the step stays close to plain speed
#: (issue 19: budget 0.75 within 3% of plain's step on ResNet-110). The
#: fixed rule 'speed' followed before (keep every convolution's and
#: product's output) peaked at 0.74x on ResNet-110 for 1.14x the step.
#: Override with ``budget_fraction=``; for another trade-off pass
#: ``memory_budget=`` itself.
SPEED_BUDGET_FRACTION = 0.75

#: What to do when ``'memory'`` finds nothing worth keeping.
_CHOOSE_YOURSELF = (
    "pass checkpoints as a list of tensors, tag them with "
    "tf.compat.v1.add_to_collection('checkpoints', t), or use checkpoints='speed'"
)


def _plan(problem: Problem, name: str, chosen: Iterable[int], reason: Callable[[int], str],
          note: str = "") -> Plan:
    """The plan keeping ``chosen``, each for ``reason(t)``; a tensor no plan
    keeps (:meth:`Problem.fused_away`: a user's list, the collection) is
    replaced by the one that stands for it, or dropped when that is a y
    (kept anyway)."""
    fused, ys = problem.fused_away(), set(problem.fg.ys)
    reasons: dict[int, str] = {}
    for t in chosen:
        kept = fused.get(t, t)
        if kept == t:
            reasons[t] = reason(t)
        elif kept not in ys:
            reasons.setdefault(kept, (
                f"{reason(t)}, in place of {problem.fg.tensors[t].name} (TensorFlow fuses that "
                "sum into the convolution before it, with this activation)"))
    ids = sorted(reasons)
    return problem.plan(name, ids, {t: reasons[t] for t in ids}, note=note)


def _check_fraction(name: str, value: float, api: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise OptionsError(f"{api}: {name} must be in [0, 1), got {value!r}")


def _checks_options(check: Callable) -> Callable:
    """Give a built-in strategy ``check`` as ``memsave_check_options``: the
    checks of its option values that need no graph, which it runs first
    and :func:`memsave.planners.check` runs before any graph exists
    (``memsave.keras.checkpointed`` reports a bad value when it is called,
    not when ``fit`` traces)."""

    def deco(strategy: Callable) -> Callable:
        strategy.memsave_check_options = check
        return strategy

    return deco


def _check_collection_options(*, budget=None, solver: str = "auto", time_limit_s=None,
                              api: str = "memsave.gradients") -> None:
    if budget is None:
        _no_solver_options(solver, time_limit_s, "'collection'", api)
    else:
        _budget.check_solver(solver, time_limit_s, api=api)


def _check_speed_options(*, budget=None, budget_fraction: float = SPEED_BUDGET_FRACTION,
                         op_types=None, min_saving_fraction: float = MIN_SAVING_FRACTION,
                         solver: str = "auto", time_limit_s=None,
                         api: str = "memsave.gradients") -> None:
    if budget is not None:
        raise budget_refused("checkpoints='speed'", api)
    _check_fraction("min_saving_fraction", min_saving_fraction, api)
    if op_types is not None:
        if isinstance(op_types, str) or not isinstance(op_types, Iterable) \
                or not all(isinstance(t, str) for t in op_types):
            raise OptionsError(
                f"{api}: op_types must be a set of op type names (e.g. {{'MatMul', 'Conv2D'}}), "
                f"got {op_types!r}")
        _no_solver_options(solver, time_limit_s, "'speed' with op_types", api)
    else:
        _budget.check_solver(solver, time_limit_s, api=api)
        _check_budget_fraction(budget_fraction, api)


def _check_budget_fraction(budget_fraction, api: str) -> None:
    if isinstance(budget_fraction, bool) or not isinstance(budget_fraction, numbers.Real) \
            or not 0.0 < budget_fraction <= 1.0:
        raise OptionsError(f"{api}: budget_fraction must be in (0, 1], got {budget_fraction!r}")


def _check_memory_options(*, budget=None, num_checkpoints: int | None = None,
                          min_saving_fraction: float = MIN_SAVING_FRACTION,
                          peak_tolerance: float = MEMORY_PEAK_TOLERANCE, solver: str = "auto",
                          time_limit_s=None, api: str = "memsave.gradients", **_) -> None:
    if budget is not None:
        _budget.check_solver(solver, time_limit_s, api=api)
        return
    _no_solver_options(solver, time_limit_s, "'memory'", api)
    _check_fraction("min_saving_fraction", min_saving_fraction, api)
    if num_checkpoints is not None and (
            isinstance(num_checkpoints, bool) or not isinstance(num_checkpoints, numbers.Integral)
            or num_checkpoints < 0):
        raise OptionsError(
            f"{api}: strategy_options num_checkpoints must be an int >= 0, got {num_checkpoints!r}")
    _check_fraction("peak_tolerance", peak_tolerance, api)


def _no_solver_options(solver: str, time_limit_s, who: str, api: str) -> None:
    if solver != "auto" or time_limit_s is not None:
        raise OptionsError(
            f"{api}: strategy_options 'solver' and 'time_limit_s' choose how memory_budget= is "
            f"planned; {who} got them without a memory_budget")


def can_save(problem: Problem, *, min_saving_fraction: float) -> str:
    """Empty when some plan may save ``min_saving_fraction`` of the working
    memory, else why none can (without simulating any plan).

    No plan's peak goes below :meth:`Problem.floor` (the inputs, variables
    and the xs' gradients alive at the end of the step): when plain
    ``tf.gradients`` already peaks within that fraction of it (small batches,
    where the weights' gradients make the peak), no checkpoint can help.
    """
    if min_saving_fraction == 0.0:
        return ""
    judge = problem.judge
    base = problem.forecast(None, model=judge)
    floor = problem.floor(model=judge)
    working = max(base.peak_bytes - base.resident_bytes, 1)
    if (base.peak_bytes - floor) / working >= min_saving_fraction:
        return ""
    return (
        f"tf.gradients' forecast peak (every buffer counted) is {base.peak_bytes:,} bytes, of "
        f"which {floor:,} (the inputs, variables and the xs' gradients) stay alive to the end "
        f"of the step whatever is recomputed: no plan can save min_saving_fraction="
        f"{min_saving_fraction:g} of the {working:,} bytes of working memory (the gradients of "
        "the weights make the peak: a larger batch would leave something to save); ")


def worth_it(problem: Problem, plan: Plan, *, min_saving_fraction: float, who: str) -> Plan:
    """``plan``, or an empty one when it saves too little.

    The saving is ``baseline - predicted`` peak, counting every byte, as a
    fraction of the baseline's working memory (its peak minus the resident
    variables and inputs, which no plan can free). Under
    ``min_saving_fraction`` the plan would pay recomputation for a saving
    within the forecast's error: nothing is kept, and the note gives the
    figures.
    """
    if not plan.checkpoint_ids or min_saving_fraction == 0.0:
        return plan  # 0 keeps any plan
    base = problem.forecast(None, model=problem.judge)
    predicted = problem.peak(plan.schedule, model=problem.judge)
    working = max(base.peak_bytes - base.resident_bytes, 1)
    saving = (base.peak_bytes - predicted) / working
    if saving >= min_saving_fraction:
        return plan
    return problem.plan(plan.strategy, (), {}, note=(
        f"{who}'s plan ({len(plan.checkpoint_ids)} checkpoints) would take the predicted "
        f"peak (every buffer counted) from {base.peak_bytes:,} to {predicted:,} bytes, a saving "
        f"of {saving:.1%} of the {working:,} bytes of working memory (less than "
        f"min_saving_fraction={min_saving_fraction:g}), so recomputing would cost time for "
        "next to nothing; "
        + (_CHOOSE_YOURSELF if who != "'speed'"
           else _CHOOSE_YOURSELF.replace("checkpoints='speed'", "checkpoints='memory'"))
    ))


def given(problem: Problem, checkpoints: Iterable[int]) -> Plan:
    """The plan keeping the tensors the user listed (already validated)."""
    ids = tuple(checkpoints)
    return _plan(problem, "list", ids, lambda t: "given",
                 note="" if ids else "the checkpoint list is empty")


@register("collection")
@_checks_options(_check_collection_options)
def collection(problem: Problem, *, budget=None, solver: str = "auto",
               time_limit_s: float | None = None, api: str = "memsave.gradients") -> Plan:
    """Keep the tensors the user added to the ``'checkpoints'`` collection.

    Tagged tensors that are not between the xs and the ys are not part of
    the graph and so are ignored: a collection is shared by every gradient
    computation in the graph. With a ``budget`` (``checkpoints`` left at its
    default), the budget solver ``solver`` plans instead.
    """
    _check_collection_options(budget=budget, solver=solver, time_limit_s=time_limit_s, api=api)
    if budget is not None:
        return _budget.solve(problem, budget, solver=solver, time_limit_s=time_limit_s, api=api)
    fg = problem.fg
    chosen = [t for t in problem.keepable() if fg.tensors[t].tagged]
    note = "" if chosen else (
        "the 'checkpoints' collection holds no tensor between xs and ys; add some with "
        "tf.compat.v1.add_to_collection('checkpoints', t) or use checkpoints='memory'"
    )
    return _plan(problem, "collection", chosen, lambda t: "tagged", note)


@register("speed")
@_checks_options(_check_speed_options)
def speed(problem: Problem, *, budget=None, budget_fraction: float = SPEED_BUDGET_FRACTION,
          op_types: frozenset[str] | None = None, min_saving_fraction: float = MIN_SAVING_FRACTION,
          solver: str = "auto", time_limit_s: float | None = None,
          api: str = "memsave.gradients") -> Plan:
    """The fastest plan under a generous memory budget (:data:`SPEED_BUDGET_FRACTION`).

    The budget solvers (:func:`memsave.planners.budget.solve`, ``solver``
    and ``time_limit_s`` as there) find the plan of least forecast
    recompute time whose forecast peak (every byte counted) above
    :meth:`Problem.floor` (what every plan holds) is at most
    ``budget_fraction`` of plain ``tf.gradients``' above it: typically the
    expensive outputs (convolutions, products) kept and the cheap ops after
    them recomputed, where that saves enough, and segments kept whole where
    memory allows. When no plan fits, nothing is kept and the note gives the
    smallest forecast peak. With ``op_types`` (e.g.
    :data:`EXPENSIVE_OP_TYPES`), keep the outputs of those op types instead,
    by rule. Like every automatic strategy, the plan is dropped when it
    saves under ``min_saving_fraction`` (:func:`worth_it`).
    """
    _check_speed_options(budget=budget, budget_fraction=budget_fraction, op_types=op_types,
                         min_saving_fraction=min_saving_fraction, solver=solver,
                         time_limit_s=time_limit_s, api=api)
    if op_types is not None:
        fg = problem.fg
        chosen = [t for t in problem.keepable() if fg.ops[fg.tensors[t].producer].type in op_types]
        note = "" if chosen else (
            f"no output of {sorted(op_types)} lies between xs and ys; use checkpoints='memory'"
        )
        plan = _plan(problem, "speed", chosen,
                     lambda t: f"output of {fg.ops[fg.tensors[t].producer].type}", note)
        return worth_it(problem, plan, min_saving_fraction=min_saving_fraction, who="'speed'")
    target = speed_budget_bytes(problem, budget_fraction, api=api)
    hopeless = can_save(problem, min_saving_fraction=min_saving_fraction)
    if hopeless and not problem.loop_choices:
        return problem.plan("speed", (), {}, note=hopeless + _CHOOSE_YOURSELF.replace(
            "checkpoints='speed'", "checkpoints='memory'"))
    base = problem.base.peak(None, model=problem.judge)
    floor = problem.base.floor(model=problem.judge)
    try:
        plan = _budget.solve(problem, target, solver=solver,
                             time_limit_s=time_limit_s, api=api,
                             model=problem.judge, strategy="speed",
                             max_simulations=search_simulations(problem))
    except MemoryBudgetError as e:
        return problem.plan("speed", (), {}, note=(
            f"no plan memsave found holds under budget_fraction={budget_fraction:g} of "
            f"tf.gradients' forecast working memory (its peak above the {floor:,} bytes "
            f"every plan holds; the smallest is "
            f"{(e.min_peak_bytes - floor) / max(base - floor, 1):.1%} of it); use "
            "checkpoints='memory', or memory_budget="))
    plan = _relabel(problem, plan, "speed")
    return worth_it(problem, plan, min_saving_fraction=min_saving_fraction, who="'speed'")


def speed_budget_bytes(problem: Problem, budget_fraction: float = SPEED_BUDGET_FRACTION, *,
                       api: str = "memsave.gradients") -> int:
    """``'speed'``'s budget: :meth:`Problem.floor` plus ``budget_fraction``
    of plain ``tf.gradients``' forecast working memory above it (every byte
    counted), on the loop-free problem (``problem.base``: with its loops as
    while_v2 differentiates them), so that every choice of the loops'
    gradients is judged against the same budget."""
    _check_budget_fraction(budget_fraction, api)
    plain = problem.base
    base = plain.peak(None, model=plain.judge)
    floor = plain.floor(model=plain.judge)
    return floor + int(budget_fraction * max(base - floor, 0))


def _speed_loop_budget(problem: Problem, options, api: str) -> int:
    """``'speed'``'s budget for choosing loop gradients (:func:`memsave.planners.loops.run`)."""
    return speed_budget_bytes(problem, options.get("budget_fraction", SPEED_BUDGET_FRACTION),
                              api=api)


speed.loop_budget_bytes = _speed_loop_budget
#: 'speed' plans to its own budget: :func:`memsave.planners.check` refuses
#: a memory_budget= beside it before a graph is read.
speed.refuses_budget = True


def budget_refused(with_what: str, api: str) -> CheckpointError:
    """The error of a ``memory_budget=`` given ``with_what`` refuses one (a
    strategy that plans to its own budget, a list of checkpoints or layers)."""
    return CheckpointError(
        f"{api}: memory_budget= plans the checkpoints itself; it cannot be combined with "
        f"{with_what}. Pass one or the other")


def _relabel(problem: Problem, plan: Plan, name: str, reason: Callable[[int], str] | None = None
             ) -> Plan:
    """A budget solver's plan as a strategy's: its decision and schedule, the
    strategy's name, no budget facts (none was given), and reasons that do
    not speak of a budget."""
    reasons = {}
    for t, why in plan.reason_of.items():
        if why.startswith("budget ("):
            why = why.split(": ", 1)[1] if ": " in why else (
                reason(t) if reason is not None else f"{name}: least recompute time")
        reasons[t] = why
    return problem.plan(name, plan.checkpoint_ids, reasons, schedule=plan.schedule,
                        note=plan.note)


@register("memory")
@_checks_options(_check_memory_options)
def memory(
    problem: Problem,
    *,
    budget=None,
    num_checkpoints: int | None = None,
    segment_live_fraction: float = SEGMENT_LIVE_FRACTION,
    small_tensor_fraction: float = SMALL_TENSOR_FRACTION,
    min_saving_fraction: float = MIN_SAVING_FRACTION,
    peak_tolerance: float = MEMORY_PEAK_TOLERANCE,
    solver: str = "auto",
    time_limit_s: float | None = None,
    api: str = "memsave.gradients",
) -> Plan:
    """The lowest forecast peak (within a tolerance), with the least forecast recompute time.

    Parameters
    ----------
    budget : int or float, optional
        A memory budget: the budget solver ``solver`` plans instead
        (:func:`memsave.planners.budget.solve`, with ``time_limit_s``).
    num_checkpoints : int, optional
        Keep exactly this many articulation points (fewer if there are
        fewer candidates), spread so that the segments between them hold
        about the same bytes. On a graph without articulation points, this
        many cuts of the topological order, spread the same way, and every
        tensor crossing them.
    segment_live_fraction : float
        See :data:`memsave.candidates.SEGMENT_LIVE_FRACTION` (shapes the
        candidate plans only).
    small_tensor_fraction : float
        See :data:`memsave.candidates.SMALL_TENSOR_FRACTION`.
    min_saving_fraction : float
        See :data:`MIN_SAVING_FRACTION`. Not applied with ``num_checkpoints``.
    peak_tolerance : float
        See :data:`MEMORY_PEAK_TOLERANCE`.
    solver, time_limit_s
        With a ``budget``: the budget solver and its time limit. Without
        one, ``'auto'`` finds the fastest plan within the tolerance.

    Notes
    -----
    Two families of candidate plans (:func:`memsave.candidates.memory_plans`).
    Articulation points each cut the graph with one tensor. Where skips
    bypass every layer (a U-Net, dense and inception blocks) there are none,
    so cuts of the topological order stand in: a plan keeps every activation
    crossing its chosen cuts (the running activation and the skips still
    open), and recomputes each layer once, between two cuts. Plans come from
    greedy walks whose segments shrink toward the end of the graph, as in
    Griewank's schedules, and from evenly spread sets of about ``sqrt(k)``
    candidates; the simulator forecasts each distinct plan's peak (every
    byte counted), in increasing floor (:meth:`Problem.peak_floor`, no
    simulation) up to the first floor above the tolerance of the lowest
    peak found. A uniform chain of ``n`` equal tensors keeps about
    ``sqrt(n)``: the O(sqrt(n)) memory of Chen et al. (2016). ``O(k log n)``
    per generated plan plus at most one linear simulation per distinct plan
    (at most fifteen; on the study's ResNet-110, 5 of 12).

    Then time: with the lowest of those peaks ``P``, the budget solvers find
    the plan of least forecast recompute time whose peak is at most ``(1 +
    peak_tolerance) P`` (storing segments, keeping expensive outputs where
    the peak allows: :mod:`memsave.planners.segments`); it is kept when it
    is faster than the fastest candidate plan within the tolerance (ties
    among those: the lower peak with each gradient freed when complete,
    then fewer checkpoints).

    Under XLA (a ``jit_compile`` function) there is no trade: among the
    candidate plans within :data:`XLA_PEAK_TIE` of the lowest peak, the
    lowest working memory, then the fewest checkpoints. There the forecast
    peak is the same for plans whose measured peaks differ (XLA's buffer
    assignment keeps what the executor's order would free): on
    test_memory's XLA convolution chain the fastest plan within 5% (every
    convolution's output kept) measured 0.63x of tf.gradients' peak above
    the resident tensors, the plan of least working memory 0.45x.

    References
    ----------
    T. Chen, B. Xu, C. Zhang, C. Guestrin. Training Deep Nets with Sublinear
    Memory Cost. arXiv:1604.06174, 2016.
    A. Griewank, A. Walther. Algorithm 799: revolve. ACM TOMS 26(1), 2000.
    P. Jain et al. Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization. MLSys 2020 (the "AP greedy" baseline and its
    generalisation to linearized cuts).
    """
    _check_memory_options(budget=budget, num_checkpoints=num_checkpoints,
                          min_saving_fraction=min_saving_fraction, peak_tolerance=peak_tolerance,
                          solver=solver, time_limit_s=time_limit_s, api=api)
    if budget is not None:
        return _budget.solve(problem, budget, solver=solver, time_limit_s=time_limit_s, api=api)
    fg = problem.fg
    points = problem.articulation_points(small_tensor_fraction=small_tensor_fraction)
    on_point = set(points)

    def reason(t: int) -> str:
        return "articulation point" if t in on_point else CUT_REASON

    if num_checkpoints == 0:
        return problem.plan("memory", (), {}, note="strategy_options num_checkpoints=0 keeps none")
    if num_checkpoints is not None:
        cum, total = problem.positions()
        if points:
            pos = [cum[fg.tensors[t].producer] for t in points]
            idx = spread(pos, total, min(num_checkpoints, len(points)))
            return _plan(problem, "memory", [points[i] for i in idx], reason)
        cuts = problem.topological_cuts()
        idx = spread([cum[c.position] for c in cuts], total, min(num_checkpoints, len(cuts)))
        return _plan(problem, "memory", [t for i in idx for t in cuts[i].crossing], reason)

    hopeless = can_save(problem, min_saving_fraction=min_saving_fraction)
    if hopeless:
        return problem.plan("memory", (), {}, note=hopeless + _CHOOSE_YOURSELF)
    judge = problem.judge
    if problem.fg.xla:
        peak_tolerance = XLA_PEAK_TIE
    found = candidate_plan(problem, peak_tolerance=peak_tolerance,
                           segment_live_fraction=segment_live_fraction,
                           small_tensor_fraction=small_tensor_fraction)
    if found is None:
        return problem.plan("memory", (), {}, note=(
            "no tensor cuts the forward graph in two (every activation is bypassed by "
            "another path, or all of them are inside ops that are kept anyway); "
            + _CHOOSE_YOURSELF
        ))
    best, limit, within = found

    def seconds(schedule) -> float:
        return problem.step_time(schedule).total_s

    plan = _plan(problem, "memory", best, reason)
    if problem.fg.xla:
        return worth_it(problem, plan, min_saving_fraction=min_saving_fraction, who="'memory'")
    try:
        fast = _budget.solve(problem, limit, solver=solver,
                             time_limit_s=time_limit_s, api=api, model=judge, strategy="memory",
                             include=sorted({t for c in within for t in c}),
                             max_simulations=search_simulations(problem, MEMORY_SEARCH_PLANS))
    except MemoryBudgetError:
        fast = None  # the solvers' candidates cannot reach the limit
    if fast is not None and fast.schedule is not None \
            and seconds(fast.schedule) < seconds(plan.schedule):
        plan = _relabel(problem, fast, "memory", reason)
    return worth_it(problem, plan, min_saving_fraction=min_saving_fraction, who="'memory'")


def candidate_plan(
    problem: Problem, *, peak_tolerance: float = MEMORY_PEAK_TOLERANCE,
    segment_live_fraction: float = SEGMENT_LIVE_FRACTION,
    small_tensor_fraction: float = SMALL_TENSOR_FRACTION,
) -> tuple[tuple[int, ...], int, list[tuple[int, ...]]] | None:
    """``'memory'``'s first stage: the fastest of its candidate plans
    (:meth:`Problem.memory_plans`) whose forecast peak (every byte counted)
    is within ``peak_tolerance`` of the lowest of theirs (under XLA, the
    one of least working memory among them; see :func:`memory`).

    Returns ``(checkpoints, limit_bytes, within)``: the plan, the peak limit
    (the lowest peak times ``1 + peak_tolerance``) and every candidate plan
    under it; None when there is no candidate. Among equally fast plans the
    lowest peak wins, then the lowest working memory (the step's peak when
    an optimizer update consumes each gradient, see simulate's
    gradients_kept: a peak set by the xs' gradients at the end of the step
    is the same for every plan), then the fewest checkpoints.
    """
    judge = problem.judge
    plans = problem.memory_plans(segment_live_fraction=segment_live_fraction,
                                 small_tensor_fraction=small_tensor_fraction)
    if not plans:
        return None
    # Simulated in increasing floor (Problem.peak_floor: no simulation); once
    # a plan's floor is over the limit of the peaks found so far, its peak
    # and every later plan's are too (the limit only comes down).
    floors = {c: problem.peak_floor(problem.schedule(c), model=judge) for c in plans}
    peaks: dict[tuple[int, ...], int] = {}
    for c in sorted(plans, key=floors.__getitem__):
        if peaks and floors[c] > int(min(peaks.values()) * (1.0 + peak_tolerance)):
            break
        peaks[c] = problem.peak(problem.schedule(c), model=judge)
    limit = int(min(peaks.values()) * (1.0 + peak_tolerance))
    within = [c for c in plans if c in peaks and peaks[c] <= limit]

    def working(c) -> int:
        return problem.peak(problem.schedule(c), model=judge, gradients_kept=False)

    def least(cs: list[tuple[int, ...]]) -> tuple[int, ...]:
        return cs[0] if len(cs) == 1 else min(cs, key=lambda c: (peaks[c], working(c), len(c)))

    if problem.fg.xla:  # peaks within the tolerance are tied (XLA_PEAK_TIE)
        return min(within, key=lambda c: (working(c), len(c), peaks[c])), limit, within
    # The memory keys (one more simulation a plan) only among the fastest.
    seconds = {c: problem.step_time(problem.schedule(c)).total_s for c in within}
    fastest = min(seconds.values())
    return least([c for c in within if seconds[c] == fastest]), limit, within
