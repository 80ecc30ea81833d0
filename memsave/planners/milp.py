"""``milp``: exact on small graphs: an integer program over groups of segments, lazily cut.

Formulation
-----------
A decision is a partition of the segments into groups
(:meth:`Segments.groups`): each group is recomputed (``R``, from the kept
candidate before it), expensive-kept (``E``) or one stored segment (``S``;
``S+`` with the candidate before it kept);
so a partition is a path from position 0 to the last segment's end, one
edge per group (``R`` and ``E`` edges never run through an empty segment,
which is stored by convention; ``E`` only where the run has expensive
outputs). The *master* problem is the cheapest such path under

* a cost that bounds every decision's forecast nanoseconds from below
  (:meth:`Segments.group_lower_bound` per recomputed group: the copies it
  runs with every tensor kept that its decision could keep; and the gates,
  :class:`StepBounds`: each candidate that heads a recompute step, each
  group's gated first read, the ys' step), and
* a relaxation of the memory budget that holds for every plan the
  simulator accepts (the at-turn bound, :class:`TurnBound`): the resident
  bytes, what stored segments' gradients read, the candidate each group
  starts from (when its first segment reads it and the segment before is
  not stored) and an expensive-kept group's expensive outputs that it
  reads, each buffer once, at most the budget.

The loop (lazy constraints, as in combinatorial Benders decomposition):
take the cheapest partition the master allows, simulate the one decision
it is, exclude it, and repeat until the master's next partition costs at
least the best forecast found (optimal, gap 0), no partition is left, or
the time limit passes (the best plan so far, ``optimal=False``, with its
gap). The incumbent starts as ``greedy``'s plan, so a time limit always
returns a plan at least that good.

The master is a shortest path with a knapsack side constraint: its
partitions are enumerated best-first (uniform-cost search over partial
paths, each cost and byte count only growing along a path, a path pruned
once its bytes exceed the budget), cheapest first, which is what solving
it again after each no-good cut would give; on a chain the group bounds
are the groups' costs, so few partitions are simulated. An LP-based MILP
solver (HiGHS) did the same with a no-good cut per round, and took
seconds to minutes on 12-segment chains that this proves in well under a
second.

When nothing of ``greedy``'s family fits, partitions are first taken in
order of their at-turn bound (the likeliest to fit first): the first that
fits becomes the incumbent of the loop above; if none does, the smallest
simulated peak is returned, proven when the bound reaches it within
:data:`MIN_PEAK_WORK` (partitions x ops). Taken by cost, a budget that
nothing fits went through every partition whose bound it allows: on the
forecast registry's zoo_two_losses (21 ops) at 0.75 of the plain peak,
258,000 of them to the 30 s time limit before it was refused (and 34 s
on zoo_cond_chain, 20 ops), against 3 s each in bound order. The price:
a budget that only partitions beyond that work in bound order meet is
refused (with the smallest peak found, a budget that works), where the
search by cost could have found one before its time limit. On 991
budgets of random graphs of 6-12 ops that no plan of greedy's family
meets (30-95% of the plain peak), both searches gave the same answers:
990 refused with the same smallest peak, one plan.

References
----------
P. Jain et al. Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization. MLSys 2020. G. Codato, M. Fischetti. Combinatorial
Benders' cuts for mixed-integer linear programming. Oper. Res. 54(4), 2006.
"""

from __future__ import annotations

import heapq
import itertools
import time

from memsave.planners.greedy import family, greedy
from memsave.planners.segments import DEFAULT_TIME_LIMIT_S, Evaluation, Outcome, Segments

__all__ = ["milp", "DEFAULT_TIME_LIMIT_S", "MIN_PEAK_WORK"]

