"""The budget solvers' decision space: segments between candidate cuts (no TensorFlow).

A :class:`Segments` space is a :class:`~memsave.problem.Problem` seen
through some *candidate cuts* (tensors a plan may keep, in topological
order): it turns a :class:`Decision` into a schedule and a forecast through
the problem's cached evaluator (``build_schedule``, the one memory model,
the time model), so the solvers only choose decisions; they never estimate
memory or time themselves, and every solver is judged by the numbers the
Plan prints.

The decision space
------------------
The candidates ``c_1 .. c_m`` (ordered by producer) split the recomputable ops
into ``m + 1`` *segments* by topological position: segment ``k`` holds the
recomputable ops after ``c_k``'s producer up to ``c_{k+1}``'s (``c_0`` is the
start, ``c_{m+1}`` the end). A :class:`Decision` says which candidates are
kept as checkpoints, and what each segment does:

* **recomputed** (the default): every recomputable op is recomputed once,
  in the step of the kept tensor (or y) it leads to;
* **stored**: differentiated in place on the forward pass's own tensors
  (``backprop`` steps), so it costs no recomputation and holds its
  activations until its gradient runs, as a rotor "keep everything"
  segment does;
* **expensive kept**: recomputed, but keeping its *expensive outputs*
  (:attr:`Segments.expensive_outputs`: the tensors whose recomputation
  costs the most seconds per byte kept, a convolution's or a matrix
  product's output), so that recomputation starts from them and redoes
  only the cheap ops in between (the batch norms and activations after a
  convolution). Every segment expensive-kept is the plan ``'speed'`` used
  to make for the whole graph; here it is a choice per segment (the
  candidate between a recomputed and an expensive-kept segment is kept, so
  that each recomputes from its own kept tensors).

So the space covers ``'memory'``'s plans (few kept, all recomputed), the
all-expensive plan, plain ``tf.gradients`` (every segment stored: no
schedule) and everything between, segment by segment.

Cost
----
A decision's cost is the forecast seconds its schedule adds to plain
backprop: the copies that run in its recompute steps and the rewrite's
gates (:func:`memsave.timemodel.step_seconds`, under the problem's device
profile), kept as integer nanoseconds (:meth:`Problem.step_nanoseconds`) so
that sums over steps are exact. The FLOPs of the copies made
(:meth:`memsave.costs.Costs.recompute_flops`) are reported too, but they
call a memory-bound batch norm free and do not see that a copy of a kept
convolution never runs, so the solvers do not minimise them.

The lower bounds the solvers prune with (:class:`TurnBound` on the peak
without a schedule, :meth:`Segments.peak_floor` with one,
:class:`StepBounds` on the gates' seconds, with the longest chain of a
decision's heads) are here too, which makes the
module some 750 lines: they read the space's private tables (which ops
are never copied, which segment holds an op) and are exact only as long
as those tables are, so they change with the space, not apart from it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

from memsave import xla
from memsave.costs import is_activation
from memsave.errors import ArgumentError
from memsave.memory_model import MemoryModel
from memsave.problem import Problem
from memsave.schedule import Schedule
from memsave.timemodel import head_gate_seconds, step_gate_seconds

__all__ = ["Decision", "Evaluation", "Outcome", "Segments", "StepBounds", "TurnBound",
           "EXPENSIVE_FACTOR", "DEFAULT_TIME_LIMIT_S"]

#: Time limit of the exact solvers (``dp``, ``milp``) when the caller gives
#: none (``strategy_options={'time_limit_s': ...}`` sets it): past it each
#: returns a plan it has, with ``optimal=False``.
DEFAULT_TIME_LIMIT_S = 30.0

#: A tensor is one of its segment's *expensive outputs* when keeping it saves
#: at least this many times the graph's average recompute seconds per byte
#: (all recomputable ops' forecast seconds over all keepable activation
#: bytes): keeping it is a better use of memory than keeping the average
#: tensor. Keeping a tensor saves its producer's copy only when the
#: producer's gradient does not read its own outputs (a convolution's or a
#: product's gradient reads its inputs; a ReLU's reads its output, so keeping
#: a ReLU output saves nothing). On the study's ResNet-110 (batch 32, default
#: profile) convolution outputs score 1.4x (16 channels) to 5x (64) the
#: average, additions 0.25x; on the MLP a MatMul output 1.5x. Override with
#: ``Segments(..., expensive_factor=)``.
EXPENSIVE_FACTOR = 1.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which candidates are kept and what each segment does.

    Attributes
    ----------
    kept : frozenset of int
        Candidate positions ``0 .. m-1`` (indices into ``Segments.candidates``).
    stored : frozenset of int
        Segment positions ``0 .. m`` (indices into ``Segments.segments``)
        differentiated in place.
    expensive : frozenset of int
        Segment positions recomputed from their expensive outputs (kept,
        with the candidates at both ends of the segment).
    """

    kept: frozenset[int] = frozenset()
    stored: frozenset[int] = frozenset()
    expensive: frozenset[int] = frozenset()

    @staticmethod
    def of(kept: Iterable[int] = (), stored: Iterable[int] = (),
           expensive: Iterable[int] = ()) -> Decision:
        return Decision(frozenset(kept), frozenset(stored), frozenset(expensive))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A decision, its schedule and what the memory and time models forecast for it.

    ``recompute_ns``: forecast nanoseconds the schedule adds to plain
    backprop (the solvers' cost); ``recompute_cost``: FLOPs of the copies it
    makes.
    """

    decision: Decision
    checkpoints: tuple[int, ...]
    in_place: tuple[int, ...]
    schedule: Schedule | None
    peak_bytes: int
    recompute_cost: int
    recompute_ns: int

    @property
    def recompute_seconds(self) -> float:
        return self.recompute_ns * 1e-9


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A solver's answer: the evaluation it chose, and what it proved.

    ``optimal``: least recompute seconds among the feasible decisions of the
    space (when none fits: proven smallest peak). ``gap``: relative
    optimality gap on recompute seconds (0 when optimal, ``inf`` when unknown).
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
    model : MemoryModel, optional
        The memory model peaks are forecast under: the problem's (the
        device's) by default; ``'memory'`` compares plans counting every
        byte (:attr:`Problem.judge`).
    expensive_factor : float
        See :data:`EXPENSIVE_FACTOR`.
    """

    def __init__(self, problem: Problem, candidates: Sequence[int] | None = None, *,
                 model: MemoryModel | None = None,
                 expensive_factor: float = EXPENSIVE_FACTOR) -> None:
        self.problem = problem
        fg = self.fg = problem.fg
        self.costs = problem.costs
        self.model = problem.model if model is None else model
        self.allocator = self.model.allocator
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
        #: Each candidate's index in :attr:`candidates`.
        self.candidate_index: dict[int, int] = {t: k for k, t in enumerate(self.candidates)}
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
        self.expensive_outputs: tuple[tuple[int, ...], ...] = self._expensive(expensive_factor)
        seg_of = {o: k for k, seg in enumerate(self.segments) for o in seg}
        consumers = fg.consumers()
        self._readers: tuple[frozenset[int], ...] = tuple(
            frozenset(seg_of[c] for c in consumers[t] if c in seg_of) for t in self.candidates)
        self._empty = frozenset(k for k, s in enumerate(self.segments) if not s)
        self._cache: dict[Decision, Evaluation] = {}
        self._floors: dict[Decision, int] = {}  # peak_floor's
        self._lower_cache: dict[tuple[int, bool], int] = {}
        self._seg_of_op = {o: k for k, seg in enumerate(self.segments) for o in seg}
        # For group_lower_bound: per tensor, the last segment reading it (beyond
        # the last segment when an op outside every segment reads it), the
        # tensors kept whatever the decision, and the ops never copied.
        self._group_cache: dict[tuple[int, int, bool], int] = {}
        self._ys = frozenset(fg.ys)
        # What a schedule may keep beyond a decision's checkpoints where two
        # heads' walks meet (memsave.schedule's shared frontier): a y, an
        # output of an op with several, or a tensor several ops read. The
        # bounds count them kept: a kept tensor's copies are saved, and its
        # gated read costs a kernel launch (memsave.gates.select).
        self._may_share = self._ys | {
            t for t, node in enumerate(fg.tensors) if len(consumers[t]) > 1
            or (node.producer is not None and len(fg.ops[node.producer].outputs) > 1)}
        self._stuck = xla.in_place_ops(fg)
        outside = len(self.segments)
        self._last_reader = {}
        for op in fg.ops:
            k = self._seg_of_op.get(op.index, outside)
            if op.index in self._stuck:
                k = outside
            for t in op.inputs:
                if k > self._last_reader.get(t, -1):
                    self._last_reader[t] = k
        self._forced_kept = fg.captured() | {
            t for i in self._stuck for t in (*fg.ops[i].inputs, *fg.ops[i].outputs)}
        profile = problem.profile
        self._head_ns = {  # less a nanosecond for the rounding of each step's time
            t: max(0, math.floor(1e9 * head_gate_seconds(fg, self.costs, t, profile)) - 1)
            for t in {*self.candidates, *(t for ts in self.expensive_outputs for t in ts)}
            if fg.receives_gradient(t)}
        self.plain = self.evaluate(Decision.of(stored=range(len(self.segments))))

    def _expensive(self, factor: float) -> tuple[tuple[int, ...], ...]:
        """Per segment, its keepable tensors that save at least ``factor``
        times the average recompute seconds per byte when kept."""
        fg, costs, problem = self.fg, self.costs, self.problem
        recompute = problem.seconds.recompute
        keepable = problem.keepable()
        total_bytes = sum(costs.tensor_bytes[t] for t in keepable)
        total_s = sum(recompute[op.index] for op in fg.ops if op.recomputable)
        if not total_bytes or not total_s:
            return tuple(() for _ in self.segments)
        threshold = factor * total_s / total_bytes
        seg_of = {o: k for k, seg in enumerate(self.segments) for o in seg}
        out: list[list[int]] = [[] for _ in self.segments]
        for t in keepable:
            p = fg.tensors[t].producer
            size = costs.tensor_bytes[t]
            if p not in seg_of or not size:
                continue
            if problem.copies_that_run((p,)):
                continue  # its gradient reads its own outputs: its copy runs anyway
            if recompute[p] / size >= threshold:
                out[seg_of[p]].append(t)
        return tuple(tuple(ts) for ts in out)

    @functools.cached_property
    def turn_bound(self) -> TurnBound:
        """The at-turn lower bound on a decision's peak (:class:`TurnBound`)."""
        return TurnBound(self)

    @property
    def evaluations(self) -> int:
        """Distinct decisions evaluated so far."""
        return len(self._cache)

    def canonical(self, d: Decision) -> Decision:
        """``d`` with empty segments stored (they hold nothing either way), no
        segment both stored and expensive-kept (stored wins), the candidate
        between a recomputed and an expensive-kept segment kept, and no
        candidate kept whose producer is stored (kept anyway).

        So every canonical decision is a partition of the segments into
        groups, each stored, recomputed or expensive-kept, with the candidate
        at the start of each group kept (or stored): what ``dp`` searches.
        """
        stored = d.stored | self._empty
        expensive = d.expensive - stored
        kept = set(d.kept)
        m = len(self.candidates)
        for e in expensive:  # candidate k ends segment k: k = e - 1 and k = e
            for k in (e - 1, e):
                if 0 <= k < m and k not in stored and k + 1 not in stored \
                        and (k in expensive) != (k + 1 in expensive):
                    kept.add(k)
        kept = frozenset(k for k in kept if k not in stored)
        if stored == d.stored and kept == d.kept and expensive == d.expensive:
            return d
        return Decision(kept, stored, expensive)

    def checkpoints(self, d: Decision) -> tuple[int, ...]:
        """The tensor ids a canonical decision ``d`` keeps (topological order):
        its kept candidates, the expensive outputs of its expensive-kept
        segments, and the candidates produced by a segment not stored that a
        stored one reads (kept anyway, as the stored ops' inputs: listed so
        that the Plan names where the recomputation before a stored segment
        ends)."""
        ids = [self.candidates[i] for i in d.kept]
        ids += [t for k in d.expensive for t in self.expensive_outputs[k]]
        if d.stored:
            ids += [t for k, t in enumerate(self.candidates)
                    if k not in d.stored and self._readers[k] & d.stored]
        return tuple(sorted(set(ids)))

    def _schedule(self, d: Decision) -> tuple[tuple[int, ...], tuple[int, ...], Schedule | None]:
        if len(d.stored) == len(self.segments):
            return (), (), None
        checkpoints = self.checkpoints(d)
        in_place = tuple(o for k in sorted(d.stored) for o in self.segments[k])
        return checkpoints, in_place, self.problem.schedule(checkpoints, in_place)

    def schedule(self, d: Decision) -> Schedule | None:
        """The schedule of ``d`` (None: every segment stored, plain backprop),
        without simulating it (built once, cached by the problem)."""
        return self._schedule(self.canonical(d))[2]

    def cost(self, d: Decision) -> int:
        """Forecast nanoseconds ``d`` adds to plain backprop, without simulating
        its memory: equal to ``evaluate(d).recompute_ns``."""
        return self.problem.recompute_nanoseconds(self.schedule(d))

    def evaluate(self, d: Decision) -> Evaluation:
        """Schedule, forecast peak, recompute seconds and FLOPs of ``d`` (cached)."""
        d = self.canonical(d)
        hit = self._cache.get(d)
        if hit is not None:
            return hit
        problem = self.problem
        checkpoints, in_place, sched = self._schedule(d)
        ev = Evaluation(d, checkpoints, in_place, sched, problem.peak(sched, model=self.model),
                        problem.costs.recompute_flops(sched), problem.recompute_nanoseconds(sched))
        self._cache[d] = ev
        return ev

    def peak_floor(self, d: Decision) -> int:
        """A lower bound on ``evaluate(d).peak_bytes`` from ``d``'s schedule
        without simulating it (:meth:`Problem.peak_floor`, cached): tighter
        than :attr:`turn_bound`, which needs no schedule, where the schedule
        keeps tensors that cross the cuts (a DAG with skips), the seeds are
        large, or the peak is reached once a step's recomputation has run.
        tests/test_solvers.py checks it on every decision of its cases."""
        d = self.canonical(d)
        found = self._floors.get(d)
        if found is None:
            found = self._floors[d] = self.problem.peak_floor(self.schedule(d), model=self.model)
        return found

    def segment_nanoseconds(self, k: int, *, expensive: bool = False) -> int:
        """An estimate, without a schedule, of the nanoseconds recomputing
        segment ``k`` alone takes (the candidates at its ends kept; with
        ``expensive``, its expensive outputs too): the forecast seconds of
        the copies that would run. The greedy family's knapsack weighs
        segments with it; the solvers' costs are always the schedule's
        (:meth:`cost`)."""
        return round(1e9 * self._segment_seconds(k, expensive))

    def lower_bound(self, d: Decision, *, steps: bool = True) -> int:
        """A lower bound on :meth:`cost` without a schedule: per segment not
        stored, the copies that run with every candidate kept (and, for an
        expensive-kept segment, its expensive outputs, and what a schedule
        may keep where two heads' walks meet), the most a decision keeps
        inside one segment; each op is copied at most once, and gates
        cost more, never less. Less a nanosecond per op, for the rounding of
        each step's time. tests/test_solvers.py checks it on every decision
        of its cases; ``greedy`` builds schedules only for the plans whose
        bound is below the answer's cost. ``steps=False`` leaves out the
        steps' fixed part (a looser bound: the order ``greedy`` takes on
        graphs too large to cost every plan, whose answers it sets)."""
        d = self.canonical(d)
        if len(d.stored) == len(self.segments):
            return 0
        # Every segment recomputed, less the stored ones, plus what keeping
        # the expensive outputs changes (a canonical decision stores none of them).
        lower = self._lower
        ns = self._lower_total - sum(lower(k, False) for k in d.stored) + sum(
            lower(k, True) - lower(k, False) for k in d.expensive)
        # Every kept tensor that a recomputed op produces and that receives a
        # gradient heads a recompute step: its gate is read and written. Each
        # step pays a fixed part too: counted once per head of the longest
        # chain of heads (StepBounds.chain_ns), or, if more, once per
        # candidate that every other one precedes or follows, which heads a
        # step of its own (StepBounds.head); and for the step of the ys when
        # the last segment is recomputed.
        fixed = self.step_bounds if steps else None
        checkpoints = self.checkpoints(d)
        heads = [t for t in checkpoints if t in self._head_ns and self._seg_of_op.get(
            self.fg.tensors[t].producer, -1) not in d.stored]
        ns += sum(self._head_ns[t] for t in heads)
        if fixed is not None:
            own = [(self.candidate_index.get(t), self._head_ns[t]) for t in heads]
            ns += max(fixed.chain_ns(heads),
                      sum(max(0, fixed.head[k] - h) for k, h in own if k is not None))
            if len(self.segments) - 1 not in d.stored and not self._ys.intersection(checkpoints):
                ns += fixed.ys
        return ns

    @functools.cached_property
    def _lower_total(self) -> int:
        return sum(self._lower(k, False) for k in range(len(self.segments)))

    def _lower(self, k: int, expensive: bool) -> int:
        key = (k, expensive)
        found = self._lower_cache.get(key)
        if found is None:
            found = self._lower_cache[key] = max(0, math.floor(
                1e9 * self._segment_seconds(k, expensive, self._may_share))
                - len(self.segments[k]))
        return found

    def groups(self, d: Decision) -> list[tuple[int, int, str]]:
        """The canonical ``d`` as a partition of the segments into groups
        ``(a, b, mode)`` (segments ``a .. b-1``; mode ``"S"`` stored, one
        segment per group, ``"S+"`` the same with the candidate before it
        kept; ``"E"`` expensive-kept; ``"R"`` recomputed): a new recomputed
        or expensive-kept group starts where the mode changes or at a kept
        candidate. :meth:`decision` is its inverse. What
        :mod:`memsave.planners.milp` chooses among."""
        d = self.canonical(d)
        out: list[tuple[int, int, str]] = []
        for j in range(len(self.segments)):
            if j in d.stored:
                out.append((j, j + 1, "S+" if j - 1 in d.kept else "S"))
                continue
            mode = "E" if j in d.expensive else "R"
            if out and out[-1][2] == mode and (j - 1) not in d.kept:
                a, _, _ = out.pop()
                out.append((a, j + 1, mode))
            else:
                out.append((j, j + 1, mode))
        return out

    @staticmethod
    def decision(groups: Iterable[tuple[int, int, str]]) -> Decision:
        """The decision a partition into groups is (see :meth:`groups`): the
        candidate before each group kept, but before a plain ``"S"`` one."""
        kept, stored, expensive = set(), set(), set()
        for a, b, mode in groups:
            if a > 0 and mode != "S":
                kept.add(a - 1)
            if mode in ("S", "S+"):
                stored.update(range(a, b))
            elif mode == "E":
                expensive.update(range(a, b))
        return Decision.of(kept, stored, expensive)

    def group_lower_bound(self, a: int, b: int, expensive: bool = False) -> int:
        """A lower bound on the nanoseconds the copies of segments ``a .. b-1``
        take in any decision that recomputes them as one group (candidates
        ``a .. b-2`` not kept; with ``expensive``, the group's expensive
        outputs kept), without a schedule (cached).

        The copies that run with every tensor kept that such a decision may
        keep: the other candidates, the expensive outputs, what a schedule
        may keep where two heads' walks meet, and what ops outside the group
        read or a custom gradient captured (a stored or
        non-recomputable reader keeps it); each op is copied at most once, so
        the bounds of a decision's groups add up (:meth:`groups`). Less a
        nanosecond per op for the rounding of each step's time. ``milp``'s
        master minimises their sum, and tests/test_solvers.py checks the sum
        against every decision of its cases.
        """
        key = (a, b, expensive)
        found = self._group_cache.get(key)
        if found is not None:
            return found
        ops = [o for k in range(a, b) for o in self.segments[k] if o not in self._stuck]
        interior = {self.candidates[k] for k in range(a, b - 1)}
        extra = {t for k in range(a, b) for t in self.expensive_outputs[k]} if expensive else set()
        last_reader, forced, cands = self._last_reader, self._forced_kept, self.candidate_index
        shared = self._may_share

        def kept(t: int) -> bool:
            return (t in extra or t in forced or t in shared or last_reader.get(t, b) >= b
                    or (t in cands and t not in interior))

        run = self._running_copies(ops, kept)
        found = self._group_cache[key] = max(
            0, math.floor(1e9 * self.problem.seconds.recompute_s(run)) - len(ops))
        return found

    @functools.cached_property
    def step_bounds(self) -> StepBounds:
        """Lower bounds on the gates' nanoseconds (:class:`StepBounds`)."""
        return StepBounds(self)

    def _segment_seconds(self, k: int, expensive: bool, also: frozenset[int] = frozenset()) -> float:
        keep = set(self.candidates) | also
        if expensive:
            keep.update(self.expensive_outputs[k])
        return self.problem.seconds.recompute_s(
            self._running_copies(self.segments[k], keep.__contains__))

    def _running_copies(self, ops: Sequence[int], kept) -> list[int]:
        """The copies of ``ops`` that run when they are recomputed with the
        tensors ``kept(t)`` read from the forward pass: those a gradient of
        ``ops`` reads (a kept input is read from the original; an op's own
        outputs, from its copy), what they are computed from, and those that
        run whatever is read (:meth:`Problem.copies_that_run`)."""
        fg, reads, runs_anyway = self.fg, self.costs.gradient_reads, self.problem.copies_that_run
        need: set[int] = set()
        for i in ops:
            read_ins, read_outs = reads[i]
            need.update(t for t in read_ins if not kept(t))
            need.update(read_outs)
        run = []
        for i in reversed(ops):
            op = fg.ops[i]
            if any(t in need for t in op.outputs) or runs_anyway((i,)):
                run.append(i)
                need.update(t for t in op.inputs if not kept(t))
        return run


class StepBounds:
    """Lower bounds on what a decision's recompute steps add beyond their
    copies (the rewrite's gates, :func:`memsave.timemodel.step_seconds`), by
    what its groups (:meth:`Segments.groups`) certainly make; in integer
    nanoseconds, each less one for rounding. Zero throughout unless every
    candidate and y is floating (a step's gates are paid only when it has
    a floating head).

    ``head[k]``: candidate ``k`` is kept (a recomputed or expensive-kept
    group starts after it, or a stored segment of ``keepers[k]`` reads it;
    -1: an op that is never copied does) and segment ``k`` is not stored:
    ``k`` heads a recompute step, which reads it through the gate
    (:func:`memsave.timemodel.head_gate_seconds`) and, when every other
    candidate is its ancestor or descendant (so no other candidate's step
    is the same step: a step is one layer of the heads' dependencies),
    launches the gates' kernels. ``start[k]``: such a group's first segment
    reads ``k`` (an op of segment ``readers[k]`` reads it) through a gated
    proxy. ``ys``: the last segment is
    recomputed: the step of the ys.

    :meth:`chain_ns`, for any decision's heads: the fixed part of as many
    steps as the longest chain among them, each head reached from the one
    before through tensors that receive gradients. On a DAG with skips few
    candidates precede or follow every other: on
    experiments/bench_planner.py's 1000-op DAG the chain took the bound from
    a median 0.54 to 0.61 of the cost over the plans greedy costs for
    ``'memory'``, and its planning built 94 schedules instead of 115 (194
    instead of 232 at 0.9 of the plain peak; bench_planner counts them).
    Most of the steps left out are headed by what the schedule keeps where
    two heads' walks meet, which no decision names.
    """

    def __init__(self, space: Segments) -> None:
        fg, costs, profile = space.fg, space.costs, space.problem.profile
        cands = space.candidates
        m = len(cands)
        self.head = [0] * m
        self.start = [0] * m
        self.ys = 0
        self.readers: list[frozenset[int]] = [frozenset()] * m
        self.keepers: list[frozenset[int]] = [frozenset()] * m
        fixed = step_gate_seconds(profile)

        def ns(seconds: float) -> int:
            return max(0, math.floor(1e9 * seconds) - 1)

        self._fixed_ns = ns(fixed)
        self._chain_nodes, self._above = self._ancestry(space)
        if not all(head_gate_seconds(fg, costs, t, profile) > 0 for t in (*cands, *fg.ys)):
            return

        # Candidates each candidate reaches (bit j: candidate j), by a reverse sweep.
        bit = {t: 1 << j for j, t in enumerate(cands)}
        consumers = fg.consumers()
        below = [0] * len(fg.ops)
        for op in reversed(fg.ops):
            reach = 0
            for t in op.outputs:
                reach |= bit.get(t, 0)
                for c in consumers[t]:
                    reach |= below[c]
            below[op.index] = reach
        after = []
        for t in cands:
            reach = 0
            for c in consumers[t]:
                reach |= below[c]
            after.append(reach)
        every = (1 << m) - 1
        for k, t in enumerate(cands):
            p = fg.tensors[t].producer
            if p in space._stuck or not fg.receives_gradient(t):
                continue
            later = every & ~((1 << (k + 1)) - 1)
            chained = (after[k] & later) == later and all(after[j] >> k & 1 for j in range(k))
            own = head_gate_seconds(fg, costs, t, profile)
            self.head[k] = ns(own + (fixed if chained else 0.0))
            self.start[k] = ns(own)
            self.readers[k] = frozenset(space._seg_of_op[c] for c in consumers[t]
                                        if c in space._seg_of_op and c not in space._stuck)
            self.keepers[k] = frozenset(space._seg_of_op.get(c, -1) for c in consumers[t])
            if any(c in space._stuck for c in consumers[t]):
                self.keepers[k] |= {-1}
        last = set(space.segments[-1]) - space._stuck
        ys = [y for y in dict.fromkeys(fg.ys) if fg.tensors[y].kind == "internal"
              and fg.tensors[y].producer in last and y not in bit]
        if ys:
            self.ys = ns(fixed + sum(head_gate_seconds(fg, costs, y, profile) for y in ys))

    @staticmethod
    def _ancestry(space: Segments) -> tuple[dict[int, int], list[int]]:
        """The tensors that head a recompute step paying the fixed part
        whenever a decision keeps them (candidates and expensive outputs
        that are floating, receive a gradient and are produced by an op a
        schedule copies), numbered in topological order; and per number,
        the bits of those it is reached from through tensors that each
        receive a gradient: build_schedule's walk back from the later one
        meets a kept tensor of that path, on which its step depends, so the
        two are in different layers (steps)."""
        fg, costs, profile = space.fg, space.costs, space.problem.profile
        nodes = sorted(  # of the kept tensors whose gates the bound counts (_head_ns)
            (t for t in space._head_ns if fg.tensors[t].producer not in space._stuck
             and head_gate_seconds(fg, costs, t, profile) > 0),
            key=lambda t: (fg.tensors[t].producer, t))
        number = {t: j for j, t in enumerate(nodes)}
        passes = [t.kind == "internal" and fg.receives_gradient(t.id) for t in fg.tensors]
        above = [0] * len(fg.tensors)
        for op in fg.ops:
            reach = 0
            for t in op.inputs:
                if passes[t]:
                    reach |= above[t]
                    j = number.get(t)
                    if j is not None:
                        reach |= 1 << j
            for t in op.outputs:
                above[t] = reach
        return number, [above[t] for t in nodes]

    def chain_ns(self, heads: Iterable[int]) -> int:
        """A lower bound on the fixed parts that the steps of a schedule keeping
        ``heads`` (tensor ids, each kept and produced by a copied op) pay:
        one per head of the longest chain among them (see the class), whose
        heads are all in different steps."""
        number, above = self._chain_nodes, self._above
        # levels[i]: the bits of the heads whose longest chain has i + 1
        # heads. An ancestor at some level has one at every level below (its
        # own chain's), so the search for the highest level holding an
        # ancestor is a bisection.
        levels: list[int] = []
        for j in sorted(number[t] for t in heads if t in number):
            a = above[j]
            lo, hi = 0, len(levels)
            while lo < hi:
                mid = (lo + hi) // 2
                if a & levels[mid]:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == len(levels):
                levels.append(1 << j)
            else:
                levels[lo] |= 1 << j
        return self._fixed_ns * len(levels)


class TurnBound:
    """The at-turn lower bound on a decision's forecast peak: the buffers
    certainly alive when the forward pass ends. The resident bytes and the
    seeds (the ys' incoming gradients, made before any gradient runs); what
    the gradients of stored segments read (their backprop steps run after
    the turn); and every kept tensor (candidate or expensive output) that an
    op of a recomputed segment reads (the proxy of its recompute step reads
    it after the turn). No plan the simulator accepts is cut off by it
    (tests/test_solvers.py checks it against every decision of its cases),
    and it costs no schedule: ``greedy`` and ``milp`` skip plans with it."""

    def __init__(self, space: Segments) -> None:
        fg, costs, counted = space.fg, space.costs, space.allocator.counted
        self.space = space

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
        def entry(t: int) -> tuple[int, frozenset[int]] | None:
            if any(not fg.ops[c].recomputable for c in consumers[t]):
                return None
            return root(t), frozenset(seg_of[c] for c in consumers[t])

        self.cand: list[tuple[int, frozenset[int]] | None] = [entry(t) for t in space.candidates]
        self.inner = [[entry(t) for t in ts] for ts in space.expensive_outputs]
        for t in ({r for s in self.seg_reads for r in s} | {c[0] for c in self.cand if c}
                  | {c[0] for es in self.inner for c in es if c}):
            self.counted[t] = counted(costs.tensor_bytes[t])
        # The ys' seeds (their grad_ys) are made before any gradient runs,
        # beside the resident bytes (as in Problem.peak_floor; not under XLA,
        # whose order interleaves the forward and backward passes).
        seeds = 0 if fg.xla else sum(counted(costs.tensor_bytes[y]) for y in dict.fromkeys(fg.ys))
        self.resident = space.problem.extra_resident_bytes + seeds + sum(
            counted(costs.tensor_bytes[t.id]) for t in fg.tensors if t.kind != "internal")

    def alive(self, stored, kept=(), expensive=()) -> set[int]:
        d = self.space.canonical(Decision.of(kept, stored, expensive))
        stored = d.stored
        out = set()
        for j in stored:
            out |= self.seg_reads[j]
        entries = [self.cand[k] for k in d.kept] + [c for j in d.expensive for c in self.inner[j]]
        for c in entries:
            if c is not None and not c[1] <= stored:
                out.add(c[0])
        return out

    def peak(self, stored, kept=(), expensive=()) -> int:
        return self.resident + sum(self.counted[t] for t in self.alive(stored, kept, expensive))

    def __call__(self, d: Decision) -> int:
        """The bound for decision ``d``."""
        return self.peak(d.stored, d.kept, d.expensive)
