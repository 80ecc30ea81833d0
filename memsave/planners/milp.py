"""``milp``: exact on small graphs: a MILP over stored segments (HiGHS), lazily cut.

Formulation
-----------
A decision is the stored segments ``P`` and the kept candidates ``K`` (see
:mod:`memsave.solvers.space`). Recompute cost depends on ``P`` only: every
recomputable op outside ``P`` is recomputed at least once (it produces a
head, or feeds an op recomputed through an unkept tensor), and exactly once
unless a schedule shares it between steps. So the *master* MILP has one
binary ``s_j`` per segment and minimises ``sum_j F_j (1 - s_j)`` (a lower
bound on the true cost), subject to a relaxation of the memory budget that
holds for every ``K``: when the forward pass ends, every tensor a stored
op's gradient reads is alive, besides the resident bytes::

    resident + sum_t counted(t) z_t <= budget,   z_t >= s_j  (t read by segment j's gradients)

(``t`` resolved to the buffer it views). It never cuts off a plan the
simulator accepts.

The loop (lazy constraints, as in combinatorial Benders decomposition):
solve the master; for its ``P``, find the cheapest ``K`` whose *simulated*
peak fits, by enumerating the kept sets (skipping those whose own at-turn
bound already exceeds the budget); then add the no-good cut
``sum_{j in P} (1 - s_j) + sum_{j not in P} s_j >= 1`` that excludes exactly
that ``P``, and repeat until the master's bound reaches the best true cost
found (optimal, gap 0), the master is infeasible, or the time limit passes
(the best plan so far, ``optimal=False``, with its gap). The incumbent starts
as ``greedy``'s plan, so a time limit always returns a plan at least that
good. The kept sets are enumerated exactly up to :data:`MAX_EXACT_FREE_CUTS`
free candidates; beyond that ``greedy``'s kept sets are tried and the result
is not claimed optimal.

When nothing fits, the same loop minimises the at-turn bound and returns the
smallest simulated peak.

Needs highspy (``pip install 'memsave[milp]'``), imported on first use.

References
----------
P. Jain et al. Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization. MLSys 2020. G. Codato, M. Fischetti. Combinatorial
Benders' cuts for mixed-integer linear programming. Oper. Res. 54(4), 2006.
"""

from __future__ import annotations

import itertools
import time

from memsave.planners.greedy import family, greedy
from memsave.planners.segments import Decision, Evaluation, Outcome, Segments

__all__ = ["milp", "DEFAULT_TIME_LIMIT_S", "MAX_EXACT_FREE_CUTS"]

#: Time limit when the caller gives none.
DEFAULT_TIME_LIMIT_S = 30.0

#: Kept sets are enumerated exactly (``2**free`` at most, pruned by the
#: at-turn bound) when at most this many candidates are free to keep.
MAX_EXACT_FREE_CUTS = 12


def _highspy():
    try:
        import highspy
    except ImportError as e:
        raise ImportError(
            "memsave.solvers: solver='milp' needs HiGHS through highspy, which is not "
            "installed; install the extra with pip install 'memsave[milp]' (or pip install "
            "highspy), or use solver='dp' (chains) or 'greedy'"
        ) from e
    return highspy