#: Where no plan fits the budget, the search for the smallest peak (what
#: :class:`~memsave.errors.MemoryBudgetError` reports) simulates partitions
#: beyond ``greedy``'s family, in order of their at-turn bound, while
#: partitions x ops stays within this; the smallest peak is proven only if
#: the bound reaches it first. The bound is loose where a peak is set late
#: in the step: on the forecast registry's zoo_cond_chain and
#: zoo_two_losses (``[1024, 256]`` activations), budgets 0.2-0.5 of the
#: plain peak simulated 330,000 to 480,000 partitions within the 30 s limit
#: without finding a peak below the family's, and each took 33 s to
#: refuse. A 7-op residual block is proven in 2,281 partitions.
MIN_PEAK_WORK = 500_000


class _Master:
    """The master problem: partitions of the segments, cheapest first."""

    def __init__(self, space: Segments, budget_bytes: float | None) -> None:
        bounds, steps = space.turn_bound, space.step_bounds
        self.space = space
        n = self.n = len(space.segments)
        m = len(space.candidates)
        self.by_time = budget_bytes is not None
        self.budget = float("inf") if budget_bytes is None else budget_bytes - bounds.resident
        self.resident = bounds.resident
        empty = [not seg for seg in space.segments]
        bit: dict[int, int] = {}

        def mask(ts) -> int:
            out = 0
            for t in ts:
                out |= 1 << bit.setdefault(t, len(bit))
            return out

        # Edges out of each position: (b, mode, nanoseconds, bytes mask, start
        # mask: the candidate before, counted when the segment before is not stored).
        self.edges: list[list[tuple]] = [[] for _ in range(n)]
        for a in range(n):
            self.edges[a].append((a + 1, "S", 0, mask(bounds.seg_reads[a]), 0))
            if a > 0:
                self.edges[a].append((a + 1, "S+", 0, mask(bounds.seg_reads[a]), 0))
            if empty[a]:
                continue
            start = 0
            if a > 0 and bounds.cand[a - 1] is not None and a in bounds.cand[a - 1][1]:
                start = mask([bounds.cand[a - 1][0]])
            first = steps.start[a - 1] if a > 0 and a in steps.readers[a - 1] else 0
            for b in range(a + 1, n + 1):
                if empty[b - 1]:
                    break
                last = steps.ys if b == n else 0
                self.edges[a].append((b, "R", space.group_lower_bound(a, b) + first + last, 0,
                                      start))
                if any(space.expensive_outputs[k] for k in range(a, b)):
                    inner = mask(e[0] for k in range(a, b) for e in bounds.inner[k]
                                 if e is not None and any(a <= r < b for r in e[1]))
                    self.edges[a].append((b, "E", space.group_lower_bound(a, b, True) + first
                                          + last, inner, start))
        self.weight = [0] * len(bit)
        for t, i in bit.items():
            self.weight[i] = bounds.counted[t]
        self.head = steps.head
        # Candidates a stored segment keeps (it reads them), and those kept by
        # ops never copied.
        self.kept_by = [[k for k in range(min(j, m)) if j in steps.keepers[k]] for j in range(n)]
        self.always = [k for k in range(m) if -1 in steps.keepers[k]]
        self.tie = itertools.count()
        # (key, tie, position, state (see _extend), groups)
        self.heap = [(0, next(self.tie), 0, (0, 0, 0, 0, 0), ())]

    def _extend(self, a: int, state: tuple, edge: tuple) -> tuple | None:
        """``state`` (nanoseconds, bytes, buffers, stored, charged) of a path
        to position ``a``, extended by ``edge``; None when the edge adds
        nothing to another (a cut kept before a stored segment that is
        stored itself)."""
        ns, used, have, stored, charged = state
        b, mode, cost, add, start = edge
        ns += cost
        if mode in ("S", "S+"):
            before_stored = a > 0 and stored >> (a - 1) & 1
            if mode == "S+" and before_stored:
                return None
            stored |= 1 << a
            heads = [*self.kept_by[a], *([a - 1] if mode == "S+" else [])]
        else:
            if start and not stored >> (a - 1) & 1:
                add |= start
            heads = [a - 1] if a > 0 and not stored >> (a - 1) & 1 else []
            heads += [k for k in self.always if a <= k < b]
        for k in heads:
            if not charged >> k & 1 and not stored >> k & 1:
                charged |= 1 << k
                ns += self.head[k]
        new = add & ~have
        while new:
            low = new & -new
            used += self.weight[low.bit_length() - 1]
            new ^= low
        return ns, used, have | add, stored, charged

    def bound(self, groups) -> tuple[int, int]:
        """The master's bounds on a partition's forecast nanoseconds and peak
        bytes (what tests/test_solvers.py checks against every decision)."""
        edge = {(a, e[0], e[1]): e for a, es in enumerate(self.edges) for e in es}
        state = (0, 0, 0, 0, 0)
        for a, b, mode in groups:
            # A run with no expensive outputs has no "E" edge: expensive-kept,
            # it is the same schedule as recomputed.
            state = self._extend(a, state, edge.get((a, b, mode)) or edge[(a, b, "R")])
        return state[0], self.resident + state[1]

    def next(self, deadline: float) -> tuple[str, tuple | None, float]:
        """("partition" | "exhausted" | "limit", its groups, its key: the
        cost bound, or bytes above resident when ordering by memory)."""
        heap, n = self.heap, self.n
        while heap:
            if time.perf_counter() > deadline:
                return "limit", None, heap[0][0]
            key, _, a, state, groups = heapq.heappop(heap)
            if a == n:
                return "partition", groups, key
            for edge in self.edges[a]:
                new = self._extend(a, state, edge)
                if new is None or new[1] > self.budget:
                    continue
                heapq.heappush(heap, (new[0] if self.by_time else new[1], next(self.tie),
                                      edge[0], new, groups + ((a, edge[0], edge[1]),)))
        return "exhausted", None, float("inf")



