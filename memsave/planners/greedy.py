"""``greedy``: a fast heuristic for large graphs, within budget and monotone.

Algorithm
---------
1. *Base plans.* For a few checkpoint counts ``k`` (``0, sqrt(m),
   2 sqrt(m), 4 sqrt(m)`` of the ``m`` candidate cuts, and every ``k`` on small
   problems), keep ``k`` cuts spread so that the segments between them hold
   about equal activation bytes (Chen et al.'s sqrt(n) plan), and with
   nothing stored also every cut one candidate later and one earlier, and
   the plans 'memory' chooses among that these candidates can express
   (:func:`memsave.strategies.memory_plans`: greedy walks whose segments
   shrink toward the end, and spreads). The cuts split the
   segments into groups.
2. *Stored sets.* Storing a segment saves its FLOPs and holds bytes until
   its gradient runs (estimated as its ops' inputs, outputs and gradient
   reads); a 0/1 knapsack over the segments gives the Pareto sets (most
   FLOPs saved for the bytes held), thinned to :data:`MAX_STORE_STEPS` on
   large graphs; the empty set is always one. Each set is combined with the
   base plans of step 1 over the segments it leaves recomputed. Plain
   ``tf.gradients`` (everything stored) is in the family.
   On small problems (at most :data:`EXHAUSTIVE_CUTS` cuts) every plan's
   one-toggle neighbours join, then a Pareto local search on the
   (recompute cost, peak) front (:func:`_pareto_search`), within
   :data:`PARETO_SEARCH_OPS` of simulation.
3. *Choice.* The answer is the least ``(recompute cost, peak)`` among the
   plans whose forecast peak fits the budget, else the smallest-peak plan
   (``feasible=False``). Costs are known without simulating, so plans are
   simulated (cached) in increasing cost, up to the first cost level with a
   plan that fits.

The family does not depend on the budget, so the answer is *monotone*: a
smaller budget never gives a larger forecast peak (if the plan chosen under
the larger budget fits the smaller one it is chosen again, by the
lexicographic order; otherwise the new plan's peak is below the smaller
budget, hence below the old plan's peak). It never exceeds the budget
because every plan's peak comes from the simulator.

Notes
-----
At most ``F`` simulations of ``O(n)`` each for a family of ``F`` plans
(about ``4 * MAX_STORE_STEPS`` on large graphs; fewer when a cheap plan
fits), plus the knapsack over the segments, ``O(m * MAX_FRONT)``.

References
----------
T. Chen, B. Xu, C. Zhang, C. Guestrin. Training Deep Nets with Sublinear
Memory Cost. arXiv:1604.06174, 2016.
"""

from __future__ import annotations

import math
import time

from memsave.candidates import spread
from memsave.planners.segments import Decision, Evaluation, Outcome, Segments

__all__ = ["greedy", "family", "MAX_STORE_STEPS", "EXHAUSTIVE_CUTS", "PARETO_ROUNDS",
           "PARETO_SEARCH_OPS"]

#: Stored sets tried on large graphs (thinned from the knapsack's Pareto
#: front), each with about four checkpoint counts: every plan is one
#: simulation of the whole graph (its schedule and forecast: about 0.02 s of
#: CPU per 1000 ops, measured on experiments/bench_planner.py's 10,000-op
#: DAG), so this bounds the planning time.
MAX_STORE_STEPS = 8

#: Up to this many candidate cuts, every checkpoint count ``k`` is tried for
#: every stored set, and a Pareto local search (:func:`_pareto_search`)
#: enriches the family: a richer family where it stays small.
EXHAUSTIVE_CUTS = 16


def _thin(n: int, steps: int) -> list[int]:
    if n + 1 <= steps:
        return list(range(n + 1))
    return sorted({round(i * n / (steps - 1)) for i in range(steps)})


#: Largest Pareto front of stored sets kept per step of the knapsack DP
#: (points merged beyond it): bounds its time on graphs with many segments.
MAX_FRONT = 256


def _held_bytes(space: Segments, *, io: bool = True) -> list[int]:
    """Per segment: counted bytes held when it is stored: what its gradients
    read, and its ops' inputs and outputs (``build_schedule`` keeps them, and
    the neighbouring steps read them); an over-estimate where a tensor dies
    early, which steers the knapsack away from stored ops that split
    recomputed segments (a stored BiasAdd alone reads nothing for its
    gradient but keeps its input and output). ``io=False``: the gradients'
    reads only (an under-estimate)."""
    fg, costs, counted = space.fg, space.costs, space.allocator.counted
    out = []
    for seg in space.segments:
        reads = set()
        for o in seg:
            if io:
                reads.update(fg.ops[o].inputs)
                reads.update(fg.ops[o].outputs)
            else:
                read_ins, read_outs = costs.gradient_reads[o]
                reads.update(read_ins)
                reads.update(read_outs)
        out.append(sum(counted(costs.tensor_bytes[t]) for t in reads
                       if fg.tensors[t].kind == "internal" and costs.alias_of[t] is None))
    return out