class _Bounds:
    """The at-turn lower bound on the peak: buffers certainly alive when the
    forward pass ends, for stored segments and kept candidates."""

    def __init__(self, space: Segments) -> None:
        fg, costs, counted = space.fg, space.costs, space.allocator.counted

        def root(t: int) -> int:
            while costs.alias_of[t] is not None:
                t = costs.alias_of[t]
            return t

        self.counted = {}
        self.seg_reads: list[set[int]] = []
        for seg in space.segments:
            reads: set[int] = set()
            for o in seg:
                if not costs.gradient[o].has_gradient:
                    continue
                read_ins, read_outs = costs.gradient_reads[o]
                reads.update(root(t) for t in read_ins + read_outs
                             if fg.tensors[root(t)].kind == "internal")
            self.seg_reads.append(reads)
        seg_of = {o: j for j, seg in enumerate(space.segments) for o in seg}
        consumers = fg.consumers()
        # A kept candidate is read by the proxy of a step recomputing one of
        # its consumers; with every consumer stored, nothing need read it.
        self.cand: list[tuple[int, frozenset[int]] | None] = []
        for t in space.candidates:
            if any(not fg.ops[c].recomputable for c in consumers[t]):
                self.cand.append(None)
            else:
                self.cand.append((root(t), frozenset(seg_of[c] for c in consumers[t])))
        for t in {r for s in self.seg_reads for r in s} | {c[0] for c in self.cand if c}:
            self.counted[t] = counted(costs.tensor_bytes[t])
        self.resident = space.problem.extra_resident_bytes + sum(
            counted(costs.tensor_bytes[t.id]) for t in fg.tensors if t.kind != "internal")

    def alive(self, stored, kept=()) -> set[int]:
        out = set()
        for j in stored:
            out |= self.seg_reads[j]
        for k in kept:
            c = self.cand[k]
            if c is not None and not c[1] <= set(stored):
                out.add(c[0])
        return out

    def peak(self, stored, kept=()) -> int:
        return self.resident + sum(self.counted[t] for t in self.alive(stored, kept))


class _Master:
    """The MILP over stored segments, with no-good cuts added as it goes."""

    def __init__(self, space: Segments, bounds: _Bounds, budget_bytes: float | None) -> None:
        hs = _highspy()
        self.hs = hs
        h = hs.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 0.0)
        self.h = h
        inf = hs.kHighsInf
        n_seg = len(space.segments)
        self.n_seg = n_seg
        bufs = sorted({t for s in bounds.seg_reads for t in s})
        zcol = {t: n_seg + i for i, t in enumerate(bufs)}
        for _ in range(n_seg + len(bufs)):
            h.addVar(0.0, 1.0)
        for j, seg in enumerate(space.segments):
            h.changeColIntegrality(j, hs.HighsVarType.kInteger)
            if not seg:  # stored by convention (Segments.canonical)
                h.changeColBounds(j, 1.0, 1.0)
        for j, reads in enumerate(bounds.seg_reads):
            for t in sorted(reads):
                h.addRow(0.0, inf, 2, [zcol[t], j], [1.0, -1.0])  # z_t >= s_j
        self.offset = float(sum(space.segment_flops))
        self.mem = ([zcol[t] for t in bufs], [float(bounds.counted[t]) for t in bufs])
        if budget_bytes is None:  # minimise the at-turn bound
            for c, v in zip(*self.mem):
                h.changeColCost(c, v)
            self.offset = float(bounds.resident)
        else:
            for j in range(n_seg):
                h.changeColCost(j, -float(space.segment_flops[j]))
            h.addRow(-inf, float(budget_bytes - bounds.resident), len(bufs), *self.mem)

    def run(self, deadline: float) -> tuple[str, frozenset[int] | None, float]:
        """("optimal" | "infeasible" | "limit", stored set, lower bound)."""
        h = self.h
        left = deadline - time.perf_counter()
        if left <= 0:
            return "limit", None, -float("inf")
        h.setOptionValue("time_limit", max(left, 1e-3))
        h.run()
        status = h.getModelStatus()
        ms = self.hs.HighsModelStatus
        if status == ms.kInfeasible:
            return "infeasible", None, float("inf")
        if status != ms.kOptimal:
            return "limit", None, self.offset + h.getInfo().mip_dual_bound
        col = h.getSolution().col_value
        stored = frozenset(j for j in range(self.n_seg) if col[j] > 0.5)
        return "optimal", stored, self.offset + h.getInfo().objective_function_value

    def exclude(self, stored: frozenset[int]) -> None:
        ones = sorted(stored)
        zeros = [j for j in range(self.n_seg) if j not in stored]
        self.h.addRow(1.0 - len(ones), self.hs.kHighsInf, self.n_seg, ones + zeros,
                      [-1.0] * len(ones) + [1.0] * len(zeros))


