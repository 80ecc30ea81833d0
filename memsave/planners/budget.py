"""``memory_budget=``: the least recompute time whose forecast peak fits (no TensorFlow).

Data flow: :func:`solve` resolves the budget (bytes, or a fraction of the
forecast plain peak), builds the decision space of the problem's candidate
cuts (:class:`~memsave.planners.segments.Segments`, whose segments are
recomputed, stored, or recomputed from their expensive outputs: articulation points;
where they cannot meet the budget, the activations crossing the cuts of the
topological order that 'memory' plans with too; every activation when there
are none; at most :data:`MAX_CUTS` of them, :func:`memsave.candidates.coarsen`),
runs a solver core and returns the :class:`~memsave.record.Plan` with its
:class:`~memsave.record.Budget` facts. No plan of the space fits: ``auto``
then takes the fastest of the plans ``'memory'`` weighs that fits
(:func:`_memory_candidates`: they reach lower peaks than the coarsened
cuts on some graphs), else a :class:`~memsave.errors.MemoryBudgetError`
giving the smallest forecast peak of all.

The solver cores share one signature, ``core(space, budget_bytes, *,
time_limit_s=None) -> Outcome``, and each is a planner of its own
(registered in :mod:`memsave.planners` under its name):

``dp``
    exact dynamic programming on chains of candidate cuts (rotor-like, with
    stored and expensive-kept segments that trade memory for time);
    :mod:`memsave.planners.dp`.
``milp``
    exact on small graphs: an integer program over groups of segments
    whose partitions are enumerated cheapest first (best-first search),
    seeded with ``greedy``'s plan, made exact against the simulator by lazy
    no-good cuts;
    :mod:`memsave.planners.milp`.
``greedy``
    fast heuristic for large graphs; never exceeds the budget, monotone;
    :mod:`memsave.planners.greedy`.
``auto``
    picks one by the size of the space (:func:`choose`).

Every core minimises the forecast seconds the plan adds to plain backprop
(the time model, :mod:`memsave.timemodel`, under the problem's device
profile), not FLOPs.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence

from memsave.candidates import coarsen
from memsave.errors import MemoryBudgetError, OptionsError
from memsave.memory_model import MemoryModel
from memsave.planners.dp import dp
from memsave.planners.greedy import greedy
from memsave.planners.milp import milp
from memsave.planners.segments import Outcome, Segments
from memsave.problem import Problem
from memsave.record import Budget, Plan
from memsave.simulate import paused_gc

__all__ = ["solve", "resolve_budget", "check_budget", "search_simulations", "choose",
           "is_chain", "CORES", "MEMORY_SEARCH_OPS", "DP_MAX_CUTS", "DP_PROBES_PER_CUT_SQUARED",
           "MILP_MAX_CUTS", "MAX_CUTS", "FEW_POINTS"]

Core = Callable[..., Outcome]

#: The solver cores by name (each also a planner: :mod:`memsave.planners`).
CORES: dict[str, Core] = {"dp": dp, "milp": milp, "greedy": greedy}

#: Work a preset's ('memory', 'speed') search for time may take, in simulated ops (plans
#: simulated times the graph's ops: ``greedy``'s ``max_simulations`` is
#: this over the graph's ops), beyond the candidate plans: under its tight
#: peak limit most plans do not fit, and simulating them all took 2.5 s of
#: CPU on experiments/bench_planner.py's 1000-op DAG (0.5 s with this
#: bound). When the search stops without a plan that fits, 'memory' keeps
#: its fastest candidate plan.
MEMORY_SEARCH_OPS = 40_000

#: ``auto`` uses ``dp`` on chains with at most this many candidate cuts: its
#: probe simulations grow like cuts squared (:data:`DP_PROBES_PER_CUT_SQUARED`,
#: each a simulation of the whole graph: minutes at 40 cuts of a 1000-op chain).
DP_MAX_CUTS = 12

#: ``dp``'s probe simulations per squared candidate cut, about (measured on
#: the test zoo's chains: 274-403 at 7-8 cuts, 751 at 11, 891 at 12). A
#: search capped at ``max_simulations`` (a preset's search for time) uses
#: ``dp`` only where its probes fit the cap: ``'memory'``'s 64
#: (:data:`memsave.planners.strategies.MEMORY_SEARCH_PLANS`) let ``dp``
#: simulate 400-900 plans of those chains, 72% of ``'memory'``'s planning
#: time over the zoo.
DP_PROBES_PER_CUT_SQUARED = 6.2

#: ``auto`` uses ``milp`` on non-chain graphs with at most this many
#: candidate cuts; beyond that its enumeration may visit many partitions.
MILP_MAX_CUTS = 12

#: With fewer articulation points than this, the budget solvers also plan
#: over the cuts of the topological order and keep the faster plan: the
#: segments between few points are long (a U-Net has four, around its whole
#: body), and a segment is stored, recomputed or expensive-kept whole. On
#: the study's U-Net-64 the points alone gave budget 0.75 a plan forecast at
#: 1.12x the plain step, the cuts one at 1.07x.
FEW_POINTS = 24

#: Candidate cuts a budget plan chooses from at most (:func:`coarsen` keeps
#: this many, spread evenly over the activation bytes): every simulation
#: walks the whole graph, and the greedy family and its knapsack grow with
#: the cuts; 96 still allows about 2 sqrt(n) checkpoints on graphs of a
#: few thousand ops (measured in experiments/bench_planner.py).
MAX_CUTS = 96


def resolve_budget(memory_budget, baseline_peak_bytes: int, *, api: str) -> int:
    """Bytes of ``memory_budget``: an int as is, a float in (0, 1] times the plain peak."""
    check_budget(memory_budget, api=api)
    if isinstance(memory_budget, numbers.Integral):
        return int(memory_budget)
    return int(memory_budget * baseline_peak_bytes)


def check_budget(memory_budget, *, api: str) -> None:
    """Raise :class:`MemoryBudgetError` unless ``memory_budget`` is an int
    > 0 (bytes) or a float in (0, 1] (a fraction of the plain peak)."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real):
        raise MemoryBudgetError(
            f"{api}: memory_budget={memory_budget!r}; pass an int (bytes) or a float in "
            "(0, 1] (a fraction of the forecast plain peak, Plan.baseline_peak_bytes)"
        )
    if isinstance(memory_budget, numbers.Integral):
        if memory_budget <= 0:
            raise MemoryBudgetError(f"{api}: memory_budget={memory_budget!r} bytes must be > 0")
    elif not 0.0 < memory_budget <= 1.0:
        raise MemoryBudgetError(
            f"{api}: memory_budget={memory_budget!r}: a float is a fraction of the plain peak "
            "and must be in (0, 1]; pass bytes as an int"
        )


