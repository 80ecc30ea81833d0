"""Which gradient each while_v2 loop gets, chosen with the checkpoints (no TensorFlow).

A While op of the differentiated graph (a Keras RNN, ``tf.scan``, a
``tf.while_loop``) can be differentiated as while_v2 does (``plain``: every
trip keeps what its gradient reads), per step (the loop state each trip,
each trip recomputed backwards) or in chunks of trips, equal or tapered
(:mod:`memsave.loops`, forecast by :mod:`memsave.loopmodel`). The choice
changes what the loop op holds until its gradient runs, so it enters the
one planning problem: :meth:`memsave.problem.Problem.with_loops` is the
problem with a set of loop choices, whose forecasts (every planner's, the
Plan's) simulate the loops with :func:`memsave.loopmodel.figures`.

Data flow: :func:`memsave.planners.run` hands a problem with loops to
:func:`run` when :func:`decides_loops` (``'memory'``, ``'speed'``, or a budget); it
runs the planner once per combination of loop choices (every combination
up to :data:`MAX_COMBINATIONS`, else one loop at a time, the others held)
and returns the planner's Plan of the best one, with ``Plan.loops`` saying
what each loop gets; :func:`memsave.api.gradients` applies it with
:func:`memsave.loops.prepare` before the rewrite.

* ``'memory'``: the lowest forecast peak (every byte counted, as the
  strategies compare plans) among the choices that run each loop's trips
  again at most once (:data:`MEMORY_LOOP_FORWARDS`: plain, per step,
  chunks storing a chunk's trips), as ``'memory'`` recomputes each op of
  the rest of the graph at most once; among the combinations within
  :data:`SAME_PEAK_FRACTION` of it, the least forecast recompute time (loop
  trips run again plus the graph's recomputation,
  :attr:`memsave.record.Plan.recompute_seconds`). Chunks that recompute
  each trip twice (:func:`memsave.loopmodel.recomputed_trips`) keep less
  but take longer: budgets choose them when nothing else fits.
* ``'speed'``: the least recompute among the combinations whose forecast
  peak fits its budget (0.75 of the loop-free problem's working memory,
  :func:`memsave.planners.strategies.speed_budget_bytes`); none fits: every
  loop plain, as ``'speed'`` plans without loops.
* a budget: the least recompute time whose forecast peak fits (the budget is
  resolved against the plain forecast, every loop plain); ties go to the
  lower peak. None fits: :class:`~memsave.errors.MemoryBudgetError` with the
  smallest peak found.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping

from memsave import loopmodel
from memsave.errors import MemoryBudgetError
from memsave.loopmodel import LoopChoice, LoopDecision
from memsave.problem import Problem

__all__ = ["run", "decides_loops", "SAME_PEAK_FRACTION", "MEMORY_LOOP_FORWARDS",
           "MAX_COMBINATIONS"]

#: Forecast peaks within this fraction of the lowest count as the lowest
#: (``'memory'`` then takes the least recompute among them): measured on a
#: Keras LSTM at T=1024, chunk(k=32) and chunk(k=17, inner=store) peak
#: within 0.2% of each other, the second at 0.84x the first's CPU time.
SAME_PEAK_FRACTION = 0.02

#: How many times ``'memory'`` may run a loop's trips again: once (per step,
#: chunks storing their trips). Measured on a Keras LSTM(128) at T=1024,
#: batch 1024 (experiments/bench_loops.py, CPU time over plain's):
#: chunk(k=32), which runs each trip twice, 0.018x plain's peak above
#: resident for 1.80x; chunk(k=17, inner=store) 0.033x for 1.56x.
MEMORY_LOOP_FORWARDS = 1

#: Combinations of loop choices tried exhaustively at most (five choices a
#: loop, :func:`memsave.loopmodel.candidates`: two loops; three for
#: ``'memory'``, which weighs three); beyond, one loop at a time.
MAX_COMBINATIONS = 64


def decides_loops(name: str, budget, options: Mapping | None = None) -> bool:
    """Whether the planner ``name`` chooses the loops' gradients: ``'memory'``,
    ``'speed'`` (but with ``op_types``, a rule) and every budgeted plan.
    (``'collection'`` and lists keep while_v2's gradient: they keep what is
    asked, no more.)"""
    if budget is not None or name == "memory":
        return True
    return name == "speed" and (options or {}).get("op_types") is None


def run(planner: Callable, problem: Problem, *, budget=None, options: Mapping | None = None,
        api: str = "memsave.gradients", within_bytes: int | None = None):
    """The planner's Plan with the loops' gradients chosen (module docstring).

    ``within_bytes`` (``'speed'``, its budget on the loop-free problem): with
    no ``budget``, the least recompute among the combinations whose forecast
    peak (every byte counted) is at most that, instead of the lowest peak;
    none: the planner's plan with every loop plain.
    """
    from memsave.planners.budget import least_fraction, resolve_budget

    options = dict(options or {})
    loops = problem.loops
    if budget is None:
        bodies = {d.op: problem.fg.ops[d.op].body for d in loops}
        admit = None if within_bytes is not None else (lambda d, c: (
            loopmodel.recomputed_trips(bodies[d.op], c)
            <= MEMORY_LOOP_FORWARDS * bodies[d.op].trips))
        # Each combination's plan takes a share of the preset's search for
        # time; the chosen one is planned again with all of it (measured on a
        # Keras LSTM-GRU-LSTM stack, T=64: eight combinations, each planned
        # with the whole search, made the gradient call 5.2 s of CPU against
        # tf.gradients' 0.7 s; the same choices and plan with shares).
        share = 1.0 / _evaluations(loops, admit)

        def evaluate(choices, share=share):
            variant = problem.with_loops(choices)
            variant.search_share = share
            plan = planner(variant, **options)
            return (plan, variant.peak(plan.schedule, model=variant.judge),
                    plan.recompute_seconds, _order(loops, choices))

        def evaluate_within(choices, share=share):
            result = evaluate(choices, share)
            return result if result[1] <= within_bytes else None

        if within_bytes is None:
            best = _search(loops, evaluate, _lowest_peak, admit=admit)
            if share < 1.0:
                best = evaluate(best[0].problem.loop_choices, 1.0)
        else:
            best = _search(loops, evaluate_within, _least_recompute)
            if best is not None and share < 1.0:
                best = evaluate_within(best[0].problem.loop_choices, 1.0) or best
            best = best or evaluate({}, 1.0)
        return _with_decisions(best[0], loops)
    baseline = problem.peak(None)
    budget_bytes = resolve_budget(budget, baseline, api=api)
    if baseline <= budget_bytes:
        # tf.gradients' own forecast fits: the least recompute is none, every
        # loop plain. (The planner resolves the budget as given: a fraction
        # of a plain peak of 0 bytes, a graph whose every buffer is too small
        # for the CPU allocator to count, is 0 bytes, which it accepts as a
        # fraction but not as bytes.)
        return _with_decisions(planner(problem, budget=budget, **options), loops)
    lowest = [None]  # the smallest infeasible peak found, and its choices
    # As without a budget, each combination's plan takes a share of the
    # search (solver 'auto' is then the bounded greedy:
    # memsave.planners.budget.solve), and the chosen one is
    # planned again with all of it.
    share = 1.0 / _evaluations(loops)

    def evaluate_budgeted(choices, share=share):
        variant = problem.with_loops(choices)
        variant.search_share = share
        try:
            plan = planner(variant, budget=budget_bytes, **options)
        except MemoryBudgetError as e:
            low = e.min_peak_bytes
            if low is not None and (lowest[0] is None or low < lowest[0][0]):
                lowest[0] = (low, choices)
            return None
        return plan, variant.peak(plan.schedule), plan.recompute_seconds, _order(loops, choices)

    best = _search(loops, evaluate_budgeted, _least_recompute)
    if best is not None and share < 1.0:
        best = evaluate_budgeted(best[0].problem.loop_choices, 1.0) or best
    if best is None:
        low, choices = lowest[0] if lowest[0] is not None else (None, {})
        said = ", ".join(f"{d.name} {choices.get(d.op, LoopChoice.plain())}" for d in loops)
        raise MemoryBudgetError(
            f"{api}: memory_budget={budget!r} ({budget_bytes:,} bytes) is below the smallest "
            f"forecast peak memsave found"
            + (f", {low:,} bytes ({low / max(baseline, 1):.1%} of the forecast plain peak, "
               f"{baseline:,}; "
               f"loops: {said}); pass memory_budget >= {low}"
               f"{least_fraction(low, baseline)}" if low is not None else "")
            + ", or a smaller batch or shorter sequences",
            min_peak_bytes=low)
    return _with_decisions(best[0], loops)


def _order(loops: tuple[LoopDecision, ...], choices) -> int:
    """How far down the loops' candidate lists ``choices`` goes: plain, per
    step, chunks, chunks storing a chunk's trips, tapered chunks. Equal recompute goes to
    the simpler gradient (measured on a Keras LSTM at T=1024: per-step and
    chunk(k=17, inner=store) each recompute one forward of the loop; the
    chunks' step took 1.19x the per-step one's CPU time)."""
    return sum(next(j for j, f in enumerate(d.forecasts)
                    if f.choice == choices.get(d.op, LoopChoice.plain()))
               for d in loops)


def _lowest_peak(results):
    """``'memory'``'s pick among (plan, peak, recompute, order) results."""
    low = min(r[1] for r in results)
    tied = [r for r in results if r[1] <= low * (1 + SAME_PEAK_FRACTION)]
    return min(tied, key=lambda r: (r[2], r[3], r[1]))