def _kept_sets(space: Segments, stored: frozenset[int]):
    """Every kept set for ``stored`` (or greedy's, when too many); exact?"""
    free = [k for k in range(len(space.candidates)) if k not in stored]
    if len(free) <= MAX_EXACT_FREE_CUTS:
        # Sizes near sqrt(free) first: where a feasible kept set usually is.
        root = len(free) ** 0.5
        sizes = sorted(range(len(free) + 1), key=lambda r: (abs(r - root), r))
        sets = (c for r in sizes for c in itertools.combinations(free, r))
        return sets, True
    return (tuple(k for k in d.kept if k not in stored) for d in family(space)), False


def milp(space: Segments, budget_bytes: int, *, time_limit_s: float | None = None) -> Outcome:
    """Least recompute cost with forecast peak <= ``budget_bytes``, exactly (small graphs).

    See the module docstring. ``time_limit_s`` (default
    :data:`DEFAULT_TIME_LIMIT_S`) bounds the whole loop; past it the best
    plan found is returned with ``optimal=False`` and its ``gap``.
    """
    start = time.perf_counter()
    deadline = start + (DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s)
    bounds = _Bounds(space)
    seed = greedy(space, budget_bytes).evaluation
    best: Evaluation | None = seed if seed.peak_bytes <= budget_bytes else None
    master = _Master(space, bounds, budget_bytes)
    exact = True
    lower = -float("inf")
    proven = False
    while True:
        if best is not None and lower >= best.recompute_cost:
            proven = True
            break
        status, stored, lb = master.run(deadline)
        if status == "infeasible":
            proven = True
            break
        if status == "limit":
            lower = max(lower, lb)
            break
        lower = max(lower, lb)
        if best is not None and lower >= best.recompute_cost:
            proven = True
            break
        sets, complete = _kept_sets(space, stored)
        exact = exact and complete
        for kept in sets:
            if bounds.peak(stored, kept) > budget_bytes:
                continue
            ev = space.evaluate(Decision.of(kept, stored))
            if ev.peak_bytes <= budget_bytes and (best is None or ev.recompute_cost < best.recompute_cost):
                best = ev
            if best is not None and best.recompute_cost <= lb:
                break  # no kept set does better than this stored set's bound
            if time.perf_counter() > deadline:
                break
        master.exclude(stored)
        if time.perf_counter() > deadline:
            break
    optimal = proven and exact
    if best is not None:
        gap = 0.0 if optimal else (
            max(0.0, (best.recompute_cost - lower) / max(best.recompute_cost, 1))
            if lower > -float("inf") else float("inf"))
        return Outcome(best, optimal=optimal, gap=gap)
    ev, exact_min = _min_peak(space, bounds, deadline)
    return Outcome(ev, optimal=optimal and exact_min)


def _min_peak(space: Segments, bounds: _Bounds, deadline: float) -> tuple[Evaluation, bool]:
    """Smallest simulated peak: stored sets in order of their at-turn bound."""
    master = _Master(space, bounds, None)
    best = min((space.evaluate(d) for d in family(space)), key=lambda e: e.peak_bytes)
    exact = True
    while True:
        status, stored, lb = master.run(deadline)
        if status == "infeasible":
            return best, exact
        if status == "limit":
            return best, False
        if lb >= best.peak_bytes:
            return best, exact
        sets, complete = _kept_sets(space, stored)
        exact = exact and complete
        for kept in sets:
            if bounds.peak(stored, kept) >= best.peak_bytes:
                continue
            ev = space.evaluate(Decision.of(kept, stored))
            if ev.peak_bytes < best.peak_bytes:
                best = ev
        master.exclude(stored)
        if time.perf_counter() > deadline:
            return best, False
