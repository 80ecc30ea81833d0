"""From a set of checkpoints to the order of backward steps (no TensorFlow).

Given the checkpoints a strategy chose, :func:`build_schedule` decides

* which tensors stay in memory (*kept*): the checkpoints, the xs, the
  inputs and outputs of every op that must not be recomputed (stateful ops),
  and the arguments a ``tf.custom_gradient``'s gradient function captured
  (it reads those, not a copy's);
* for every kept tensor produced in the forward graph (a *head*), the
  *segment* that recomputes it: the ops reached walking back from its
  producer up to kept tensors (the segment's *boundary*);
* the order of the backward steps.

Correctness
-----------
Treat every kept tensor as an independent variable. A head ``c`` is then a
function of its boundary, and the gradient of the ys with respect to an x is
the sum, over the steps, of what each step propagates from its heads to its
boundary, provided each head's gradient is complete before its step runs
(chain rule; every path from an x to a y crosses the segments once). Steps
therefore run in reverse topological order of the heads: the heads are
layered by longest path (as ``toposort`` would, in linear time), and each layer is one step, whose
heads depend on nothing else in the layer. The ys that are not kept form the
first step. A head whose producer is not recomputable is differentiated in
place (a *backprop* step on the original op) rather than copied.

Gating
------
A recompute step must not run before backprop reaches it: the rewrite reads
some boundary tensors through the gate, a value computed from the heads'
incoming gradients (a data dependency no graph pass removes:
:mod:`memsave.gates`), and the rest
through identities. Which ones is decided here, once, as ``Step.gated``
(:func:`gated_boundary`); the rewrite builds it and the simulator counts its
copies.

Complexity: each segment walk stops at kept tensors, so the total work is
the sum of segment sizes, linear in the graph size when segments do not
overlap (ops shared by heads of different layers are copied once per layer).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection
from typing import Literal

from memsave import xla
from memsave.graph import ForwardGraph

__all__ = ["Step", "Schedule", "build_schedule", "gated_boundary", "is_floating"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One call of the stock gradient code.

    Attributes
    ----------
    kind : {"recompute", "backprop"}
        ``recompute``: copy ``ops``, differentiate the copies of ``heads``
        with respect to ``boundary``. ``backprop``: differentiate the original
        ``ops`` (which must not be copied) from ``heads`` to ``boundary``.
    heads : tuple of int
        Tensor ids whose gradients the step consumes.
    ops : tuple of int
        Op indices, in topological order.
    boundary : tuple of int
        Differentiable kept tensor ids the step sends gradients to.
    gated : tuple of int
        Of a recompute step's boundary, the tensors read through ``t +
        gate`` (:func:`gated_boundary`); the others are read through
        identities. Empty for backprop steps.
    ordered : tuple of int
        Of the boundary, the weights (xs and their reads) whose gradients
        the rewrite makes wait, by a data dependency, for all of the step's
        gradients (:func:`memsave.xla.ordered_boundary`; under XLA only).
    """

    kind: Literal["recompute", "backprop"]
    heads: tuple[int, ...]
    ops: tuple[int, ...]
    boundary: tuple[int, ...]
    gated: tuple[int, ...] = ()
    ordered: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The backward steps in the order they run, and what stays in memory."""

    checkpoints: tuple[int, ...]
    kept: tuple[int, ...]
    steps: tuple[Step, ...]
    in_place: tuple[int, ...] = ()

    @property
    def recomputed_ops(self) -> int:
        """How many op copies the rewrite makes."""
        return sum(len(s.ops) for s in self.steps if s.kind == "recompute")


def build_schedule(
    fg: ForwardGraph, checkpoints: tuple[int, ...], *, in_place: Collection[int] = ()
) -> Schedule:
    """Order the backward steps for ``fg`` with ``checkpoints`` kept.

    Parameters
    ----------
    fg : ForwardGraph
    checkpoints : tuple of int
        Internal tensor ids to keep; outputs of non-recomputable ops and
        xs are kept whether listed or not.
    in_place : collection of int
        Op indices to differentiate in place (``backprop`` steps on the
        originals, their inputs and outputs kept from the forward pass)
        rather than recompute, as if they were not recomputable: how a
        budgeted plan keeps a whole segment to save its recomputation
        (:mod:`memsave.solvers`).

    Returns
    -------
    Schedule

    Examples
    --------
    A chain x -> a -> b -> y with b kept recomputes y's segment first, then
    b's: the ys step, then one step per layer of heads.
    """
    tables = _tables(fg)
    producer, internal, receives = tables.producer, tables.internal, tables.receives
    inputs = tables.inputs
    ops = fg.ops
    # Under XLA some ops are differentiated in place whatever the plan
    # (memsave.xla.in_place_ops: a recomputed max-pool costs more there).
    stored = frozenset(in_place) | xla.in_place_ops(fg)
    copyable = list(tables.recomputable)  # by op index; stored ops are not
    kept: set[int] = set(tables.kept)
    kept.update(checkpoints)
    held = tables.held
    for i in stored:
        copyable[i] = False
        kept.update(held[i])

    _keep_shared_frontier(fg, kept, copyable)

    def differentiable(t: int) -> bool:
        return t in kept and receives[t]

    def segment(*heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Ops recomputing ``heads`` back to kept tensors, and that boundary."""
        seen = {producer[h] for h in heads}
        stack = list(seen)
        boundary: set[int] = set()
        while stack:
            for t in inputs[stack.pop()]:
                if t in kept:
                    if receives[t]:
                        boundary.add(t)
                elif internal[t]:
                    p = producer[t]
                    if p not in seen:
                        seen.add(p)
                        stack.append(p)
        return tuple(sorted(seen)), tuple(sorted(boundary))

    # Units of work, as ints: a head ``t >= 0`` recomputes the kept tensor
    # t; an in-place unit ``~first_op < 0`` backprops a non-recomputable op,
    # or a run of stored ops (see _stored_runs) from its first op, in place,
    # as one step.
    run_of = _stored_runs(fg, stored)

    def unit_of(t: int) -> int:  # t is internal
        p = producer[t]
        return t if copyable[p] else ~run_of.get(p, p)

    runs: dict[int, list[int]] = {}
    for o, first in run_of.items():
        runs.setdefault(first, []).append(o)

    def unit_ops(u: int) -> list[int]:
        return runs.get(~u, [~u])

    gradient_inputs = tables.gradient_inputs
    deps: dict[int, set[int]] = {}
    segments: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for t in sorted(kept):
        if not internal[t]:
            continue
        unit = unit_of(t)
        if unit >= 0:
            segments[t] = segment(t)
            boundary = segments[t][1]
        elif unit in deps:
            continue  # an in-place unit's boundary is its ops', whichever output
        elif ~unit in run_of:
            boundary = _outer_inputs(fg, unit_ops(unit), differentiable)
        else:  # one op that is not recomputable: its inputs are all kept
            boundary = gradient_inputs[~unit]
        found = deps.setdefault(unit, set())
        for b in boundary:
            if internal[b]:
                u = unit_of(b)
                if u != unit:
                    found.add(u)

    steps: list[Step] = []
    y_heads = tuple(dict.fromkeys(y for y in fg.ys if y not in kept and internal[y]))
    if y_heads:
        # One walk from all of them: the ys share their step (and often their ops).
        steps.append(_recompute_step(fg, y_heads, [segment(*y_heads)]))

    def position(u: int) -> int:
        return unit_ops(u)[-1] if u < 0 else producer[u]

    for layer in reversed(_layers(deps, position)):
        units = sorted(layer)  # in-place units (< 0) first
        split = bisect.bisect_left(units, 0)
        heads = tuple(units[split:])
        if heads:
            steps.append(_recompute_step(fg, heads, [segments[h] for h in heads]))
        if split:
            forced = sorted(o for u in units[:split] for o in unit_ops(u))
            outs = tuple(t for o in forced for t in ops[o].outputs if fg.tensors[t].trainable)
            bnd = _outer_inputs(fg, forced, differentiable)
            steps.append(Step("backprop", outs, tuple(forced), bnd,
                              ordered=xla.ordered_boundary(fg, bnd, forced)))
    return Schedule(
        checkpoints=tuple(sorted(set(checkpoints))),
        kept=tuple(sorted(kept)),
        steps=tuple(steps),
        in_place=tuple(sorted(stored)),
    )


