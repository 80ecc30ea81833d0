"""``greedy``: a fast heuristic for large graphs, within budget and monotone.

Algorithm
---------
1. *A budget-independent family of plans* (:func:`family`), each a
   decision of the :class:`~memsave.planners.segments.Segments` space
   (segments recomputed, stored or expensive-kept):

   * *Layered plans* (:func:`_layered`): the first segments recomputed
     (with ``0``, ``sqrt`` or ``2 sqrt`` of their candidates kept, spread
     over their activation bytes), the next ones expensive-kept, the rest
     stored, for a grid of the two boundaries (:data:`LAYER_FRACTIONS`).
     The segments the backward pass reaches last (the first layers) are
     alive with everything after them, so they are the ones to recompute;
     the last ones cost memory only until their gradients, soon after the
     turn. On the study's ResNet-110 and U-Net these made the whole
     (recompute seconds, peak) front of the plans tried. The line with
     nothing expensive-kept (recompute, then store) is walked on a finer
     grid (:data:`STORE_FRACTIONS`).
   * *Knapsack plans*: storing a segment saves its recompute seconds and
     holds bytes until its gradient runs (estimated as its ops' inputs,
     outputs and gradient reads); keeping its expensive outputs saves the
     seconds of their producers' copies and holds those outputs
     (:meth:`Segments.segment_nanoseconds` estimates both). A
     multiple-choice knapsack over the segments gives the Pareto sets of
     modes (most seconds saved for the bytes held), thinned to
     :data:`MAX_STORE_STEPS` on large graphs, each combined with
     ``0, sqrt(m), 2 sqrt(m), 4 sqrt(m)`` kept cuts spread over the
     recomputed bytes (every count on small problems; with nothing stored
     also every cut one candidate later and one earlier).
   * The plans 'memory' weighs that these candidates can express
     (:func:`memsave.candidates.memory_plans`: greedy walks whose segments
     shrink toward the end, and spreads), each also with its last segments
     stored or expensive-kept (:data:`TAIL_FRACTIONS`).
   * Plain ``tf.gradients`` (everything stored) and every segment
     expensive-kept (the plan ``'speed'`` used to make).
   * On small problems (at most :data:`EXHAUSTIVE_CUTS` cuts) every plan's
     one-toggle neighbours, then a Pareto local search on the (recompute
     seconds, peak) front (:func:`_pareto_search`), within
     :data:`PARETO_SEARCH_OPS` of simulation.

2. *Choice.* The answer is the least ``(recompute seconds, peak)`` among
   the plans whose forecast peak fits the budget, else the smallest-peak
   plan (``feasible=False``). Plans whose at-turn lower bound on the peak
   (:class:`~memsave.planners.segments.TurnBound`, no schedule needed)
   exceeds the budget cannot fit and are dropped; the others' costs come
   from their schedules and the time model without simulating memory, so
   they are simulated (cached) in increasing cost, up to the first cost
   level with a plan that fits, except those whose schedule certainly
   holds more than the budget at some moment (:meth:`Segments.peak_floor`:
   when backprop starts, or when a step's gradients are about to start,
   its recomputation done), which cannot fit either. On
   experiments/bench_planner.py's 1000-op DAG, whose skips keep many
   tensors across the cuts, that floor came to 0.99 of the simulated peak
   over the plans a budget of 0.9 reached (the at-turn bound 0.3-0.75);
   that budget then simulated 7 plans, a refused one 7 (the bytes held at
   the turn alone: 98 and 143; no floor: 140 and 244), with the same
   answers.

The family does not depend on the budget, so the answer is *monotone*: a
smaller budget never gives a larger forecast peak (if the plan chosen under
the larger budget fits the smaller one it is chosen again, by the
lexicographic order; otherwise the new plan's peak is below the smaller
budget, hence below the old plan's peak). It never exceeds the budget
because every plan's peak comes from the simulator. Where the plans are
ordered by their exact cost (:data:`EXACT_COST_WORK`), a larger budget
never gets a plan forecast slower either; beyond it, ordered by a lower
bound on the cost, it may.

Notes
-----
For a family of ``F`` plans: ``F`` at-turn bounds, at most ``F`` schedules
and simulations of ``O(n)`` each (far fewer simulations when a cheap plan
fits), plus the knapsack over the segments, ``O(m * MAX_FRONT)``.

References
----------
T. Chen, B. Xu, C. Zhang, C. Guestrin. Training Deep Nets with Sublinear
Memory Cost. arXiv:1604.06174, 2016.
"""