def search_simulations(problem: Problem, most: int | None = None) -> int:
    """How many plans a preset's search for time may simulate
    (:data:`MEMORY_SEARCH_OPS` over the graph's ops, at most ``most``;
    times the problem's ``search_share``)."""
    plans = MEMORY_SEARCH_OPS / max(1, len(problem.fg.ops))
    if most is not None:
        plans = min(plans, most)
    return max(1, int(plans * problem.search_share))


def least_fraction(peak_bytes: int, baseline_peak_bytes: int) -> str:
    """`` (or >= f as a fraction)`` for a refusal: the smallest fraction of
    three decimals that :func:`resolve_budget` turns into at least
    ``peak_bytes`` (a fraction rounded to nearest could name a budget that is
    refused again); empty when no fraction in (0, 1] reaches it."""
    if baseline_peak_bytes <= 0:
        return ""
    f = math.ceil(peak_bytes * 1000 / baseline_peak_bytes) / 1000
    while int(f * baseline_peak_bytes) < peak_bytes:
        f = round(f + 0.001, 3)
    return f" (or >= {f:.3f} as a fraction)" if 0.0 < f <= 1.0 else ""


def is_chain(space: Segments) -> bool:
    """Whether the candidates cut the graph into a chain of segments: every
    tensor read across a cut is the cut itself, read by the next segment (or
    resident), and every y is produced in the last segment. The DP's
    locality holds there."""
    fg = space.fg
    bounds = [fg.tensors[t].producer for t in space.candidates]
    seg = {}
    k = 0
    for op in fg.ops:
        while k < len(bounds) and op.index > bounds[k]:
            k += 1
        seg[op.index] = k
    cand = set(space.candidates)
    last = len(bounds)
    for y in fg.ys:  # a y's seed gradient is alive from the start of backprop
        p = fg.tensors[y].producer
        if p is not None and seg[p] != last:
            return False
    for op in fg.ops:
        for t in op.inputs:
            p = fg.tensors[t].producer
            if p is None:
                continue
            if seg[p] != seg[op.index] and not (t in cand and seg[op.index] == seg[p] + 1):
                return False
    return True


