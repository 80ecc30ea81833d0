"""The budget solvers' decision space: segments between candidate cuts (no TensorFlow).

A :class:`Segments` space is a :class:`~memsave.problem.Problem` seen
through some *candidate cuts* (tensors a plan may keep, in topological
order): it turns a :class:`Decision` into a schedule and a forecast through
the problem's cached evaluator (``build_schedule`` + the one memory
model), so the solvers only choose decisions; they never estimate memory
themselves, and every solver is judged by the numbers the Plan prints.

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

Recompute cost is the FLOPs of the ops the schedule's ``recompute`` steps
copy (:meth:`memsave.costs.Costs.recompute_flops`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from memsave.costs import is_activation
from memsave.errors import ArgumentError
from memsave.problem import Problem
from memsave.schedule import Schedule

__all__ = ["Decision", "Evaluation", "Outcome", "Segments"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which candidates are kept and which segments are stored.

    Attributes
    ----------
    kept : frozenset of int
        Candidate positions ``0 .. m-1`` (indices into ``Segments.candidates``).
    stored : frozenset of int
        Segment positions ``0 .. m`` (indices into ``Segments.segments``).
    """

    kept: frozenset[int] = frozenset()
    stored: frozenset[int] = frozenset()

    @staticmethod
    def of(kept: Iterable[int] = (), stored: Iterable[int] = ()) -> Decision:
        return Decision(frozenset(kept), frozenset(stored))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A decision, its schedule and what the simulator forecasts for it."""

    decision: Decision
    checkpoints: tuple[int, ...]
    in_place: tuple[int, ...]
    schedule: Schedule | None
    peak_bytes: int
    recompute_cost: int


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A solver's answer: the evaluation it chose, and what it proved.

    ``optimal``: least recompute cost among the feasible decisions of the
    space (when none fits: proven smallest peak). ``gap``: relative
    optimality gap on recompute cost (0 when optimal, ``inf`` when unknown).
    """

    evaluation: Evaluation
    optimal: bool
    gap: float = float("inf")

    def __post_init__(self) -> None:
        if self.optimal and self.gap != 0.0:
            object.__setattr__(self, "gap", 0.0)


class Segments:
    """The decisions over ``candidates`` of ``problem``, and their cached evaluation.

    Parameters
    ----------
    problem : Problem
    candidates : sequence of int, optional
        Tensor ids a plan may keep; default: every keepable activation
        (:meth:`Problem.keepable`). Sorted by producer.
    """

    def __init__(self, problem: Problem, candidates: Sequence[int] | None = None) -> None:
        self.problem = problem
        fg = self.fg = problem.fg
        self.costs = problem.costs
        self.allocator = problem.model.allocator
        if candidates is None:
            candidates = problem.keepable()
        for t in candidates:
            if not is_activation(fg, t):
                raise ArgumentError(
                    f"memsave.planners.Segments: candidate {fg.tensors[t].name!r} is not an "
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
        op_flops = self.costs.op_flops
        self.segment_flops: tuple[int, ...] = tuple(sum(op_flops[o] for o in s) for s in self.segments)
        self._empty = frozenset(k for k, s in enumerate(self.segments) if not s)
        self._cache: dict[Decision, Evaluation] = {}
        self.plain = self.evaluate(Decision.of(stored=range(len(self.segments))))

    @property
    def evaluations(self) -> int:
        """Distinct decisions evaluated so far."""
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
        """Schedule, forecast peak and recompute cost of ``d`` (cached)."""
        d = self.canonical(d)
        hit = self._cache.get(d)
        if hit is not None:
            return hit
        problem = self.problem
        checkpoints = tuple(self.candidates[i] for i in sorted(d.kept))
        if len(d.stored) == len(self.segments):
            sched = None
            in_place: tuple[int, ...] = ()
        else:
            in_place = tuple(o for k in sorted(d.stored) for o in self.segments[k])
            sched = problem.schedule(checkpoints, in_place)
        ev = Evaluation(d, checkpoints, in_place, sched, problem.peak(sched),
                        problem.costs.recompute_flops(sched))
        self._cache[d] = ev
        return ev
