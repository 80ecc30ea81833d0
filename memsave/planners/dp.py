"""``dp``: exact dynamic programming over a chain of candidate cuts (rotor-like).

The chain model
---------------
The candidates cut the ops into segments ``0 .. m`` (see
:mod:`memsave.planners.segments`). A plan is a partition of the segments into
consecutive *groups*, each either **recomputed** (``R``: its first cut is a
checkpoint, its ops are recomputed once when backprop reaches it),
**stored** (``S``: its ops are differentiated in place on the forward
tensors, at no recompute cost) or **expensive kept** (``E``: like ``R``,
but its expensive outputs are kept too, and recomputation starts from
them). Every decision of the space is such a partition (cuts inside a
stored segment are kept anyway; the cut between a recomputed and an
expensive-kept segment is kept: :meth:`Segments.canonical`).

Split every buffer of the step by the group whose instruction *reads it last*
(forward, recompute, gradient or proxy instructions belong to the group of
their op; the seed, sums and proxies to the step they open). Buffers created
by the forward pass and read last by the *backward* of group ``G`` are alive
from their creation until ``G``'s backward, which runs after the backward of
every later group; so while any event of a later group ``h`` runs they are
alive. Hence, for every event ``e`` of group ``h``::

    alive(e) = resident + sum_{G < h} held(G) + local(e)

where ``held(G)`` is the bytes of those buffers and ``local(e)`` everything
else. On a chain, each op reads only its predecessor's output, so a buffer is
read by its own group or the next one, and ``local`` and ``held`` depend only
on the group, its mode and its neighbours' modes (*locality*). Then::

    peak = max_h [ resident + sum_{G < h} held(G) + Lmax(h | prev, next) ]

and a left-to-right DP over states ``(cut, mode before it, mode after it)``
(a neighbour's mode as :func:`_context` reduces it)
keeps, per state, the Pareto set of labels ``(held bytes, peak so far,
recompute nanoseconds)``; it is exact because a label's future depends only
on its state and held bytes.

The recompute time is a sum over the schedule's steps
(:meth:`memsave.problem.Problem.step_nanoseconds`); each step belongs to
the group of its heads' producers, and on a chain a group's steps (which
copies run, what its gates read) depend only on the group and its mode.

The terms are not modelled: ``held``, ``Lmax`` and the nanoseconds of a
group in context are read off the simulator's own program and timeline and
the time model's steps for a probe plan (the prefix as one group, the
group, the suffix as one group), so the DP optimises the simulator's peak
and the time model's seconds. Locality is verified, not assumed: the plan
found is evaluated once more, and if its peak or time differs from the
DP's, the result is marked not optimal (tests/test_solvers.py checks
equality on every decision of random heterogeneous chains).

Notes
-----
``O(m^2)`` probe simulations of ``O(n)`` each, then ``O(m^2)`` transitions
with small Pareto sets (about 6 m^2 probes:
:data:`~memsave.planners.budget.DP_PROBES_PER_CUT_SQUARED`): meant for
chains of a dozen cuts or so (the ``auto`` choice sends it at most
:data:`~memsave.planners.budget.DP_MAX_CUTS`, and a preset's capped search
only as many as its cap allows; larger problems to ``greedy``). Asked for by name on
a larger problem, it stops at its time limit (``time_limit_s``, default
:data:`~memsave.planners.segments.DEFAULT_TIME_LIMIT_S`) and answers with
``greedy``'s plan, ``optimal=False``, and a warning: on the study's
ResNet-110 (96 cuts) it had not finished after 10 minutes.

References
----------
O. Beaumont, L. Eyraud-Dubois, J. Herrmann, A. Joly, A. Shilova. Optimal
checkpointing for heterogeneous chains: how to train deep neural networks
with limited memory. arXiv:1911.13214, 2019 (rotor).
"""

from __future__ import annotations

import logging
import time

from memsave.planners.greedy import greedy
from memsave.planners.segments import DEFAULT_TIME_LIMIT_S, Outcome, Segments
from memsave.simulate import program_and_timeline, view_roots

__all__ = ["dp"]

#: Group modes, as Segments.groups names them (a stored group keeps the cut
#: before it: "S+").
R, S, E = "R", "S+", "E"
_MODES = (R, S, E)