def _least_recompute(results):
    """A budget's pick among feasible (plan, peak, recompute, order) results."""
    return min(results, key=lambda r: (r[2], r[3], r[1]))


def _choices(loops: tuple[LoopDecision, ...], admit=None) -> tuple[list[list], int]:
    """Each loop's choices (those ``admit(decision, choice)`` allows, all
    without it), and how many combinations of them there are."""
    per_loop = [[f.choice for f in d.forecasts if admit is None or admit(d, f.choice)]
                for d in loops]
    total = 1
    for c in per_loop:
        total *= len(c)
    return per_loop, total


def _evaluations(loops: tuple[LoopDecision, ...], admit=None) -> int:
    """How many combinations :func:`_search` evaluates."""
    per_loop, total = _choices(loops, admit)
    return max(1, total if total <= MAX_COMBINATIONS else sum(len(c) for c in per_loop))


def _search(loops: tuple[LoopDecision, ...], evaluate, pick, admit=None):
    """The result ``pick`` prefers among the combinations of loop choices
    (those ``admit(decision, choice)`` allows, all without it) ``evaluate``
    answers for (None: infeasible); None when none is feasible."""
    per_loop, total = _choices(loops, admit)
    if total <= MAX_COMBINATIONS:
        results = []
        for combo in itertools.product(*per_loop):
            got = evaluate({d.op: c for d, c in zip(loops, combo)})
            if got is not None:
                results.append(got)
        return pick(results) if results else None
    # One loop at a time, the others held (first at per-step: the plain
    # gradient of many long loops rarely fits what one of them saves).
    current = {d.op: LoopChoice.per_step() for d in loops}
    best = None
    for d, choices in zip(loops, per_loop):
        results = []
        for c in choices:
            got = evaluate({**current, d.op: c})
            if got is not None:
                results.append((got, c))
        if not results:
            continue
        chosen = pick([g for g, _ in results])
        current[d.op] = next(c for g, c in results if g is chosen)
        best = chosen
    return best


def _with_decisions(plan, loops: tuple[LoopDecision, ...]):
    """``plan`` with ``Plan.loops``: each loop with the choice its problem holds."""
    choices = plan.problem.loop_choices
    decisions = tuple(d.taking(choices.get(d.op, LoopChoice.plain())) for d in loops)
    note = plan.note
    if plan.schedule is None and choices:
        note = ("nothing is recomputed outside the loops: the saving is the loops' gradients' "
                f"({', '.join(f'{d.name}: {d.choice}' for d in decisions)})")
    return dataclasses.replace(plan, loops=decisions, note=note)