def choose(space: Segments, *, milp: bool = True, max_simulations: int | None = None) -> str:
    """The core ``auto`` picks: ``dp`` on small chains (whose probes fit
    ``max_simulations``, if given: :data:`DP_PROBES_PER_CUT_SQUARED`),
    ``milp`` on small spaces (when ``milp``), ``greedy`` otherwise."""
    m = len(space.candidates)
    if m <= DP_MAX_CUTS and is_chain(space) and (
            max_simulations is None or DP_PROBES_PER_CUT_SQUARED * m * m <= max_simulations):
        return "dp"
    if milp and m <= MILP_MAX_CUTS:
        return "milp"
    return "greedy"


def check_solver(solver, time_limit_s, *, api: str) -> None:
    """Raise for a ``solver`` that is not ``'auto'`` or one of :data:`CORES`,
    or a ``time_limit_s`` that is not a positive number of seconds."""
    if solver != "auto" and solver not in CORES:
        from memsave.errors import UnknownStrategyError

        raise UnknownStrategyError(
            f"{api}: solver={solver!r} is not known; use 'auto' or one of {sorted(CORES)}")
    if time_limit_s is not None and (isinstance(time_limit_s, bool) or not isinstance(
            time_limit_s, numbers.Real) or not time_limit_s > 0):
        raise OptionsError(
            f"{api}: time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


def solve(problem: Problem, memory_budget, *, solver: str = "auto",
          time_limit_s: float | None = None, api: str = "memsave",
          model: MemoryModel | None = None, strategy: str = "budget",
          include: Sequence[int] = (), max_simulations: int | None = None) -> Plan:
    """The plan of least forecast recompute time whose forecast peak fits ``memory_budget``.

    Parameters
    ----------
    problem : Problem
    memory_budget : int or float
        Bytes (int), or a fraction in (0, 1] of the forecast plain peak
        (``problem.peak(None)``), under the device's memory model.
    solver : str
        ``"auto"`` (:func:`choose`) or a name of :data:`CORES`.
    time_limit_s : float, optional
        Passed to the solver: past it ``milp`` returns its best plan and
        gap, ``dp`` greedy's plan (both ``optimal=False``); default
        :data:`~memsave.planners.segments.DEFAULT_TIME_LIMIT_S`.
    api : str
        The API name error messages start with.
    model : MemoryModel, optional
        The memory model the budget bounds: the problem's (the device's)
        by default. The strategies plan with :attr:`Problem.judge`.
    strategy : str
        The Plan's ``strategy`` (the preset that asked, or ``"budget"``).
    include : sequence of int
        Activations added to the candidate cuts after coarsening (the
        checkpoints of ``'memory''s best plans), so that plans keeping them
        are in the decision space.
    max_simulations : int, optional
        Passed to ``greedy`` (:func:`memsave.planners.greedy.greedy`): a
        preset's search for time stops after that many simulations.

    Raises
    ------
    MemoryBudgetError
        When ``memory_budget`` is invalid, or below every plan's forecast
        peak (``.min_peak_bytes`` holds the smallest found).
    """
    check_solver(solver, time_limit_s, api=api)
    if solver == "auto" and problem.search_share < 1.0:
        # One of the combinations of loop choices memsave.planners.loops
        # weighs (the chosen one is planned again with the whole search):
        # the greedy, bounded by the problem's share of a preset's search.
        # dp simulates about 6 m^2 plans of m cuts (measured: 311 a plan on
        # three LSTM scans with a projection between them, 0.35 s of
        # profiled CPU for each of the eight combinations), and milp may run
        # to its time limit: on a Keras Embedding -> LSTM -> GRU fit step
        # (batch 256, T=24, memory_budget=0.6), 30 s on each of its 25
        # combinations, and planning did not end within 5 minutes; bounded,
        # it refused the budget in 1.3 s.
        solver = "greedy"
        max_simulations = max_simulations or search_simulations(problem)
    # Planning builds and keeps many schedules (tuples, no cycles): paused,
    # the collector does not walk the process's TensorFlow objects again and
    # again (measured: a fifth of the time on a 10,000-op graph).
    with paused_gc():
        return _solve(problem, memory_budget, solver, time_limit_s, api, model, strategy,
                      include, max_simulations)


def _solve(problem: Problem, memory_budget, solver: str, time_limit_s, api: str,
           model: MemoryModel | None, strategy: str, include: Sequence[int],
           max_simulations: int | None) -> Plan:
    start = time.perf_counter()
    baseline = problem.peak(None, model=model)
    budget_bytes = resolve_budget(memory_budget, baseline, api=api)
    fg = problem.fg
    # Articulation points first; where they cannot meet the budget (skips
    # leave few or none: a U-Net, dense and inception blocks), the
    # activations crossing the cuts of the topological order that 'memory'
    # plans with join them. Not both at once where the points are many: on
    # a ResNet the wider set, coarsened to MAX_CUTS, forecast 15-40% more
    # recomputation at budgets 0.2-0.5 of the plain peak. Where they are
    # few (FEW_POINTS), both, and the faster plan wins. So a larger budget
    # may get a plan forecast slower than a smaller one's, where the points
    # meet only the larger one and the wider space had a faster plan.
    # Searching both always gave ResNet-110 at 0.5 a plan forecast at
    # 1.130x the plain step instead of 1.141x, which measured 1.5-2.4%
    # slower (interleaved, 16-20 rounds) with 11 MiB more: not done.
    points = problem.articulation_points()
    wide = list(dict.fromkeys([*points, *(t for cut in problem.topological_cuts()
                                          for t in cut.crossing)]))
    tries = [c for c in (points, wide) if c] or [problem.keepable()]
    if len(tries) == 2 and len(tries[1]) == len(tries[0]):
        tries.pop()
    closest = None  # (outcome, core, space) with the smallest infeasible peak
    found = None  # (outcome, core, space) of the fastest plan that fits
    for cands in tries:
        space = Segments(problem, [*coarsen(fg, problem.costs, cands, MAX_CUTS), *include],
                         model=model)
        # A preset's bounded search (max_simulations) should cost a bounded
        # number of simulations: no milp (where nothing fits, its search for
        # the smallest peak may visit many partitions), and dp only where
        # its probes fit the bound.
        name = choose(space, milp=max_simulations is None,
                      max_simulations=max_simulations) if solver == "auto" else solver
        extra = {"max_simulations": max_simulations} if max_simulations and name == "greedy" else {}
        out = CORES[name](space, budget_bytes, time_limit_s=time_limit_s, **extra)
        if out.evaluation.peak_bytes <= budget_bytes:
            if found is None or out.evaluation.recompute_ns < found[0].evaluation.recompute_ns:
                found = (out, name, space)
            if len(cands) >= FEW_POINTS:
                break
        elif closest is None or out.evaluation.peak_bytes < closest[0].evaluation.peak_bytes:
            closest = (out, name, space)
    if found is None:
        out, name, space = closest
        low = out.evaluation.peak_bytes
        # 'auto' also tries the plans 'memory' weighs ('memory' itself
        # weighs them already; a solver named by the caller answers alone).
        if solver == "auto" and strategy != "memory":
            fits, lowest = _memory_candidates(problem, budget_bytes, model)
            if fits is not None:
                checkpoints, schedule = fits
                budget = Budget(budget_bytes=budget_bytes, feasible=True, optimal=False,
                                solver="memory", solve_time_s=time.perf_counter() - start,
                                gap=float("inf"))
                reasons = {t: "budget (memory): a plan 'memory' weighs" for t in checkpoints}
                return problem.plan(strategy, checkpoints, reasons, schedule=schedule,
                                    budget=budget)
            if lowest is not None and lowest < low:
                low, name = lowest, "memory"
        raise MemoryBudgetError(
            f"{api}: memory_budget={memory_budget!r} ({budget_bytes:,} bytes) is below the "
            f"smallest forecast peak memsave found, {low:,} bytes ({low / max(baseline, 1):.1%} "
            f"of the forecast plain peak, {baseline:,}; solver {name!r}"
            f"{', proven' if out.optimal and name != 'memory' else ''}); "
            f"pass memory_budget >= {low}{least_fraction(low, baseline)}, or a smaller batch",
            min_peak_bytes=low,
        )
    out, name, space = found
    ev = out.evaluation
    reasons = {t: f"budget ({name})" for t in ev.checkpoints}
    for k in ev.decision.expensive:
        for t in space.expensive_outputs[k]:
            producer = fg.ops[fg.tensors[t].producer].type
            reasons[t] = (f"budget ({name}): output of {producer}, kept so that recomputation "
                          "starts from it")
    if ev.schedule is not None:
        stored = set(ev.in_place)
        for t in ev.schedule.kept:
            p = fg.tensors[t].producer
            if t not in reasons and p is not None and p in stored:
                reasons[t] = "stored segment (differentiated in place, not recomputed)"
    note = "" if ev.schedule is not None else (
        "the budget fits tf.gradients' own forecast peak: nothing is recomputed")
    budget = Budget(budget_bytes=budget_bytes, feasible=True, optimal=out.optimal, solver=name,
                    solve_time_s=time.perf_counter() - start, gap=out.gap)
    return problem.plan(strategy, ev.checkpoints, reasons, schedule=ev.schedule, note=note,
                        budget=budget)


def _memory_candidates(problem: Problem, budget_bytes: int, model: MemoryModel | None):
    """The fastest of ``'memory'``'s candidate plans whose forecast peak fits
    ``budget_bytes`` (under ``model``), and the lowest of their peaks.

    The budget solvers plan over coarsened cuts; where none of their plans
    fits, a plan ``'memory'`` weighs may (on the study's ResNet-110 its
    lowest forecast peak is 0.150x of plain's, the solvers' 0.156x), so a
    budget between the two is met, and a refusal names the smallest peak
    memsave can plan. Returns ``((checkpoints, schedule) or None, lowest
    peak or None)``.
    """
    best, lowest = None, None
    for chosen in problem.memory_plans():
        schedule = problem.schedule(chosen)
        peak = problem.peak(schedule, model=model)
        lowest = peak if lowest is None else min(lowest, peak)
        if peak <= budget_bytes:
            ns = problem.recompute_nanoseconds(schedule)
            if best is None or (ns, peak) < best[0]:
                best = ((ns, peak), (tuple(chosen), schedule))
    return (None if best is None else best[1]), lowest