def milp(space: Segments, budget_bytes: int, *, time_limit_s: float | None = None) -> Outcome:
    """Least recompute seconds with forecast peak <= ``budget_bytes``, exactly (small graphs).

    See the module docstring. ``time_limit_s`` (default
    :data:`DEFAULT_TIME_LIMIT_S`) bounds the whole loop; past it the best
    plan found is returned with ``optimal=False`` and its ``gap``.
    """
    start = time.perf_counter()
    deadline = start + (DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s)
    seed = greedy(space, budget_bytes).evaluation
    best = seed
    if seed.peak_bytes > budget_bytes:
        best, exact_min = _min_peak(space, deadline, budget_bytes)
        if best.peak_bytes > budget_bytes:
            return Outcome(best, optimal=exact_min)
        # A partition that fits: the incumbent of the search by cost.
    master = _Master(space, budget_bytes)
    proven = False
    lower = -float("inf")
    while True:
        status, groups, key = master.next(deadline)
        lower = max(lower, key)
        if status == "exhausted" or key >= best.recompute_ns:
            proven = True
            break
        if status == "limit":
            break
        ev = space.evaluate(space.decision(groups))
        if ev.peak_bytes <= budget_bytes and ev.recompute_ns < best.recompute_ns:
            best = ev
    gap = 0.0 if proven else max(0.0, (best.recompute_ns - lower) / max(best.recompute_ns, 1))
    return Outcome(best, optimal=proven, gap=gap)


def _min_peak(space: Segments, deadline: float, budget_bytes: int) -> tuple[Evaluation, bool]:
    """Smallest simulated peak: partitions in order of their at-turn bound,
    beyond ``greedy``'s family, within :data:`MIN_PEAK_WORK`; the first
    partition whose peak fits ``budget_bytes`` as soon as one does.
    Returns it and whether it is proven the smallest."""
    master = _Master(space, None)
    best = min((space.evaluate(d) for d in family(space)), key=lambda e: e.peak_bytes)
    for _ in range(max(1, MIN_PEAK_WORK // max(1, len(space.fg.ops)))):
        status, groups, key = master.next(deadline)
        if status == "exhausted" or master.resident + key >= best.peak_bytes:
            return best, True
        if status == "limit":
            return best, False
        ev = space.evaluate(space.decision(groups))
        if ev.peak_bytes < best.peak_bytes:
            best = ev
            if best.peak_bytes <= budget_bytes:
                return best, False
    return best, False