logger = logging.getLogger(__name__)


class _OutOfTime(Exception):
    """The deadline passed before the DP finished."""


def _context(mode: str | None) -> str | None:
    """What a group's terms depend on of a neighbour's mode: whether it is
    stored (its ops differentiated in place) or recomputed; an
    expensive-kept neighbour recomputes like a recomputed one, from the cut
    kept between them (verified with the rest of the locality)."""
    return R if mode == E else mode


class _Terms:
    """``held`` and ``Lmax`` of groups in context, read from probe simulations."""

    def __init__(self, space: Segments, deadline: float = float("inf")) -> None:
        self.p = space
        self.deadline = deadline  # (time.perf_counter()) see in_time
        self.probes = 0
        self.n_seg = len(space.segments)
        self.seg_of_op = {}
        for k, seg in enumerate(space.segments):
            for o in seg:
                self.seg_of_op[o] = k
        # Non-recomputable ops belong to the segment of their topological position.
        bounds = [space.fg.tensors[t].producer for t in space.candidates]
        k = 0
        for op in space.fg.ops:
            while k < len(bounds) and op.index > bounds[k]:
                k += 1
            self.seg_of_op.setdefault(op.index, k)
        self.memo: dict[tuple, tuple[int, int]] = {}
        self.resident = None

    def get(self, prev: str | None, a: int, b: int, mode: str,
            nxt: str | None) -> tuple[int, int, int]:
        """``(held, Lmax, nanoseconds)`` of the group ``a .. b-1`` in ``mode``
        between groups in modes ``prev`` and ``nxt``."""
        prev, nxt = _context(prev), _context(nxt)
        key = (prev, a, b, mode, nxt)
        hit = self.memo.get(key)
        if hit is None:
            groups = []
            if a > 0:
                groups.append((0, a, prev))
            groups.append((a, b, mode))
            if b < self.n_seg:
                groups.append((b, self.n_seg, nxt))
            self._probe(groups)
            hit = self.memo[key]
        return hit

    def in_time(self) -> None:
        """Raise :class:`_OutOfTime` once the deadline has passed (before
        each probe, and each stage of the DP)."""
        if time.perf_counter() > self.deadline:
            raise _OutOfTime

    def _probe(self, groups: list[tuple[int, int, str]]) -> None:
        self.in_time()
        self.probes += 1
        p = self.p
        problem = p.problem
        schedule = p.schedule(p.decision(groups))
        prog, backward_start, trace = program_and_timeline(
            problem.forward(p.model), schedule, extra_resident_bytes=problem.extra_resident_bytes)
        self.resident = trace.resident_bytes
        n_instr = len(prog.reads)
        seg_group = [0] * self.n_seg
        for gi, (a, b, _) in enumerate(groups):
            for k in range(a, b):
                seg_group[k] = gi
        # Group of each instruction: its op's; others take the next op's.
        group = [-1] * n_instr
        for k, (kind, ref) in enumerate(prog.labels):
            if kind.of_op:
                group[k] = seg_group[self.seg_of_op[ref]]
        nxt = len(groups) - 1
        for k in range(n_instr - 1, -1, -1):
            if group[k] < 0:
                group[k] = nxt if k >= backward_start else 0
            nxt = group[k]
        # held: forward-created buffers read last by a group's backward.
        n_val = len(prog.size)
        last = [-1] * n_val
        for k in range(n_instr):
            for r in prog.reads[k]:
                last[r] = k
        root = view_roots(prog.alias)
        eff_last = list(last)
        for v in range(n_val):
            if root[v] != v and last[v] > eff_last[root[v]]:
                eff_last[root[v]] = last[v]
        created = [-1] * n_val
        for k in range(n_instr):
            for v, _ in prog.writes[k]:
                created[v] = k
        held = [0] * len(groups)
        counted = p.allocator.counted
        resident = prog.resident  # (a list built per access)
        for v in range(n_val):
            if resident[v] or root[v] != v or not 0 <= created[v] < backward_start:
                continue
            k = eff_last[v]
            if k >= backward_start:
                held[group[k]] += counted(prog.size[v])
        lmax = [None] * len(groups)
        before = [sum(held[:gi]) for gi in range(len(groups))]
        for k, (alive, _) in enumerate(trace.timeline):
            g = group[k]
            local = alive - trace.resident_bytes - before[g]
            if lmax[g] is None or local > lmax[g]:
                lmax[g] = local
        ns = [0] * len(groups)
        if schedule is not None:
            for step in schedule.steps:
                head = p.fg.tensors[step.heads[0]].producer
                ns[seg_group[self.seg_of_op[head]]] += problem.step_nanoseconds(step)
        for gi, (a, b, mode) in enumerate(groups):
            prev = groups[gi - 1][2] if gi > 0 else None
            nx = groups[gi + 1][2] if gi + 1 < len(groups) else None
            self.memo.setdefault((_context(prev), a, b, mode, _context(nx)),
                                 (held[gi], lmax[gi] or 0, ns[gi]))