@dataclasses.dataclass(frozen=True)
class _Tables:
    """What :func:`build_schedule` reads of a graph whatever the plan (cached on it)."""

    producer: tuple[int, ...]  # by tensor id; -1 for tensors no op produces
    internal: tuple[bool, ...]  # by tensor id: produced by an op of the graph
    receives: tuple[bool, ...]  # by tensor id: ForwardGraph.receives_gradient
    recomputable: tuple[bool, ...]  # by op index
    # By op index: its inputs that receive a gradient (sorted, once), the
    # boundary of a non-recomputable op differentiated in place, whose inputs
    # are all kept whatever the checkpoints.
    gradient_inputs: tuple[tuple[int, ...], ...]
    # Kept by every plan: the xs, the outputs and (non-external) inputs of ops
    # that are not recomputable, and the arguments a tf.custom_gradient's
    # function reads as the forward pass made them (alive until its gradient
    # anyway, they are kept, not recomputed).
    kept: frozenset[int]
    held: tuple[tuple[int, ...], ...]  # by op index: _held_in_place
    inputs: tuple[tuple[int, ...], ...]  # by op index: its inputs
    outputs: tuple[tuple[int, ...], ...]  # by op index: its outputs
    floating: tuple[bool, ...]  # by tensor id: is_floating(its dtype)
    x_inputs: tuple[tuple[int, ...], ...]  # by op index: its inputs that are xs
    # By tensor id: a floating output of a recomputable op (gated_boundary).
    activation: tuple[bool, ...]