def _stored_sets(space: Segments, held: list[int]) -> list[frozenset[int]]:
    """Pareto-optimal stored sets: most FLOPs saved for the ``held`` bytes
    (a 0/1 knapsack solved for every capacity at once, by DP over segments)."""
    # Points (bytes, -flops, segment added, parent point): sets are rebuilt
    # from the parent links at the end, so a step costs O(front), not O(m).
    front: list[tuple] = [(0, 0, -1, None)]
    for j, seg in enumerate(space.segments):
        if not seg:
            continue
        f = space.segment_flops[j]
        merged = sorted(front + [(b + held[j], nf - f, j, pt) for pt in front
                                 for b, nf in [(pt[0], pt[1])]],
                        key=lambda x: (x[0], x[1]))
        front = []
        for pt in merged:  # keep points that save strictly more for more bytes
            if not front or pt[1] < front[-1][1]:
                front.append(pt)
        if len(front) > MAX_FRONT:
            front = [front[i] for i in _thin(len(front) - 1, MAX_FRONT)]
    if front[0][2] >= 0:  # the empty set (nothing stored) is always in the family
        front.insert(0, (0, 0, -1, None))
    out = []
    for pt in front:
        st = set()
        while pt is not None and pt[2] >= 0:
            st.add(pt[2])
            pt = pt[3]
        out.append(frozenset(st))
    return out