from __future__ import annotations

import functools
import heapq
import math

import numpy as np

from memsave.candidates import spread
from memsave.planners.segments import Decision, Evaluation, Outcome, Segments

__all__ = ["greedy", "family", "MAX_STORE_STEPS", "EXHAUSTIVE_CUTS", "PARETO_ROUNDS",
           "PARETO_SEARCH_OPS", "LAYER_FRACTIONS", "STORE_FRACTIONS", "TAIL_FRACTIONS",
           "EXACT_COST_WORK", "COARSE_LAYERS_OPS", "COARSE_LAYER_FRACTIONS"]

#: Sets of segment modes tried on large graphs (thinned from the knapsack's
#: Pareto front, plus every segment expensive-kept), each with about four
#: checkpoint counts: every plan is one
#: simulation of the whole graph (its schedule and forecast: about 0.02 s of
#: CPU per 1000 ops, measured on experiments/bench_planner.py's 10,000-op
#: DAG), so this bounds the planning time.
MAX_STORE_STEPS = 8

#: Up to this many candidate cuts, every checkpoint count ``k`` is tried for
#: every stored set, and a Pareto local search (:func:`_pareto_search`)
#: enriches the family: a richer family where it stays small.
EXHAUSTIVE_CUTS = 16


@functools.lru_cache(maxsize=1024)
def _thin(n: int, steps: int) -> tuple[int, ...]:
    """About ``steps`` indices spread evenly over ``0 .. n``, both ends
    included (every index when there are no more). Cached: the knapsack
    thins fronts of the same few lengths at every segment."""
    if n + 1 <= steps:
        return tuple(range(n + 1))
    return tuple(sorted({round(i * n / (steps - 1)) for i in range(steps)}))


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


