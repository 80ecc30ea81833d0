"""``greedy``: a fast heuristic for large graphs, within budget and monotone.

Algorithm
---------
1. *Base plans.* For a few checkpoint counts ``k`` (about ``sqrt(m)/2,
   sqrt(m), 2 sqrt(m)`` of the ``m`` candidate cuts, and every ``k`` on small
   problems), keep ``k`` cuts spread so that the segments between them hold
   about equal activation bytes (Chen et al.'s sqrt(n) plan). The cuts split
   the segments into groups.
2. *Storing groups.* Storing a group saves its FLOPs and holds its
   activations until its gradient runs, so groups are stored in decreasing
   order of FLOPs saved per activation byte held (the knapsack ratio); for
   base plan ``k`` the family holds the plans storing the first ``j`` groups,
   ``j = 0 .. G``, thinned to :data:`MAX_STORE_STEPS` values of ``j`` on
   large graphs. Plain ``tf.gradients`` (everything stored) is in the family.
3. *Choice.* Every plan of the family is simulated (cached); the answer is
   the least ``(recompute cost, peak)`` among those whose forecast peak fits
   the budget, else the smallest-peak plan (``feasible=False``).

The family does not depend on the budget, so the answer is *monotone*: a
smaller budget never gives a larger forecast peak (if the plan chosen under
the larger budget fits the smaller one it is chosen again, by the
lexicographic order; otherwise the new plan's peak is below the smaller
budget, hence below the old plan's peak). It never exceeds the budget
because every plan's peak comes from the simulator.

Notes
-----
``O(F)`` simulations of ``O(n)`` each for a family of ``F`` plans (at most
about ``len(K) * MAX_STORE_STEPS``), plus ``O(m log m)`` bookkeeping.

References
----------
T. Chen, B. Xu, C. Zhang, C. Guestrin. Training Deep Nets with Sublinear
Memory Cost. arXiv:1604.06174, 2016.
"""

from __future__ import annotations

import bisect
import math
import time

from memsave.solvers.problem import Decision, Evaluation, Problem, SolveResult

__all__ = ["greedy", "family", "MAX_STORE_STEPS", "EXHAUSTIVE_CUTS"]

#: Values of ``j`` (groups stored) tried per base plan on large graphs: each
#: is one simulation, so this bounds the planning time (about 0.3 s per
#: 1000 ops for the whole family).
MAX_STORE_STEPS = 12

#: Up to this many candidate cuts, every checkpoint count ``k`` and every
#: ``j`` is tried (a richer family on graphs where simulation is cheap).
EXHAUSTIVE_CUTS = 30


def _spread(pos: list[int], total: int, k: int) -> list[int]:
    """Indices of ``k`` increasing positions closest to ``j * total / (k + 1)``."""
    chosen: list[int] = []
    lo = 0
    n = len(pos)
    for j in range(1, k + 1):
        target = total * j / (k + 1)
        hi = n - (k - j)
        i = bisect.bisect_left(pos, target, lo, hi)
        if i >= hi or (i > lo and target - pos[i - 1] <= pos[i] - target):
            i -= 1
        i = max(i, lo)
        chosen.append(i)
        lo = i + 1
    return chosen


def _thin(n: int, steps: int) -> list[int]:
    if n + 1 <= steps:
        return list(range(n + 1))
    return sorted({round(i * n / (steps - 1)) for i in range(steps)})


def family(problem: Problem) -> list[Decision]:
    """The budget-independent plans ``greedy`` chooses from (see module docstring)."""
    fg, costs = problem.fg, problem.costs
    m = len(problem.candidates)
    seg_bytes = [sum(costs.tensor_B[t] for o in seg for t in fg.ops[o].outputs
                     if fg.tensors[t].trainable) for seg in problem.segments]
    pos, total = [], 0
    for k in range(m):
        total += seg_bytes[k]
        pos.append(total)
    total += seg_bytes[m]
    small = m <= EXHAUSTIVE_CUTS
    if small:
        ks = list(range(0, m + 1))
    else:
        root = max(1, math.isqrt(m))
        ks = sorted({max(1, root // 2), root, min(m, 2 * root)})
    plans: dict[Decision, None] = {Decision.of(stored=range(m + 1)): None}
    for k in ks:
        kept = _spread(pos, total, k) if k else []
        bounds = [0, *(i + 1 for i in kept), m + 1]
        groups = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        ratio = []
        for gi, (a, b) in enumerate(groups):
            flops = sum(problem.segment_flops[a:b])
            held = max(sum(seg_bytes[a:b]), 1)
            ratio.append((-flops / held, gi))
        order = [gi for _, gi in sorted(ratio)]
        for j in (range(len(groups) + 1) if small else _thin(len(groups), MAX_STORE_STEPS)):
            stored = [s for gi in order[:j] for s in range(*groups[gi])]
            plans[Decision.of(kept, stored)] = None
    return list(plans)


def _pick(evs: list[Evaluation], budget_B: int) -> tuple[Evaluation, bool]:
    fits = [e for e in evs if e.peak_B <= budget_B]
    if fits:
        return min(fits, key=lambda e: (e.recompute_cost, e.peak_B, sorted(e.decision.kept))), True
    return min(evs, key=lambda e: (e.peak_B, e.recompute_cost, sorted(e.decision.kept))), False


def greedy(problem: Problem, budget_B: int, *, time_limit_s: float | None = None) -> SolveResult:
    """Cheapest plan of :func:`family` whose forecast peak fits ``budget_B``.

    ``time_limit_s`` is accepted for the common signature; the family is
    small enough that it is not needed.
    """
    start = time.perf_counter()
    evs = [problem.evaluate(d) for d in family(problem)]
    ev, _ = _pick(evs, budget_B)
    return problem.result("greedy", budget_B, ev, optimal=False,
                          solve_time_s=time.perf_counter() - start)