def family(space: Segments) -> list[Decision]:
    """The budget-independent plans ``greedy`` chooses from (see module docstring)."""
    fg, costs = space.fg, space.costs
    m = len(space.candidates)
    seg_bytes = [sum(costs.tensor_bytes[t] for o in seg for t in fg.ops[o].outputs
                     if fg.tensors[t].trainable) for seg in space.segments]
    small = m <= EXHAUSTIVE_CUTS
    sets = _stored_sets(space, _held_bytes(space))
    cap = max(400, PARETO_SEARCH_OPS // max(1, len(fg.ops)))  # plans, on small problems
    if small:  # both estimates of the bytes a stored segment holds
        sets = list(dict.fromkeys(sets + _stored_sets(space, _held_bytes(space, io=False))))
        if len(sets) * (m + 1) > cap // 3:
            sets = [sets[i] for i in _thin(len(sets) - 1, max(2, cap // (3 * (m + 1))))]
    else:
        sets = [sets[i] for i in _thin(len(sets) - 1, MAX_STORE_STEPS)]
    plans: dict[Decision, None] = {Decision.of(stored=range(m + 1)): None}
    for stored in sets:
        # Candidates free to keep (their segment recomputed), placed at the
        # recomputed bytes before them; cuts spread evenly over those bytes.
        free, pos, total = [], [], 0
        for k in range(m):
            if k not in stored:
                total += seg_bytes[k]
                free.append(k)
                pos.append(total)
        if m not in stored:
            total += seg_bytes[m]
        if small:
            ks = range(len(free) + 1)
        else:
            root = max(1, math.isqrt(len(free)))
            ks = sorted({k for k in (0, root, 2 * root, 4 * root) if k <= len(free)})
        for k in ks:
            idx = spread(pos, total, k) if k else []
            plans[Decision.of([free[i] for i in idx], stored)] = None
            if not stored and not small:
                # Cuts one candidate later or earlier: which tensor of a
                # layer is kept (a matmul's output or its activation's)
                # changes the peak by a layer's worth.
                for shift in (1, -1):
                    moved = sorted({min(max(i + shift, 0), len(free) - 1) for i in idx})
                    plans[Decision.of([free[i] for i in moved], stored)] = None
    # 'memory''s own plans over these candidates (greedy walks whose segments
    # shrink toward the end, as Griewank's do): without them the smallest
    # peak this family reached was above 'memory''s (keras ResNet50, batch
    # 32: 248 vs 237 MiB forecast), so a budget 'memory' meets was called
    # infeasible.
    at = {t: k for k, t in enumerate(space.candidates)}
    for chosen in space.problem.memory_plans():
        if all(t in at for t in chosen):
            plans[Decision.of([at[t] for t in chosen])] = None
    if small:
        # Local moves: every base plan with one candidate or segment toggled,
        # then the Pareto local search from the front of them all.
        for d in list(plans):
            for nb in _neighbours(d, m):
                if len(plans) < 2 * cap // 3:
                    plans.setdefault(space.canonical(nb), None)
        _pareto_search(space, plans, cap)
    return list(plans)


#: Rounds of the Pareto local search on small problems (each evaluates the
#: neighbours of the plans on the (recompute cost, peak) front found so
#: far); it usually stops earlier, when a round adds no front plan.
PARETO_ROUNDS = 8

#: Work allowed to greedy's family on small problems, in simulated ops
#: (plans times the graph's ops; at least 400 plans): a third for the base
#: plans, a third for their one-toggle neighbours, the rest for the Pareto
#: local search; about 1 s of simulation here. It
#: depends on the graph only, so the family stays budget-independent.
PARETO_SEARCH_OPS = 100_000


def _neighbours(d: Decision, m: int, *, pairs: bool = False):
    """``d`` with one candidate or one segment toggled (``pairs``: or two segments)."""
    for k in range(m):
        yield Decision(d.kept ^ {k}, d.stored)
    for j in range(m + 1):
        yield Decision(d.kept, d.stored ^ {j})
        if pairs:
            for i in range(j):
                yield Decision(d.kept, d.stored ^ {i, j})


def _front(evs) -> list[Evaluation]:
    """The (recompute cost, peak) Pareto front of ``evs``."""
    out: list[Evaluation] = []
    for e in sorted(evs, key=lambda e: (e.recompute_cost, e.peak_bytes)):
        if not out or e.peak_bytes < out[-1].peak_bytes:
            out.append(e)
    return out


def _pareto_search(space: Segments, plans: dict, cap: int) -> None:
    """Add to ``plans`` the neighbours of the (cost, peak) front, round by round
    (one candidate toggled, or one or two segments: moving a stored segment
    along the chain takes two toggles whose midpoint is off the front).

    The front does not depend on the budget, so neither does the family
    (greedy stays monotone); it approaches the true trade-off curve that
    the exact solvers find, one toggle at a time.
    """
    m = len(space.candidates)
    cap = max(cap, len(plans) + 200)
    expanded: set[Decision] = set()
    for _ in range(PARETO_ROUNDS):
        front = _front([space.evaluate(d) for d in plans])
        todo = [e.decision for e in front if e.decision not in expanded]
        if not todo:
            return
        for d in todo:  # cheapest first: the budget's cut falls in the same place every time
            expanded.add(d)
            for nb in _neighbours(d, m, pairs=True):
                if len(plans) >= cap:
                    return
                plans.setdefault(space.canonical(nb), None)


def _pick(evs: list[Evaluation], budget_bytes: int) -> tuple[Evaluation, bool]:
    fits = [e for e in evs if e.peak_bytes <= budget_bytes]
    if fits:
        return min(fits, key=lambda e: (e.recompute_cost, e.peak_bytes, sorted(e.decision.kept))), True
    return min(evs, key=lambda e: (e.peak_bytes, e.recompute_cost, sorted(e.decision.kept))), False


def greedy(space: Segments, budget_bytes: int, *, time_limit_s: float | None = None) -> Outcome:
    """Cheapest plan of :func:`family` whose forecast peak fits ``budget_bytes``.

    Plans are simulated lazily, in increasing recompute cost (known without
    simulating, :meth:`Segments.recompute_cost`): the first cost level with a
    plan that fits holds the answer, so the plans above it are never
    simulated. The answer is the one simulating the whole family would give
    (hence monotone). Only an infeasible budget simulates every plan.

    ``time_limit_s`` is accepted for the common signature; the family is
    small enough that it is not needed.
    """
    start = time.perf_counter()
    plans = sorted(family(space), key=lambda d: (space.recompute_cost(d), sorted(d.kept),
                                                   sorted(d.stored)))
    evs: list[Evaluation] = []
    i = 0
    while i < len(plans):
        cost = space.recompute_cost(plans[i])
        level = []
        while i < len(plans) and space.recompute_cost(plans[i]) == cost:
            level.append(space.evaluate(plans[i]))
            i += 1
        evs += level
        if any(e.peak_bytes <= budget_bytes for e in level):
            break
    ev, _ = _pick(evs, budget_bytes)
    return Outcome(ev, optimal=False)