def _pareto_insert(labels: list, new: tuple) -> None:
    """Keep ``labels`` (held, peak, nanoseconds, ...) Pareto-minimal in the first three."""
    h, pk, c = new[0], new[1], new[2]
    for lab in labels:
        if lab[0] <= h and lab[1] <= pk and lab[2] <= c:
            return
    labels[:] = [lab for lab in labels if not (h <= lab[0] and pk <= lab[1] and c <= lab[2])]
    labels.append(new)


def _run(space: Segments, terms: _Terms, budget_bytes: float):
    """Best (cost, peak, groups) under ``budget_bytes`` (inf: every Pareto end label)."""
    n = terms.n_seg
    # states[(a, prev, mode)] -> labels (held, peak, cost, groups)
    states: dict[tuple, list] = {}
    for mode in _MODES:
        states[(0, None, mode)] = [(0, 0, 0, ())]
    finals = []
    for a in range(n):
        terms.in_time()
        for prev in (None, *_MODES):
            for mode in _MODES:
                labels = states.pop((a, prev, mode), None)
                if not labels:
                    continue
                for b in range(a + 1, n + 1):
                    for nxt in (_MODES if b < n else (None,)):
                        held_g, lmax_g, cost_g = terms.get(prev, a, b, mode, nxt)
                        for held, peak, cost, groups in labels:
                            pk = max(peak, terms.resident + held + lmax_g)
                            if pk > budget_bytes:
                                continue
                            lab = (held + held_g, pk, cost + cost_g, groups + ((a, b, mode),))
                            if b == n:
                                finals.append(lab)
                            else:
                                _pareto_insert(states.setdefault((b, mode, nxt), []), lab)
    return finals


def dp(space: Segments, budget_bytes: int, *, time_limit_s: float | None = None) -> Outcome:
    """Least recompute seconds with forecast peak <= ``budget_bytes``, exactly, on chains.

    See the module docstring for the chain model. When no plan fits, returns
    the smallest-peak plan (``feasible=False``). Past ``time_limit_s``
    (default :data:`~memsave.planners.segments.DEFAULT_TIME_LIMIT_S`),
    ``greedy``'s plan for the budget, with ``optimal=False``, and a warning.
    """
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    terms = _Terms(space, deadline=time.perf_counter() + limit)
    try:
        finals = _run(space, terms, budget_bytes)
        if finals:
            best = min(finals, key=lambda lab: (lab[2], lab[1], len(lab[3])))
        else:
            finals = _run(space, terms, float("inf"))
            best = min(finals, key=lambda lab: (lab[1], lab[2], len(lab[3])))
    except _OutOfTime:
        logger.warning(
            "memsave: solver 'dp' did not finish within time_limit_s=%g s (%d probe "
            "simulations, %d candidate cuts; dp is meant for chains of a dozen or so): the plan "
            "is greedy's, not proven optimal. solver='auto' chooses a solver by the "
            "problem's size", limit, terms.probes, len(space.candidates))
        return greedy(space, budget_bytes)
    ev = space.evaluate(space.decision(best[3]))
    exact = ev.peak_bytes == best[1] and (not ev.peak_bytes <= budget_bytes
                                          or ev.recompute_ns == best[2])
    return Outcome(ev, optimal=exact)