def _tables(fg: ForwardGraph) -> _Tables:
    found = fg.__dict__.get("_schedule_tables")
    if found is None:
        tensors = fg.tensors
        xs = frozenset(fg.xs)
        held = tuple(tuple(_held_in_place(fg, op)) for op in fg.ops)
        kept = set(fg.xs)
        for op in fg.ops:
            if not op.recomputable:
                kept.update(held[op.index])
        kept.update(fg.captured())
        receives = tuple(fg.receives_gradient(t.id) for t in tensors)
        floating = tuple(is_floating(t.dtype) for t in tensors)
        found = _Tables(
            producer=tuple(-1 if t.producer is None else t.producer for t in tensors),
            internal=tuple(t.kind == "internal" for t in tensors),
            receives=receives,
            recomputable=tuple(op.recomputable for op in fg.ops),
            gradient_inputs=tuple(tuple(sorted({t for t in op.inputs if receives[t]}))
                                  for op in fg.ops),
            kept=frozenset(kept),
            held=held,
            inputs=tuple(op.inputs for op in fg.ops),
            outputs=tuple(op.outputs for op in fg.ops),
            floating=floating,
            x_inputs=tuple(tuple(t for t in op.inputs if t in xs) for op in fg.ops),
            activation=tuple(floating[t.id] and t.producer is not None
                             and t.kind == "internal" and fg.ops[t.producer].recomputable
                             for t in tensors),
        )
        object.__setattr__(fg, "_schedule_tables", found)  # a cache, not a field
    return found


