"""The planning problem every solver reads, and the one result record they return.

A :class:`Problem` bundles the forward graph, its :class:`~memsave.costs.Costs`,
the *candidate cuts* (tensors a plan may keep, in topological order) and a
cached evaluator: :meth:`Problem.evaluate` turns a :class:`Decision` into a
:class:`~memsave.schedule.Schedule` (``build_schedule``) and forecasts it
with the one memory model, :func:`memsave.simulate.simulate`. Solvers only
choose decisions; they never estimate memory themselves, so every solver is
judged by the same numbers the Plan prints.

The decision space
------------------
The candidates ``c_1 .. c_m`` (ordered by producer) split the recomputable ops
into ``m + 1`` *segments* by topological position: segment ``k`` holds the
recomputable ops after ``c_k``'s producer up to ``c_{k+1}``'s (``c_0`` is the
start, ``c_{m+1}`` the end). A :class:`Decision` says which candidates are
kept as checkpoints and which segments are *stored*: differentiated in place
on the forward pass's own tensors (``backprop`` steps), so they cost no
recomputation and hold their activations until their gradient runs, as a
rotor "keep everything" segment does. Every other recomputable op is
recomputed once, in the step of the kept tensor (or y) it leads to.

Storing every segment is plain ``tf.gradients`` (no schedule): the decision
with no recomputation at all, whose peak is the baseline.

Recompute cost is the FLOPs (``Costs.op_flops``) of the ops the schedule's
``recompute`` steps copy, as the Plan counts it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence

from memsave.costs import Costs, is_activation
from memsave.graph import ForwardGraph
from memsave.schedule import Schedule, build_schedule
from memsave.simulate import CPU_ONEDNN, Allocator, forward_program, simulate

__all__ = ["Problem", "Decision", "Evaluation", "SolveResult", "coarsen"]


def coarsen(fg: ForwardGraph, costs: Costs, candidates: Sequence[int], max_cuts: int) -> tuple[int, ...]:
    """At most ``max_cuts`` of ``candidates``, spread evenly over the activation bytes.

    The bytes of the activations (outputs of recomputable ops) produced up
    to each candidate, in topological order, place it; the candidates
    closest to ``j * total / (max_cuts + 1)``, ``j = 1 .. max_cuts``, are
    kept, so each coarse segment holds about the same activation bytes
    (what Chen et al.'s sqrt(n) plan equalises). Any subset of cuts is a
    valid decision space; this one bounds the solvers' work on large graphs.
    ``O(n + m)``.
    """
    cands = sorted(dict.fromkeys(candidates), key=lambda t: (fg.tensors[t].producer, t))
    if len(cands) <= max_cuts:
        return tuple(cands)
    at_op = [0] * (len(fg.ops) + 1)
    total = 0
    for op in fg.ops:
        if op.recomputable:
            total += sum(costs.tensor_bytes[t] for t in op.outputs)
        at_op[op.index] = total
    pos = [at_op[fg.tensors[t].producer] for t in cands]
    chosen: list[int] = []
    lo = 0
    for j in range(1, max_cuts + 1):
        target = total * j / (max_cuts + 1)
        hi = len(cands) - (max_cuts - j)
        i = bisect.bisect_left(pos, target, lo, hi)
        if i >= hi or (i > lo and target - pos[i - 1] <= pos[i] - target):
            i -= 1
        i = max(i, lo)
        chosen.append(cands[i])
        lo = i + 1
    return tuple(chosen)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which candidates are kept and which segments are stored.

    Attributes
    ----------
    kept : frozenset of int
        Candidate positions ``0 .. m-1`` (indices into ``Problem.candidates``).
    stored : frozenset of int
        Segment positions ``0 .. m`` (indices into ``Problem.segments``).
    """

    kept: frozenset[int] = frozenset()
    stored: frozenset[int] = frozenset()

    @staticmethod
    def of(kept: Iterable[int] = (), stored: Iterable[int] = ()) -> Decision:
        return Decision(frozenset(kept), frozenset(stored))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What the simulator forecasts for one decision."""

    decision: Decision
    checkpoints: tuple[int, ...]
    in_place: tuple[int, ...]
    schedule: Schedule | None
    peak_bytes: int
    recompute_cost: int


@dataclasses.dataclass(frozen=True)
class SolveResult:
    """One solver's answer (every solver returns this record).

    Attributes
    ----------
    solver : str
        Registered name of the solver that produced it.
    budget_bytes : int
        The budget it was asked to meet (forecast peak bytes).
    feasible : bool
        Whether ``predicted_peak_bytes <= budget_bytes``. When False, the decision is
        the smallest-peak one the solver found, and ``predicted_peak_bytes`` is
        what a caller reports as the smallest achievable peak.
    optimal : bool
        Proven optimal: least recompute cost among feasible decisions (or,
        when infeasible, proven smallest peak) over the problem's decision
        space.
    checkpoints : tuple of int
        Tensor ids kept as checkpoints (topological order).
    in_place : tuple of int
        Op indices differentiated in place (stored segments).
    predicted_peak_bytes : int
        Simulator forecast of the plan's peak.
    recompute_cost : int
        FLOPs the plan recomputes.
    solve_time_s : float
        Wall time of the solve, evaluations included.
    gap : float
        Relative optimality gap on recompute cost (0 when proven optimal,
        ``inf`` when unknown).
    evaluations : int
        Distinct decisions simulated.
    schedule : Schedule or None
        The plan's schedule (None: plain tf.gradients).
    decision : Decision or None
        The decision in the problem's terms.
    """

    solver: str
    budget_bytes: int
    feasible: bool
    optimal: bool
    checkpoints: tuple[int, ...]
    in_place: tuple[int, ...]
    predicted_peak_bytes: int
    recompute_cost: int
    solve_time_s: float
    gap: float
    evaluations: int = 0
    schedule: Schedule | None = dataclasses.field(default=None, repr=False, compare=False)
    decision: Decision | None = dataclasses.field(default=None, repr=False, compare=False)


class Problem:
    """A forward graph, its costs, candidate cuts and a cached evaluator.

    Parameters
    ----------
    fg : ForwardGraph
    costs : Costs
    candidates : sequence of int, optional
        Tensor ids a plan may keep; default: every activation (see
        :func:`memsave.costs.is_activation`) that is not a y and has a
        nonzero size. Sorted by producer.
    allocator : Allocator
        The allocator the forecast models.
    shared : Problem, optional
        A problem on the same graph, costs and allocator (other candidates):
        this one reuses its forward program and its simulations (a schedule
        both reach is simulated once).
    """

    def __init__(
        self,
        fg: ForwardGraph,
        costs: Costs,
        candidates: Sequence[int] | None = None,
        *,
        allocator: Allocator = CPU_ONEDNN,
        shared: Problem | None = None,
    ) -> None:
        self.fg = fg
        self.costs = costs
        self.allocator = allocator
        if candidates is None:
            candidates = self.default_candidates(fg)
        for t in candidates:
            if not is_activation(fg, t):
                raise ValueError(
                    f"memsave.solvers.Problem: candidate {fg.tensors[t].name!r} is not an "
                    "activation (internal, differentiable, from a recomputable op)"
                )
        self.candidates: tuple[int, ...] = tuple(
            sorted(dict.fromkeys(candidates), key=lambda t: (fg.tensors[t].producer, t)))
        bounds = [fg.tensors[t].producer for t in self.candidates]
        segs: list[list[int]] = [[] for _ in range(len(bounds) + 1)]
        k = 0
        for op in fg.ops:
            while k < len(bounds) and op.index > bounds[k]:
                k += 1
            if op.recomputable:
                segs[k].append(op.index)
        self.segments: tuple[tuple[int, ...], ...] = tuple(tuple(s) for s in segs)
        self.segment_flops: tuple[int, ...] = tuple(
            sum(costs.op_flops[o] for o in s) for s in self.segments)
        self._empty = frozenset(k for k, s in enumerate(self.segments) if not s)
        self._cache: dict[Decision, Evaluation] = {}
        if shared is not None:
            if shared.fg is not fg or shared.costs is not costs or shared.allocator != allocator:
                raise ValueError("memsave.solvers.Problem: shared= is a problem on another "
                                 "graph, costs or allocator")
            self.forward = shared.forward
            self._peaks = shared._peaks
        else:
            self.forward = forward_program(fg, costs, self.allocator)  # shared by every simulation
            # Forecast peak by schedule steps (all the simulator reads of a
            # schedule; None: plain tf.gradients): decisions that reach the
            # same schedule are simulated once.
            self._peaks: dict[tuple | None, int] = {}
        self.plain = self.evaluate(Decision.of(stored=range(len(self.segments))))

    @staticmethod
    def default_candidates(fg: ForwardGraph) -> list[int]:
        """Every activation that is not a y and has a nonzero size."""
        ys = set(fg.ys)
        return [t.id for t in fg.internal_tensors()
                if is_activation(fg, t.id) and t.size_bytes > 0 and t.id not in ys]

    # -- the evaluator -------------------------------------------------------

    @property
    def evaluations(self) -> int:
        """Distinct decisions simulated so far."""
        return len(self._cache)

    def canonical(self, d: Decision) -> Decision:
        """``d`` with empty segments stored (they hold nothing either way) and no
        candidate kept whose producer is stored (kept anyway)."""
        stored = d.stored | self._empty
        kept = frozenset(k for k in d.kept if k not in stored)
        if stored == d.stored and kept == d.kept:
            return d
        return Decision(kept, stored)

    def recompute_cost(self, d: Decision) -> int:
        """FLOPs ``d`` recomputes, without simulating: every recomputable op of a
        segment not stored is copied exactly once (``build_schedule`` keeps a
        frontier wherever two heads would share an op), so the cost is the
        sum of those segments' FLOPs; equal to ``evaluate(d).recompute_cost``
        (tests/test_solvers.py checks it on every decision of its cases)."""
        d = self.canonical(d)
        if len(d.stored) == len(self.segments):
            return 0
        return sum(f for k, f in enumerate(self.segment_flops) if k not in d.stored)

    def evaluate(self, d: Decision) -> Evaluation:
        """Forecast peak and recompute cost of ``d`` (cached)."""
        d = self.canonical(d)
        hit = self._cache.get(d)
        if hit is not None:
            return hit
        fg = self.fg
        checkpoints = tuple(self.candidates[i] for i in sorted(d.kept))
        if len(d.stored) == len(self.segments):
            sched = None
            in_place: tuple[int, ...] = ()
            cost = 0
        else:
            in_place = tuple(o for k in sorted(d.stored) for o in self.segments[k])
            sched = build_schedule(fg, checkpoints, in_place=in_place)
            cost = sum(self.costs.op_flops[o] for s in sched.steps if s.kind == "recompute"
                       for o in s.ops)
        key = None if sched is None else sched.steps
        peak = self._peaks.get(key)
        if peak is None:
            peak = simulate(fg, sched, self.costs, allocator=self.allocator, timeline=False,
                            forward=self.forward).peak_bytes
            self._peaks[key] = peak
        ev = Evaluation(d, checkpoints, in_place, sched, peak, cost)
        self._cache[d] = ev
        return ev

    def result(self, solver: str, budget_bytes: int, ev: Evaluation, *, optimal: bool,
               solve_time_s: float, gap: float | None = None) -> SolveResult:
        """The :class:`SolveResult` of evaluation ``ev``."""
        if gap is None:
            gap = 0.0 if optimal else float("inf")
        return SolveResult(
            solver=solver, budget_bytes=int(budget_bytes), feasible=ev.peak_bytes <= budget_bytes,
            optimal=optimal, checkpoints=ev.checkpoints, in_place=ev.in_place,
            predicted_peak_bytes=ev.peak_bytes, recompute_cost=ev.recompute_cost,
            solve_time_s=solve_time_s, gap=gap, evaluations=self.evaluations,
            schedule=ev.schedule, decision=ev.decision,
        )