def _mode_sets(space: Segments, held: list[int], *, expensive: bool = True,
               steps: int | None = None) -> list[tuple[frozenset[int], frozenset[int]]]:
    """Pareto-optimal ``(stored, expensive-kept)`` segment sets: most
    nanoseconds saved for the bytes held (a multiple-choice knapsack solved
    for every capacity at once, by DP over segments). A stored segment
    holds ``held[j]`` and saves its recompute estimate; an expensive-kept
    one holds its expensive outputs and saves what its copies of them would
    have cost (:meth:`Segments.segment_nanoseconds`). ``steps``: about that
    many of them, spread evenly over the front, and the last; only those
    are built (a set costs O(segments))."""
    counted, tensor_bytes = space.allocator.counted, space.costs.tensor_bytes
    # The front, as arrays over its points: bytes held, nanoseconds saved,
    # segments stored and kept. Sorted by bytes, each point saving strictly
    # more than those before. Per segment, each point's choice there (0
    # none, 1 stored, 2 kept) and its point in the front before: a set is
    # rebuilt from them at the end.
    nbytes, saved, n_stored, n_kept = (np.zeros(1, np.int64) for _ in range(4))
    links: list[tuple[int, np.ndarray, np.ndarray]] = []
    for j, seg in enumerate(space.segments):
        if not seg:
            continue
        whole = space.segment_nanoseconds(j)
        options = [(held[j], whole, 1)]
        if expensive and space.expensive_outputs[j]:
            more = whole - space.segment_nanoseconds(j, expensive=True)
            if more > 0:
                options.append((sum(counted(tensor_bytes[t]) for t in space.expensive_outputs[j]),
                                more, 2))
        add_bytes, add_saved, codes = (np.array(x, np.int64) for x in zip(*options))
        f, k = len(nbytes), len(options)
        # In the order of the stable sort's ties: the front, then each of its
        # points' options in turn.
        all_bytes = np.concatenate([nbytes, (nbytes[:, None] + add_bytes).ravel()])
        all_saved = np.concatenate([saved, (saved[:, None] + add_saved).ravel()])
        choice = np.concatenate([np.zeros(f, np.int64), np.tile(codes, f)])
        parent = np.concatenate([np.arange(f), np.repeat(np.arange(f), k)])
        order = np.lexsort((-all_saved, all_bytes))
        ranked = all_saved[order]
        # Keep the points that save strictly more for more bytes.
        keep = np.empty(len(order), bool)
        keep[0] = True
        keep[1:] = ranked[1:] > np.maximum.accumulate(ranked)[:-1]
        picked = order[keep]
        if len(picked) > MAX_FRONT:
            picked = picked[list(_thin(len(picked) - 1, MAX_FRONT))]
        choice, parent = choice[picked], parent[picked]
        nbytes, saved = all_bytes[picked], all_saved[picked]
        n_stored = n_stored[parent] + (choice == 1)
        n_kept = n_kept[parent] + (choice == 2)
        links.append((j, choice, parent))

    def sets(i: int | None) -> tuple[frozenset[int], frozenset[int]]:
        stored, kept = set(), set()
        if i is not None:
            for j, choice, parent in reversed(links):
                if choice[i]:
                    (stored if choice[i] == 1 else kept).add(j)
                i = parent[i]
        return frozenset(stored), _spread_expensive(space, stored, kept)

    points: list[int | None] = list(range(len(nbytes)))
    if n_stored[0] or n_kept[0]:  # nothing stored or kept is always in the family
        points.insert(0, None)
    # The front's sets are distinct (a point is one set of choices, and a
    # kept segment has expensive outputs, which the spread never adds). The
    # plan 'speed' used to make (every segment expensive-kept) is one of
    # them when some segment has expensive outputs and a point stores none
    # and keeps every such segment (the spread then covers the rest).
    everything = [(frozenset(), frozenset(range(len(space.segments))))] if expensive else []
    with_expensive = sum(1 for ts in space.expensive_outputs if ts)
    if everything and with_expensive and np.any((n_stored == 0) & (n_kept == with_expensive)):
        everything = []
    if steps is None:
        return [sets(i) for i in points] + everything
    n = len(points) + len(everything)
    chosen = [sets(points[i]) if i < len(points) else everything[0] for i in _thin(n - 1, steps)]
    return list(dict.fromkeys(chosen + (everything or [sets(points[-1])])))


def _spread_expensive(space: Segments, stored: set[int], kept: set[int]) -> frozenset[int]:
    """``kept`` (expensive-kept segments) extended over the recomputed
    segments next to them that have no expensive outputs: the same memory,
    without a candidate kept where the mode would change (Segments.canonical)."""
    kept = set(kept)
    n = len(space.segments)
    for order in (range(n), range(n - 1, -1, -1)):
        for j in order:
            if j in stored or j in kept or space.expensive_outputs[j]:
                continue
            if (j - 1 in kept) or (j + 1 in kept):
                kept.add(j)
    return frozenset(kept)