def _held_in_place(fg: ForwardGraph, op) -> list[int]:
    """What an op differentiated in place keeps from the forward pass: its
    outputs and its inputs (but external ones, fed to every step anyway)."""
    return [*op.outputs, *(t for t in op.inputs if fg.tensors[t].kind != "external")]


def _stored_runs(fg: ForwardGraph, stored: frozenset[int]) -> dict[int, int]:
    """Group the stored ops into runs, each differentiated by one backprop step.

    Returns op index -> first op of its run. A run is a maximal sequence of
    stored ops in topological order, skipping ops that are not recomputable
    (variable reads, stateful ops) and read nothing the run produced; any
    other op ends the run. No
    path leaves a run and comes back into it: an op outside the run that
    reads from it ends the run, so every later op of the run is reached only
    through the run itself. One step per run keeps the schedule (and the
    tf.gradients calls of the rewrite) to one per run instead of one per op.
    A stored op that reads an x the run produced (a gradient asked for an
    intermediate tensor) starts a new run: a step sends gradients to its
    boundary only, so the x must be one, and the run below receives its
    gradient as a head.
    """
    run_of: dict[int, int] = {}
    tables = _tables(fg)
    x_inputs, recomputable, inputs = tables.x_inputs, tables.recomputable, tables.inputs
    producer = tables.producer
    first = -1  # the open run's first op, or -1
    previous = -1
    for i in sorted(stored):
        # The ops since the previous stored one: the first that is
        # recomputable or reads what the run produced ends the run (the rest
        # of them cannot start one).
        if first >= 0:
            for o in range(previous + 1, i):
                if recomputable[o] or any(run_of.get(producer[t]) == first for t in inputs[o]):
                    first = -1
                    break
        if first >= 0 and x_inputs[i] and any(run_of.get(producer[t]) == first
                                              for t in x_inputs[i]):
            first = -1
        if first < 0:
            first = i
        run_of[i] = first
        previous = i
    return run_of


def _outer_inputs(fg: ForwardGraph, ops, differentiable) -> tuple[int, ...]:
    """Differentiable inputs of ``ops`` that none of them produces, sorted."""
    inside = set(ops)
    producer = _tables(fg).producer
    return tuple(sorted({
        t for o in ops for t in fg.ops[o].inputs
        if producer[t] not in inside and differentiable(t)
    }))


def _keep_shared_frontier(fg: ForwardGraph, kept: set[int], recomputable: list[bool]) -> None:
    """Keep tensors so that no op is recomputed by two different heads.

    When the kept tensors do not cut the graph (checkpoints off the residual
    stream, say), the walk back from two heads reaches the same ops and
    each step would recompute them again: quadratic time on a deep
    network. One reverse sweep, consumers first, finds for each
    recomputable op (``recomputable`` by op index) the head it feeds
    through unkept tensors: none, one, or several (*shared*). A shared op
    is mended on the spot: its outputs read on toward a head (the
    frontier) are kept, or, if none is, all its unkept outputs (a kept
    output and an unkept y, say); the op then heads its own step, and the
    sweep goes on to its producers, which see that head. Its consumers
    were all decided before it and none is shared, so keeping its outputs
    changes no decision already made: linear in the graph.
    """
    consumers = fg.consumers()
    y_set = set(fg.ys)
    outputs = _tables(fg).outputs
    # reach[i]: _NO_HEAD, or the head's id (the op whose kept outputs share
    # one step, or _YS for the step of the unkept ys); never _SHARED once
    # the op is mended.
    reach = [_NO_HEAD] * len(outputs)

    def head_of(i: int) -> int:
        # The heads of the op's outputs merged: the one head they share,
        # else _SHARED (an output kept is its own op's head; an unkept y
        # feeds _YS; any other reaches its consumers' heads).
        head = _NO_HEAD
        for t in outputs[i]:
            own = i if t in kept else _YS if t in y_set else _NO_HEAD
            if own != _NO_HEAD and own != head:
                if head != _NO_HEAD:
                    return _SHARED
                head = own
            if own == i:
                continue  # a kept output: its consumers recompute from it
            for c in consumers[t]:
                h = reach[c]
                if h == _NO_HEAD or h == head:
                    continue
                if head != _NO_HEAD:
                    return _SHARED
                head = h
        return head

    for i in range(len(outputs) - 1, -1, -1):
        if not recomputable[i]:
            continue  # only recomputable ops take part (the others reach _NO_HEAD)
        head = head_of(i)
        while head == _SHARED:  # at most twice: the second keeps every output
            unkept = [t for t in outputs[i] if t not in kept]
            frontier = [t for t in unkept if any(reach[c] != _NO_HEAD for c in consumers[t])]
            kept.update(frontier or unkept)
            head = head_of(i)
        reach[i] = head


