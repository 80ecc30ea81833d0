"""``memory_budget=``: the least recompute cost whose forecast peak fits (no TensorFlow).

Data flow: :func:`plan_for_budget` resolves the budget (bytes, or a fraction
of the forecast plain peak), builds a :class:`memsave.solvers.Problem` over
the graph's candidate cuts (articulation points; where they cannot meet the
budget, the activations crossing the cuts of the topological order that
'memory' plans with too; every activation when there are none; at most :data:`memsave.solvers.MAX_CUTS` of
them, :func:`memsave.solvers.coarsen`), runs the solver ``auto`` picks (or the one
named) and returns the checkpoints, the stored ops, their schedule and the
:class:`~memsave.solvers.SolveResult`. No plan fits: a
:class:`~memsave.errors.MemoryBudgetError` giving the smallest forecast peak.
"""

from __future__ import annotations

import dataclasses
import numbers

from memsave.costs import Costs
from memsave.errors import MemoryBudgetError
from memsave.graph import ForwardGraph
from memsave.schedule import Schedule
from memsave.simulate import CPU_ONEDNN, Allocator, paused_gc
from memsave.solvers import MAX_CUTS, Problem, SolveResult, coarsen, solve
from memsave.strategies import articulation_candidates, topological_cuts

__all__ = ["BudgetPlan", "resolve_budget", "plan_for_budget"]


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What the budget planner chose (tensor and op ids of the ForwardGraph)."""

    checkpoints: tuple[int, ...]
    reasons: dict
    schedule: Schedule | None
    result: SolveResult


def resolve_budget(memory_budget, baseline_peak_bytes: int, *, api: str) -> int:
    """Bytes of ``memory_budget``: an int as is, a float in (0, 1] times the plain peak."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real):
        raise MemoryBudgetError(
            f"{api}: memory_budget={memory_budget!r}; pass an int (bytes) or a float in "
            "(0, 1] (a fraction of the forecast tf.gradients peak, Plan.baseline_peak_bytes)"
        )
    if isinstance(memory_budget, numbers.Integral):
        if memory_budget <= 0:
            raise MemoryBudgetError(f"{api}: memory_budget={memory_budget!r} bytes must be > 0")
        return int(memory_budget)
    if not 0.0 < memory_budget <= 1.0:
        raise MemoryBudgetError(
            f"{api}: memory_budget={memory_budget!r}: a float is a fraction of the plain peak "
            "and must be in (0, 1]; pass bytes as an int"
        )
    return int(memory_budget * baseline_peak_bytes)


def plan_for_budget(fg: ForwardGraph, costs: Costs, memory_budget, *, api: str,
                    solver: str = "auto", time_limit_s: float | None = None,
                    allocator: Allocator = CPU_ONEDNN) -> BudgetPlan:
    """Least recompute cost with forecast peak <= ``memory_budget`` (see module docstring).

    ``allocator``: whose reported peak the budget bounds (the device's).

    Raises
    ------
    MemoryBudgetError
        When ``memory_budget`` is invalid, or below every plan's forecast peak
        (``.min_peak_bytes`` holds the smallest found).
    """
    # Planning builds and keeps many schedules (tuples, no cycles): paused,
    # the collector does not walk the process's TensorFlow objects again and
    # again (measured: a fifth of the time on a 10,000-op graph).
    with paused_gc():
        return _plan_for_budget(fg, costs, memory_budget, api=api, solver=solver,
                                time_limit_s=time_limit_s, allocator=allocator)


def _plan_for_budget(fg, costs, memory_budget, *, api, solver, time_limit_s, allocator):
    # Articulation points first; where they cannot meet the budget (skips
    # leave few or none: a U-Net, dense and inception blocks), the
    # activations crossing the cuts of the topological order that 'memory'
    # plans with join them. Not both at once: on a ResNet the wider set,
    # coarsened to MAX_CUTS, forecast 15-40% more recomputation at budgets
    # 0.2-0.5 of the plain peak.
    arts = articulation_candidates(fg)
    wide = list(dict.fromkeys([*arts, *(t for cut in topological_cuts(fg, costs)
                                        for t in cut.crossing)]))
    tries = [c for c in (arts, wide) if c] or [Problem.default_candidates(fg)]
    if len(tries) == 2 and len(tries[1]) == len(tries[0]):
        tries.pop()
    closest = None  # the infeasible result with the smallest peak
    problem = None  # the previous try's: its forward program and simulations are reused
    for cands in tries:
        problem = Problem(fg, costs, coarsen(fg, costs, cands, MAX_CUTS), allocator=allocator,
                          shared=problem)
        baseline = problem.plain.peak_bytes
        budget_bytes = resolve_budget(memory_budget, baseline, api=api)
        res = solve(problem, budget_bytes, solver=solver, time_limit_s=time_limit_s)
        if res.feasible:
            break
        if closest is None or res.predicted_peak_bytes < closest.predicted_peak_bytes:
            closest = res
    if not res.feasible:
        res = closest
        low = res.predicted_peak_bytes
        raise MemoryBudgetError(
            f"{api}: memory_budget={memory_budget!r} ({budget_bytes:,} bytes) is below the "
            f"smallest forecast peak memsave found, {low:,} bytes ({low / max(baseline, 1):.1%} "
            f"of tf.gradients' {baseline:,}; solver {res.solver!r}"
            f"{', proven' if res.optimal else ''}); pass memory_budget >= {low} "
            f"(or >= {low / max(baseline, 1):.3f} as a fraction), or a smaller batch",
            min_peak_bytes=low,
        )
    reasons = {t: f"budget ({res.solver})" for t in res.checkpoints}
    if res.schedule is not None:
        stored = set(res.in_place)
        for t in res.schedule.kept:
            p = fg.tensors[t].producer
            if t not in reasons and p is not None and p in stored:
                reasons[t] = "stored segment (differentiated in place, not recomputed)"
    return BudgetPlan(res.checkpoints, reasons, res.schedule, res)