def family(space: Segments, *, max_plans: int | None = None) -> list[Decision]:
    """The budget-independent plans ``greedy`` chooses from (see module docstring).

    ``max_plans`` (a preset's bounded search: ``'memory'`` passes at most
    :data:`memsave.planners.strategies.MEMORY_SEARCH_PLANS`) bounds the
    one-toggle neighbours and the Pareto search on small problems, which
    simulates every plan of the family: no plan is added once the family
    holds ``max_plans``.
    """
    fg, costs = space.fg, space.costs
    m = len(space.candidates)
    seg_bytes = [sum(costs.tensor_bytes[t] for o in seg for t in fg.ops[o].outputs
                     if fg.tensors[t].trainable) for seg in space.segments]
    small = m <= EXHAUSTIVE_CUTS
    sets = _mode_sets(space, _held_bytes(space), steps=None if small else MAX_STORE_STEPS)
    cap = max(400, PARETO_SEARCH_OPS // max(1, len(fg.ops)))  # plans, on small problems
    if max_plans is not None:
        cap = min(cap, max_plans)
    if small:  # both estimates of the bytes a stored segment holds
        sets = list(dict.fromkeys(sets + _mode_sets(space, _held_bytes(space, io=False))))
        if len(sets) * (m + 1) > cap // 3:
            sets = [sets[i] for i in _thin(len(sets) - 1, max(2, cap // (3 * (m + 1))))]
    plans: dict[Decision, None] = {Decision.of(stored=range(m + 1)): None}
    for stored, expensive in sets:
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
            plans[Decision.of([free[i] for i in idx], stored, expensive)] = None
            if not stored and not expensive and not small:
                # Cuts one candidate later or earlier: which tensor of a
                # layer is kept (a matmul's output or its activation's)
                # changes the peak by a layer's worth.
                for shift in (1, -1):
                    moved = sorted({min(max(i + shift, 0), len(free) - 1) for i in idx})
                    plans[Decision.of([free[i] for i in moved], stored)] = None
    plans.update(dict.fromkeys(_layered(space, seg_bytes, coarse=len(fg.ops) >= COARSE_LAYERS_OPS)))
    # 'memory''s own plans over these candidates (greedy walks whose segments
    # shrink toward the end, as Griewank's do): without them the smallest
    # peak this family reached was above 'memory''s (keras ResNet50, batch
    # 32: 248 vs 237 MiB forecast), so a budget 'memory' meets was called
    # infeasible. With their last segments stored or expensive-kept: what
    # 'memory' weighs within its peak tolerance.
    at = space.candidate_index
    n = m + 1
    for chosen in space.problem.memory_plans():
        if all(t in at for t in chosen):
            kept = [at[t] for t in chosen]
            plans[Decision.of(kept)] = None
            for f in TAIL_FRACTIONS:
                start = min(n - 1, int(f * n))
                tail = range(start, n)
                head = [k for k in kept if k < start]
                plans[Decision.of(head, stored=tail)] = None
                plans[Decision.of(head, expensive=tail)] = None
    plans = {space.canonical(d): None for d in plans}
    if small:
        # Local moves: every base plan with one candidate or segment toggled,
        # then the Pareto local search from the front of them all.
        for d in list(plans):
            for nb in _neighbours(space, d):
                if len(plans) < 2 * cap // 3:
                    plans.setdefault(space.canonical(nb), None)
        _pareto_search(space, plans, cap, strict=max_plans is not None)
    return list(plans)


#: Boundaries of the layered plans (:func:`_layered`), as fractions of the
#: segments: every pair ``a <= b`` recomputes the segments before ``a``,
#: expensive-keeps those from ``a`` to ``b`` and stores the rest. Twelve
#: values, 78 pairs; on ResNet-110 a finer grid (15 values) moved no plan of
#: the front by more than 0.5% of the step.
LAYER_FRACTIONS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)

#: Further boundaries ``b`` of layered plans with nothing expensive-kept
#: (``a = b``, ``sqrt`` candidates kept before it): the store-or-recompute
#: line, finer than :data:`LAYER_FRACTIONS` where storing the tail pays.
#: The time model forecasts expensive-kept segments (a convolution's output
#: kept, its batch norm and ReLU recomputed, a backward step each) closer
#: to what they measure than stored and recomputed ones: on the study's
#: ResNet-110 (batch 32, interleaved with tf.gradients, 15 rounds), plans
#: storing the last 29 to 37 of 97 segments measured 1.14-1.16x the plain
#: step (forecast 1.20-1.22x), and the 90-step expensive-kept plan the
#: grid without them chose at 0.27 of the plain peak 1.20x (forecast 1.23x,
#: the same as the 8-step plan at 0.22, measured 1.175x).
STORE_FRACTIONS = (0.55, 0.65, 0.7, 0.75, 0.85, 0.9, 0.95)

#: Where the tails of 'memory''s plans start (fractions of the segments)
#: when the family stores them or keeps their expensive outputs.
TAIL_FRACTIONS = (0.75, 0.9)


#: Graphs of this many ops or more get the layered plans of
#: :data:`COARSE_LAYER_FRACTIONS` only: on large graphs ``greedy`` orders
#: plans by a lower bound on their cost, and the many cheap layered plans
#: that do not fit each cost a simulation (about 0.2 s at 10,000 ops: 156
#: of them, 60 s of CPU, on experiments/bench_planner.py's 10,000-op DAG).
COARSE_LAYERS_OPS = 2000
COARSE_LAYER_FRACTIONS = (0.0, 0.25, 0.5, 1.0)


def _layered(space: Segments, seg_bytes: list[int], *, coarse: bool = False) -> list[Decision]:
    """The layered plans (see module docstring): recomputed, then
    expensive-kept, then stored segments, for every pair of boundaries of
    :data:`LAYER_FRACTIONS` (``coarse``: :data:`COARSE_LAYER_FRACTIONS`);
    the recomputed part keeps 0, ``sqrt`` and ``2 sqrt`` of its candidates
    (spread over its activation bytes). Not ``coarse``, also the plans
    storing from each boundary of :data:`STORE_FRACTIONS` on, ``sqrt`` kept
    before it."""
    n = len(space.segments)
    fractions = COARSE_LAYER_FRACTIONS if coarse else LAYER_FRACTIONS
    bounds = sorted({round(f * n) for f in fractions})
    stores = () if coarse else sorted({round(f * n) for f in STORE_FRACTIONS} - set(bounds))
    out = []
    for a in sorted({*bounds, *stores}):
        # Candidates 0 .. a-2 end segments 0 .. a-2: cuts inside the recomputed part.
        pos, total = [], 0
        for k in range(max(0, a - 1)):
            total += seg_bytes[k]
            pos.append(total)
        total += seg_bytes[a - 1] if a else 0
        root = math.isqrt(len(pos))
        counts = sorted({0, root, 2 * root} & set(range(len(pos) + 1)))
        if a in stores:  # the store-or-recompute line only
            out.append(Decision.of(spread(pos, total, root) if root else [], stored=range(a, n)))
            continue
        heads = [spread(pos, total, k) if k else [] for k in counts]
        for b in bounds:
            if b < a:
                continue
            for idx in heads:
                out.append(Decision.of(idx, stored=range(b, n), expensive=range(a, b)))
    return out


#: Work (the graph's ops times the family's plans) up to which ``greedy``
#: orders the plans by their exact forecast cost (a schedule each, for the
#: plans whose lower bound is below the answer's); beyond it, by the lower
#: bound (:meth:`Segments.lower_bound`, no schedule), evaluating plans in
#: that order up to the first that fits. At 10,000 ops costing every plan
#: took 25-35 s of CPU on experiments/bench_planner.py's DAG, at 1000 ops
#: 1.2-1.5 s; the study's ResNet-110 (725 ops, about 250 plans) is costed
#: exactly: ordered by the bound, its budget 0.75 plan was forecast at
#: 1.109x the plain step instead of 1.073x. 400,000 costs exactly the
#: families of graphs of up to 100 ops searched to their 3000-plan cap: with
#: a recompute step's fixed cost in the time model the bound's order strayed
#: from the cost's (tests/test_solvers.py's 100-op chain: 1.25x the proven
#: optimum at one budget, 1.0x costed), and bench_planner's 1000-op
#: graphs still planned every budget in under 0.9 s.
EXACT_COST_WORK = 400_000

#: Rounds of the Pareto local search on small problems (each evaluates the
#: neighbours of the plans on the (recompute cost, peak) front found so
#: far); it usually stops earlier, when a round adds no front plan.
PARETO_ROUNDS = 8

#: Work allowed to greedy's family on small problems, in simulated ops
#: (plans times the graph's ops; at least 400 plans): a third for the base
#: plans, a third for their one-toggle neighbours, the rest for the Pareto
#: local search; about 3 s of simulation at most here, usually much less
#: (the search stops when a round adds no plan to the front). It depends on
#: the graph only, so the family stays budget-independent. With recompute
#: time as the cost, a third of this left greedy 13% slower than the exact
#: plan on a 100-op chain of 10 cuts (tests/test_solvers.py).
PARETO_SEARCH_OPS = 300_000


def _neighbours(space: Segments, d: Decision, *, pairs: bool = False):
    """``d`` with one candidate kept or not, or one segment stored or not,
    expensive-kept or not (``pairs``: or two segments stored or not)."""
    m = len(space.candidates)
    for k in range(m):
        yield Decision(d.kept ^ {k}, d.stored, d.expensive)
    for j in range(m + 1):
        yield Decision(d.kept, d.stored ^ {j}, d.expensive - {j})
        if space.expensive_outputs[j]:
            yield Decision(d.kept, d.stored - {j}, d.expensive ^ {j})
        if pairs:
            for i in range(j):
                yield Decision(d.kept, d.stored ^ {i, j}, d.expensive - {i, j})


def _front(evs) -> list[Evaluation]:
    """The (recompute seconds, peak) Pareto front of ``evs``."""
    out: list[Evaluation] = []
    for e in sorted(evs, key=lambda e: (e.recompute_ns, e.peak_bytes)):
        if not out or e.peak_bytes < out[-1].peak_bytes:
            out.append(e)
    return out


def _pareto_search(space: Segments, plans: dict, cap: int, *, strict: bool = False) -> None:
    """Add to ``plans`` the neighbours of the (seconds, peak) front, round by round
    (one candidate toggled, or one or two segments: moving a stored segment
    along the chain takes two toggles whose midpoint is off the front).

    The front does not depend on the budget, so neither does the family
    (greedy stays monotone); it approaches the true trade-off curve that
    the exact solvers find, one toggle at a time. ``cap`` bounds the plans
    (at least 200 more than given, unless ``strict``: then a family of
    ``cap`` plans or more is not searched, nor simulated).
    """
    if strict and len(plans) >= cap:
        return
    cap = cap if strict else max(cap, len(plans) + 200)
    expanded: set[Decision] = set()
    for _ in range(PARETO_ROUNDS):
        front = _front([space.evaluate(d) for d in plans])
        todo = [e.decision for e in front if e.decision not in expanded]
        if not todo:
            return
        for d in todo:  # cheapest first: the budget's cut falls in the same place every time
            expanded.add(d)
            for nb in _neighbours(space, d, pairs=True):
                if len(plans) >= cap:
                    return
                plans.setdefault(space.canonical(nb), None)


def _order(d: Decision) -> tuple:
    """A total order on decisions, for ties."""
    return sorted(d.kept), sorted(d.stored), sorted(d.expensive)


def _pick(evs: list[Evaluation], budget_bytes: int) -> tuple[Evaluation, bool]:
    fits = [e for e in evs if e.peak_bytes <= budget_bytes]
    if fits:
        return min(fits, key=lambda e: (e.recompute_ns, e.peak_bytes, _order(e.decision))), True
    return min(evs, key=_by_peak), False


def greedy(space: Segments, budget_bytes: int, *, time_limit_s: float | None = None,
           max_simulations: int | None = None) -> Outcome:
    """Fastest plan of :func:`family` whose forecast peak fits ``budget_bytes``.

    Plans whose at-turn bound (:attr:`Segments.turn_bound`) exceeds the
    budget cannot fit and are dropped without a schedule; the rest are
    simulated lazily, in increasing recompute seconds (known without
    simulating memory, :meth:`Segments.cost`, and bounded below without a
    schedule, :meth:`Segments.lower_bound`): the first cost level with a
    plan that fits holds the answer, so the plans above it are never
    simulated, and those whose bound is above it never scheduled; nor is a
    plan whose schedule's floor (:meth:`Segments.peak_floor`) is over the
    budget simulated. The answer is the one simulating the whole family would give
    (hence monotone). An infeasible budget simulates plans in increasing
    bound until the bound reaches the smallest peak found, but those whose
    floor is above it.

    ``time_limit_s`` is accepted for the common signature; the family is
    small enough that it is not needed. ``max_simulations``: stop after
    that many plans simulated (the fastest that fits among them, else the
    smallest peak among them), for a caller that would rather keep a plan
    it has than search long (``'memory'``); the answer then depends on the
    budget in more than its feasible set, and is not monotone. (A plan
    ruled out by its floor counts as simulated, so the cap stops where it
    did when every plan was simulated; where none of them fits, those
    whose floor is above the smallest peak found are not simulated.)
    """
    plans = family(space, max_plans=max_simulations)
    bound = {d: space.turn_bound(d) for d in plans}
    # Cheapest first by (cost, order), the cost known lazily: a plan enters
    # with its lower bound (no schedule) and is re-queued with its cost
    # when it reaches the top; so schedules are built only for plans whose
    # bound is below the answer's cost, and the answer is the one costing
    # every plan would give.
    # On large problems the lower bound is the cost the plans are ordered by:
    # costing every plan takes a schedule each, about 0.02 s per 1000 ops.
    # That order does not depend on the budget (a larger budget gets a plan
    # no later in it), but it is not the forecast time's: a larger budget
    # may get a plan forecast slower (a ResNet-like CNN, 16 cuts and 1477
    # plans: 1.154x the plain step at 0.75 of the plain peak, 1.148x at 0.7).
    # The floor is checked when a plan comes back with its cost, not when
    # its schedule is first built, although that would build fewer schedules
    # under a cap ('memory' on bench_planner's 1000-op DAG: 46 instead of
    # 94, 0.30 s instead of 0.39): the cap would then count the plans the
    # floor rules out in the bound's order, so the answer would depend on
    # how tight the bounds are (4 of planner_answers.py's 394 answers got
    # slower plans, and test_solvers' same-answer checks fail).
    exact = len(space.fg.ops) * len(plans) <= EXACT_COST_WORK
    heap = [(space.lower_bound(d, steps=exact), not exact, _order(d), d) for d in plans
            if bound[d] <= budget_bytes]
    heapq.heapify(heap)
    evs: list[Evaluation] = []
    over: list[Decision] = []  # plans whose schedule's floor is over the budget: not simulated
    level_cost = None
    while heap:
        value, exact, order, d = heapq.heappop(heap)
        if level_cost is not None and value > level_cost:
            break
        if not exact:
            heapq.heappush(heap, (space.cost(d), True, order, d))
            continue
        if space.peak_floor(d) > budget_bytes:
            over.append(d)
        else:
            e = space.evaluate(d)
            evs.append(e)
            if e.peak_bytes <= budget_bytes and level_cost is None:
                level_cost = value  # the rest of this cost level may tie it
        if max_simulations is not None and len(evs) + len(over) >= max_simulations:
            if level_cost is None:  # the smallest peak among them
                return Outcome(_smallest(space, over, min(evs, key=_by_peak, default=None)),
                               optimal=False)
            break
    if level_cost is not None:
        ev, _ = _pick(evs, budget_bytes)
        return Outcome(ev, optimal=False)
    # Nothing fits: the smallest peak, in increasing bound until the bound
    # passes the best peak found.
    best = None
    for d in sorted(plans, key=lambda d: (bound[d], _order(d))):
        if best is not None and bound[d] > best.peak_bytes:
            break
        if best is not None and space.peak_floor(d) > best.peak_bytes:
            continue  # its peak is above the best one's
        e = space.evaluate(d)
        if best is None or _by_peak(e) < _by_peak(best):
            best = e
    return Outcome(best, optimal=False)


def _by_peak(e: Evaluation) -> tuple:
    """The order of the smallest peak: peak, then recompute seconds, then the decision."""
    return e.peak_bytes, e.recompute_ns, _order(e.decision)


def _smallest(space: Segments, plans: list[Decision], best: Evaluation | None) -> Evaluation:
    """The least :func:`_by_peak` of ``best`` and ``plans``, simulating only
    the plans whose floor (:meth:`Segments.peak_floor`) is not above the
    best peak found, in increasing floor (the same answer as simulating
    them all)."""
    for d in sorted(plans, key=lambda d: (space.peak_floor(d), _order(d))):
        if best is not None and space.peak_floor(d) > best.peak_bytes:
            break
        e = space.evaluate(d)
        if best is None or _by_peak(e) < _by_peak(best):
            best = e
    return best