# What _keep_shared_frontier's sweep finds per op (head ids are op indices >= 0).
_YS = -1
_NO_HEAD = -2
_SHARED = -3


def _layers(deps: dict[int, set[int]], position) -> list[set[int]]:
    """``toposort.toposort(deps)`` of build_schedule's units as a list, in linear time.

    A unit's layer is the longest dependency path below it (what toposort's
    repeated removal of ready units computes, in time quadratic in the
    number of layers: a long run of in-place ops makes one layer each).
    Every dependency is produced earlier in the topological order
    (``position``), so one pass in that order finds every layer.
    """
    units = set(deps)
    for ds in deps.values():
        units.update(ds)
    level: dict[int, int] = {}
    for u in sorted(units, key=lambda u: (position(u), u)):
        ds = deps.get(u)
        level[u] = 1 + max(level[d] for d in ds) if ds else 0
    out: list[set[int]] = [set() for _ in range(1 + max(level.values(), default=-1))]
    for u, lv in level.items():
        out[lv].add(u)
    return out


def _recompute_step(fg: ForwardGraph, heads, parts) -> Step:
    if len(parts) == 1:  # one head's segment: sorted already
        ops, boundary = parts[0]
    else:
        ops = tuple(sorted({o for seg, _ in parts for o in seg}))
        boundary = tuple(sorted({b for _, bnd in parts for b in bnd}))
    return Step("recompute", heads, ops, boundary, gated_boundary(fg, boundary),
                xla.ordered_boundary(fg, boundary, ops))


def is_floating(dtype: str) -> bool:
    """Whether a tensor of this dtype (its TensorFlow name) can make and carry
    the gate (:mod:`memsave.gates`): floating and complex dtypes. Graphs
    built by hand, with no dtype recorded (``""``), count as floating."""
    return dtype == "" or dtype.startswith(("float", "bfloat", "half", "complex"))


def gated_boundary(fg: ForwardGraph, boundary: tuple[int, ...]) -> tuple[int, ...]:
    """The boundary tensors a recompute step reads through the gate
    (``Select(ready, t, t)``, under XLA ``t + gate``: :mod:`memsave.gates`).

    The activations among them (floating outputs of recomputable ops): a
    copy read through a gated proxy cannot be merged back into the original
    by Grappler's common-subexpression elimination, and waits for the
    gradient. With no activation on the boundary (a segment that starts at
    the xs' reads), the smallest floating tensor, so that something holds
    the copies back. Under XLA (``fg.xla``), which ignores control
    dependencies, every floating boundary tensor, weight reads too:
    otherwise XLA computes what a segment's backward derives from weights
    alone (a convolution's reversed filters) in the forward pass and keeps it.
    """
    tables = _tables(fg)
    if fg.xla:
        return tuple(t for t in boundary if tables.floating[t])
    activation = tables.activation
    activations = tuple(t for t in boundary if activation[t])
    if activations:
        return activations
    floats = [t for t in boundary if tables.floating[t]]
    tensors = fg.tensors
    return tuple(sorted(floats, key=lambda t: tensors[t].size_bytes)[:1])
