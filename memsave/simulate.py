"""The one memory model: simulate what the TensorFlow executor keeps alive.

Data flow: ``simulate(fg, schedule, costs)`` turns the forward graph and a
:class:`~memsave.schedule.Schedule` (or None for plain ``tf.gradients``)
into a straight-line *program* of buffer reads and writes, then replays it
once, freeing a buffer after the last reader of any value on it, as the
executor frees a tensor when its last reader has run. It returns a
:class:`MemoryTrace`: the allocator peak, the bytes resident before the
step, and the timeline of bytes alive during each event. Every strategy, the Plan, the no-saving warning and the budget
solvers read this one function; nothing here touches TensorFlow.

The program
-----------
1. Resident: the xs' variables and the inputs (sources and external
   tensors) are alive from the start to the end, and so are the gradients
   Grappler folds into constants (``MemoryModel.constant_folding_max_bytes``).
2. Forward: every op in topological order allocates its outputs, except
   views (:data:`memsave.costs.ALIAS_OP_TYPES`, and row slices:
   ``OpNode.views_input``) and elementwise ops writing into an input that
   dies there (:data:`memsave.costs.INPLACE_OP_TYPES`), a row slice
   included: that output then holds the slice's whole buffer, and where a
   kernel could write into a row slice or a buffer of its own size, it is
   counted in the slice (the larger hold; TensorFlow's choice varies).
   A tensor dies after its last reader; a tensor some gradient reads
   (``Costs.gradient``) is read by that gradient, so it lives until then.
3. Backward, one stage per step of the schedule (plain backprop is one
   ``backprop`` stage over every op): a ``recompute`` step makes fresh
   proxies of its boundary (a gated read, ``Select(ready, t, t)`` or under
   XLA ``t + gate``, of the tensors the schedule gates, ``Step.gated``: a
   new buffer unless the original dies there, as a GPU's select makes; a
   CPU's passes the buffer on, which is not modelled:
   :func:`memsave.gates.select`;
   identities otherwise, and for every tensor when the heads' gradients are
   constants: Grappler folds the gate), re-runs those of its ops whose
   values a gradient reads (TensorFlow prunes the rest), then
   differentiates them in reverse order. Each op's gradient sums the
   gradients its outputs received (AddN, in place), reads what it saves
   and writes one gradient per differentiable input (the incoming buffer
   itself where the gradient is a pass-through, e.g. AddV2).
4. The xs' gradients are outputs of the step: alive to the end (or, with
   ``gradients_kept=False``, not counted: consumed by an optimizer update
   as they are written); an x produced in the graph also passes its
   gradient on to its producer.
5. Calls and loops (ops with a :class:`~memsave.graph.Body`): the op holds,
   besides its outputs, what its gradient keeps (while_v2's accumulators:
   one buffer per trip; a call's intermediates) until its gradient runs,
   the items of the TensorLists a loop fills (as long as its list outputs
   live), and the body's transient peak while it runs; its gradient adds
   the body's backward transient, and a loop's gradient starts its sums
   from ``zeros_like`` of the loop invariants (constants Grappler folds).
   The body's figures come from simulating the body itself
   (:func:`memsave.bodies.body_figures`). Two loops neither of which
   reads the other's results (the halves of a ``Bidirectional`` RNN) run
   side by side, trip for trip, forward and backward: each one's transient
   lives until the other's has run too (:func:`side_by_side_loops`).

The settings come as one value, a :class:`~memsave.memory_model.MemoryModel`:
its allocator decides what a byte costs (oneDNN's CPU allocator does not
report allocations under 256 KiB; the BFC allocator of GPUs counts
everything, rounded up to 256 bytes), and it says how far a weight's
gradient kernel overlaps the next gradient and what Grappler folds.

Notes
-----
Building and replaying the program is linear in ops plus tensors: one pass
to build, one to find each value's last reader, one to replay. The replay
does not walk the program event by event: it settles each value's buffer
(its own, a view's, or an in-place candidate's) in order, then sums the
bytes each buffer adds where it is made and removes after its last reader.
A planner simulates many schedules of one graph, so what does not depend
on the schedule is computed once per graph and memory model, in a
:class:`ForwardProgram`: the forward pass's program and its last readers,
and per op what a copy of it and its gradient read and write; building a
schedule's program is then appends and lookups, op by op (the hot loops
bind names locally and inline the common case of ``_Program.instr``: the
simulator is a large share of planning time).

This module is longer than most: the builder, the forward program and the
replay share the program's representation (value and instruction lists),
which is private to them.

Ops run in
topological order (one at a time), except that a weight's gradient kernel
runs beside the next gradient (``MemoryModel.weight_gradient_overlap``); the real
executor may overlap other independent ops, so a forecast can be off by
the outputs of ops that ran side by side. The reported peak also counts
whole BFC chunks (a free chunk under twice the request is not split), which
this model does not: on small graphs with a few large tensors that adds up
to a few MiB and varies from run to run with the order of the ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from memsave.bodies import BodyFigures, body_figures
from memsave.costs import BATCH_MATMUL_OP_TYPES, Costs
from memsave.errors import ArgumentError
from memsave.graph import ForwardGraph
from memsave.memory_model import (BFC, CPU_ONEDNN, Allocator, MemoryModel, cpu_threads,
                                  half_conv2d_gradient_scratch, half_matmul_scratch)
from memsave.schedule import Schedule
from memsave.xla import XlaModel, breadth_first_order, copy_gradient_reads

__all__ = [
    "MemoryModel",
    "Allocator",
    "CPU_ONEDNN",
    "BFC",
    "MemoryTrace",
    "Event",
    "simulate",
    "ForwardProgram",
    "forward_program",
    "copies_that_run",
    "paused_gc",
]


class Event(enum.Enum):
    """What an instruction of the simulated program is (its label's kind)."""

    FORWARD = "run "  # an op of the forward pass (ref: op index)
    RECOMPUTE = "recompute "  # a copy of an op in a recompute step (op index)
    GRADIENT = "gradient of "  # an op's gradient (op index)
    SUM = "sum gradients of "  # the sum of a tensor's gradients (tensor id)
    SEED = "seed gradient of "  # grad_ys of a y (tensor id)
    PROXY = "proxy of "  # a recompute step's proxy of a boundary tensor (tensor id)

    @property
    def of_op(self) -> bool:
        return self in (Event.FORWARD, Event.RECOMPUTE, Event.GRADIENT)


@dataclasses.dataclass(frozen=True)
class MemoryTrace:
    """What one call of the step holds in memory over time.

    Attributes
    ----------
    peak_bytes : int
        Allocator peak over the step, resident bytes included: what
        ``get_memory_info(device)['peak']`` reads when reset just before.
    resident_bytes : int
        Bytes alive before the step starts (variables, inputs).
    timeline : tuple of (int, str)
        Bytes alive while each event runs (its outputs allocated, its
        inputs not yet freed), in execution order (empty when
        ``simulate(..., timeline=False)``).
    end_bytes : int
        Bytes alive after the step: resident bytes and the xs' gradients.
    peak_event : str
        The event at which the peak is reached.
    backward_start : int
        Index in ``timeline`` of the first backward event.
    """

    peak_bytes: int
    resident_bytes: int
    timeline: tuple[tuple[int, str], ...]
    peak_event: str
    backward_start: int = 0
    end_bytes: int = 0


class _Program:
    """Values (buffers or views of buffers) and instructions reading/writing them."""

    __slots__ = ("size", "alias", "resident_ids", "reads", "writes", "labels", "pinned",
                 "xs_grads", "lingering", "early_ids", "lists")

    def __init__(self) -> None:
        self.size: list[int] = []
        self.alias: list[int] = []  # value it views, or -1
        self.resident_ids: list[int] = []  # values alive from before the step to its end
        self.reads: list[list[int]] = []
        self.writes: list[list[tuple[int, tuple[int, ...]]]] = []
        self.labels: list[tuple[Event, int]] = []
        self.pinned: list[int] = []
        self.xs_grads: list[int] = []  # gradients of the xs and of their reads
        # Gradient values computed from constants only that Grappler does not
        # fold (too large): ready when the step starts, the executor runs them
        # then (alive from the step's start to their last reader).
        self.early_ids: list[int] = []
        # The values standing for a loop's TensorLists: their items are views
        # of them, but each item is a buffer of its own in TensorFlow.
        self.lists: set[int] = set()
        # (allocating instructions left, values): values still read by a
        # kernel that runs beside the next instructions (weight_gradient_overlap).
        self.lingering: list[tuple[int, list[int]]] = []

    @property
    def resident(self) -> list[bool]:
        """Per value: whether it is alive from before the step to its end."""
        flags = [False] * len(self.size)
        for v in self.resident_ids:
            flags[v] = True
        return flags

    def value(self, size: int, alias: int = -1, resident: bool = False) -> int:
        v = len(self.size)
        self.size.append(size)
        self.alias.append(alias)
        if resident:
            self.resident_ids.append(v)
        return v

    def instr(self, label: tuple, reads: list[int], writes: list[tuple[int, tuple[int, ...]]],
              kernels: bool = False) -> None:
        """Append an instruction. ``kernels``: each new buffer it writes is
        the output of a kernel of its own (an op's input gradients)."""
        lingering = self.lingering
        if lingering:
            alias = self.alias
            for v, _ in writes:
                if alias[v] < 0:
                    break  # a kernel that writes a buffer: the one run beside the lingering one
            else:
                for _, values in lingering:
                    reads = reads + values
                self.reads.append(reads)
                self.writes.append(writes)
                self.labels.append(label)
                return
            if len(lingering) == 1 and lingering[0][0] == 1:  # the usual case (overlap 1)
                ending = lingering.pop()[1]
                going: list[int] = []
            else:
                ending = []
                going = []
                still = []
                for left, values in lingering:
                    if left == 1:
                        ending += values
                    else:
                        going += values
                        still.append((left - 1, values))
                lingering[:] = still  # in place: the hot loops hold this list
            if ending and kernels and len(writes) > 1:
                # An op's gradient writing several new buffers is one kernel
                # each (a concat's: one Slice per input); the lingering kernel
                # runs beside the first (the largest, as the worst case).
                size = self.size
                first = None
                n_new = 0
                for w in writes:
                    if alias[w[0]] < 0 and not w[1]:
                        n_new += 1
                        if first is None or size[w[0]] > size[first[0]]:
                            first = w
                if n_new > 1:
                    self.reads.append(reads + ending + going)
                    self.writes.append([first])
                    self.labels.append(label)
                    writes = writes[:]
                    writes.remove(first)  # (values are unique: the same tuple)
                    ending = []
            reads = reads + ending + going
        self.reads.append(reads)
        self.writes.append(writes)
        self.labels.append(label)


class _Builder:
    """Builds the program of one step (see module docstring).

    The per-op facts every run and gradient reads come precomputed from the
    :class:`ForwardProgram` (``copy_plans``, ``gradient_plans``): building a
    schedule's program is then list appends and lookups, op by op.
    """

    def __init__(self, fp: ForwardProgram) -> None:
        self.fp = fp
        self.p = _Program()
        self.grads: dict[int, list[int]] = {}  # tensor id -> gradient values received
        self.orig: list[int] = [-1] * len(fp.fg.tensors)  # tensor id -> its forward value
        self.resident_bytes = 0
        self.constant: set[int] = set()  # gradient values Grappler folds into constants
        self.early: set[int] = set()  # gradient values computed from constants only, not folded
        self.saved_of: dict[int, int] = {}  # op with a body -> what its gradient keeps
        self.early_of: dict[int, list[int]] = {}  # op -> gradient values run in the forward
        # Loop op -> transients of the loops that run side by side with it,
        # made before it (ForwardProgram.side_by_side): its run (forward) or
        # its gradient (backward) reads them, so they live until then.
        self.beside: dict[int, list[int]] = {}

    def restore(self) -> None:
        """Put this (fresh) builder in the state after the forward pass."""
        fp, p = self.fp, self.p
        p.size, p.alias, p.resident_ids, p.reads, p.writes, p.labels = (
            list(x) for x in fp.program)
        self.orig[:] = fp.orig
        self.saved_of = dict(fp.saved_of)
        self.early_of = dict(fp.early_of)
        self.resident_bytes = fp.resident_bytes
        self.constant = set(fp.constant)
        self.early = set()
        self.beside = {}
        p.lists = set(fp.lists)

    # -- forward ----------------------------------------------------------

    def run_ops(self, ops: Sequence[int], cur: list[int], boundary=(),
                touched: list[int] | None = None) -> None:
        """Run ``ops`` (in order), reading the values ``cur`` maps their inputs
        to, and map their outputs there: in the forward pass (``touched``
        None), all; in a recompute step (copies of the ops), all but the
        ``boundary``'s, noted in ``touched``."""
        p = self.p
        # Hot loop (every op copy of every simulated plan): names bound once.
        plans = self.fp.copy_plans if touched is None else self.fp.recompute_plans
        saved_of, early_of = self.saved_of, self.early_of
        size, alias, value = p.size, p.alias, p.value
        all_reads, all_writes, all_labels, lingering = p.reads, p.writes, p.labels, p.lingering
        forward = Event.FORWARD
        side_by_side = self.fp.side_by_side if touched is None else {}
        for i in ops:
            label, inputs, figures, early, scratch, outputs = plans[i]
            reads = []
            for t in inputs:
                reads.append(cur[t])
            writes = []
            lists = -1
            if figures is not None:
                # What the gradient keeps (alive until it runs), what the loop's
                # TensorLists hold (alive while the lists are), and the body's
                # own transient peak (freed when the op ends).
                saved = value(figures.saved_bytes)
                saved_of[i] = saved
                lists = value(figures.stored_bytes)
                p.lists.add(lists)
                transient = value(figures.forward_bytes)
                writes += [(saved, ()), (lists, ()), (transient, ())]
                if i in side_by_side:
                    self.run_beside(i, transient, reads)
            if early:
                # Gradient values computed from this op's values alone: they run
                # right after it and wait for its gradient.
                values = [value(b) for b in early]
                early_of[i] = values
                writes += [(v, ()) for v in values]
            if scratch:
                # The kernel's temporaries (freed when it ends): one per operand.
                writes += [(value(b), ()) for b in scratch]
            for t, nbytes, src, in_lists, same_size in outputs:
                v = len(size)
                size.append(nbytes)
                if in_lists and lists >= 0:
                    alias.append(lists)
                    writes.append((v, ()))
                elif src is not None:
                    alias.append(cur[src])
                    writes.append((v, ()))
                else:
                    alias.append(-1)
                    if not same_size:
                        writes.append((v, ()))
                    elif len(same_size) == len(reads):  # every input: in place candidates
                        writes.append((v, tuple(reads)))
                    else:
                        cands = []
                        for j in same_size:
                            cands.append(reads[j])
                        writes.append((v, tuple(cands)))
                if touched is None:
                    cur[t] = v
                elif t not in boundary:
                    cur[t] = v
                    touched.append(t)
            if touched is None:
                label = (forward, i)
            if lingering:
                p.instr(label, reads, writes)
            else:  # (p.instr, inlined)
                all_reads.append(reads)
                all_writes.append(writes)
                all_labels.append(label)

    def run_beside(self, i: int, transient: int, reads: list[int]) -> None:
        """Loop ``i``, about to run (or its gradient), reads the transients
        of the loops beside it that ran before it (into ``reads``), and
        leaves its own ``transient`` to those still to run."""
        beside = self.beside
        reads += beside.pop(i, ())
        for j in self.fp.side_by_side[i]:
            found = beside.get(j)
            if found is None:
                beside[j] = [transient]
            else:
                found.append(transient)

    def proxies(self, boundary: Sequence[int], gated, cur: list[int], touched: list[int]) -> None:
        """A recompute step's proxies of its ``boundary`` (gated reads of the
        ``gated``: a new buffer unless the original dies there; identities
        otherwise), mapped in ``cur`` and noted in ``touched``."""
        p, orig, tensor_bytes = self.p, self.fp.orig, self.fp.costs.tensor_bytes
        size, alias = p.size, p.alias
        all_reads, all_writes, all_labels, lingering = p.reads, p.writes, p.labels, p.lingering
        labels = self.fp.proxy_labels
        for t in boundary:
            src = orig[t]
            v = len(size)
            size.append(tensor_bytes[t])
            if t in gated:
                alias.append(-1)
                writes = [(v, (src,))]
            else:
                alias.append(src)
                writes = [(v, ())]
            if lingering:
                p.instr(labels[t], [src], writes)
            else:  # (p.instr, inlined)
                all_reads.append([src])
                all_writes.append(writes)
                all_labels.append(labels[t])
            cur[t] = v
            touched.append(t)

    # -- backward ---------------------------------------------------------

    def backward(self, ops: Sequence[int], cur: list[int], heads, boundary, *,
                 recomputed: bool = False, ordered: bool = False) -> None:
        """Differentiate ``ops`` (reverse order), reading forward values
        through ``cur``. Gradients of ``heads`` come from (and of
        ``boundary`` go to) ``self.grads``; others stay local. ``recomputed``:
        ``ops`` are a recompute step's copies (under XLA their gradients
        differ, :mod:`memsave.xla`). ``ordered``: ``ops`` are a plan's one
        gradient call whose chain memsave makes wait for the weights'
        kernels (:func:`memsave.rewrite.differentiate`): a weight's kernel
        runs beside no later gradient of the call. (A schedule's steps are
        ordered so too, but simulated with the overlap: measured peaks of
        rewritten plans were calibrated with it, and a plan that takes its
        input gradient on to another step's proxies does overlap.)"""
        fp, p = self.fp, self.p
        # Hot loop (every op of every simulated plan): names bound once.
        plans = fp.copy_gradient_plans if recomputed else fp.gradient_plans
        is_x, grads, constant, early = fp.is_x, self.grads, self.constant, self.early
        saved_of, early_of = self.saved_of, self.early_of
        size, alias, xs_grads = p.size, p.alias, p.xs_grads
        all_reads, all_writes, all_labels, lingering = p.reads, p.writes, p.labels, p.lingering
        overlap = fp.overlap
        local: dict[int, list[int]] = {}
        held = None  # ordered: the last weight kernel's reads, if it is the call's last
        for i in reversed(ops):
            (label, outputs, has_gradient, read_tensors, has_early, scratch, loop_constants,
             body_bytes, targets, static_fold, kernels, loop) = plans[i]
            out_grads: list[int | None] = []
            reads = []  # the gradients received, then what the gradient reads
            for t in outputs:
                got = local.pop(t, None)
                if t in heads or is_x[t]:
                    more = grads.pop(t, None)
                    if more:
                        got = more if got is None else got + more
                if not got:
                    out_grads.append(None)
                    continue
                g = got[0] if len(got) == 1 else self.accumulate(t, got)
                if is_x[t]:
                    # An x produced in the graph (an activation given as x):
                    # its gradient is a result of the step and flows on.
                    grads[t] = [g]
                out_grads.append(g)
                reads.append(g)
            if not reads or not has_gradient:
                continue
            for t in read_tensors:
                reads.append(cur[t])
            if has_early:
                reads += early_of[i]
            writes = []
            if scratch:
                # The gradient's temporaries (Costs.gradient_scratch): an
                # Einsum's kernels', a broadcast product's per-example products.
                temporaries = [p.value(b) for b in scratch]
                writes += [(v, ()) for v in temporaries]
            if body_bytes is not None:
                if i in saved_of:
                    reads.append(saved_of[i])
                # The gradient loop sums a loop invariant's gradient from
                # zeros_like(it): a constant Grappler folds when the shape is static.
                # while_v2 differentiates every floating loop input, used or not.
                for t in loop_constants:
                    self.constant_value(t)
                transient = p.value(body_bytes)
                writes.append((transient, ()))
                if loop and i in fp.side_by_side:
                    self.run_beside(i, transient, reads)
            to_weight = flows_on = False
            for t, internal, k, nbytes, feeds_x, foldable, in_place in targets:
                if not internal and t not in boundary:
                    continue
                g = out_grads[k] if k is not None else None
                if g is not None:  # the incoming gradient's buffer (a pass-through)
                    v = len(size)
                    size.append(nbytes)
                    alias.append(g)
                    writes.append((v, ()))
                    if g in constant:
                        constant.add(v)
                    elif g in early:
                        early.add(v)
                elif static_fold and all(g in constant or g in early for g in out_grads
                                         if g is not None):
                    # Computed from constants only: Grappler folds it, or,
                    # too large to fold, the executor runs it at the start.
                    if foldable and all(g in constant for g in out_grads if g is not None):
                        v = self.constant_value(t)
                    else:
                        v = self.early_value(nbytes)
                        writes.append((v, ()))
                else:
                    v = len(size)
                    size.append(nbytes)
                    alias.append(-1)
                    if in_place is None:
                        writes.append((v, ()))
                    elif in_place:  # every value read has this size: all are candidates
                        writes.append((v, tuple(reads)))
                    else:  # the values read of this size
                        cands = []
                        for r in reads:
                            if size[r] == nbytes:
                                cands.append(r)
                        writes.append((v, tuple(cands)))
                if t in boundary:
                    found = grads.get(t)
                    if found is None:
                        grads[t] = [v]
                    else:
                        found.append(v)
                else:
                    found = local.get(t)
                    if found is None:
                        local[t] = [v]
                    else:
                        found.append(v)
                if feeds_x:
                    xs_grads.append(v)
                    to_weight = True
                else:
                    flows_on = True
            held = None  # (the call's next gradient waits for that kernel)
            if lingering:
                # A call's or loop's gradient, or a kernel's temporaries, are
                # not one kernel per buffer.
                p.instr(label, reads, writes, kernels)
            else:  # (p.instr, inlined)
                all_reads.append(reads)
                all_writes.append(writes)
                all_labels.append(label)
            if to_weight and flows_on and overlap and not loop:
                # The weight's gradient kernel (Conv2DBackpropFilter, the
                # MatMul of x^T and dy) is ready with the input's, but nothing
                # downstream waits for it: the executor runs it beside the
                # next gradient ops, which allocate while it still holds what
                # it reads (the layer's input, the incoming gradient). (Not a
                # loop's gradient: it sums the weights' gradients trip by
                # trip, and its outputs come when the whole loop has ended.)
                # A view of part of a larger buffer it reads (a row slice)
                # is left out: it would hold the whole buffer, and the kernel
                # had finished first where measured (a tf.scan's hs[-1] @ V:
                # 73 MiB measured, 96.5 forecast with the 24 MiB sequence held).
                entry = (overlap, [r for r in reads if alias[r] < 0 or size[r] >= size[alias[r]]])
                if ordered:
                    held = entry
                else:
                    lingering.append(entry)
                if scratch and i in fp.summed_scratch:
                    # Its per-example products, summed by the next kernel on
                    # that side: alive while one more gradient runs. Measured:
                    # 4 layers x @ w, [512, 64, 256] @ [256, 256]: two
                    # layers' products at once (417 MiB, a pre-split pool).
                    lingering.append((overlap + 1, temporaries))
        if held is not None:
            lingering.append(held)

    def xla_proxies(self, step, cur: list[int], touched: list[int]) -> None:
        """:meth:`proxies` under XLA, then the step's transformed kernels.

        XLA fuses a gated ``t + gate`` with t's elementwise producers: it
        reads what t is computed from (:func:`memsave.xla.fused_sources`)
        and the gate (the heads' gradients). A convolution's copy whose
        input gets a gradient reads its kernel re-laid out, made as soon as
        the gate opens (:meth:`memsave.xla.XlaModel.kernel`).
        """
        p, orig, xm = self.p, self.fp.orig, self.fp.xla_model
        tensor_bytes, labels = self.fp.costs.tensor_bytes, self.fp.proxy_labels
        gated = set(step.gated)
        gate = [g for h in step.heads for g in self.grads.get(h, ())]
        for t in step.boundary:
            src = orig[t]
            if t in gated:
                v = p.value(tensor_bytes[t])
                p.instr(labels[t], [orig[u] for u in xm.fused_sources(t)] + gate, [(v, ())])
            else:
                v = p.value(tensor_bytes[t], alias=src)
                p.instr(labels[t], [src], [(v, ())])
            cur[t] = v
            touched.append(t)
        self.xla_kernels = {}
        for i in step.ops:
            kernel = xm.kernel(i)
            if kernel is not None:
                w, nbytes = kernel
                v = p.value(nbytes)
                p.instr(labels[w], [cur[w]], [(v, ())])
                self.xla_kernels[i] = v

    def constant_value(self, t: int) -> int:
        """A gradient Grappler folds: resident from before the step."""
        nbytes = self.fp.costs.tensor_bytes[t]
        v = self.p.value(nbytes, resident=True)
        self.constant.add(v)
        self.resident_bytes += nbytes
        return v

    def early_value(self, nbytes: int) -> int:
        """A gradient computed from constants only, too large for Grappler to
        fold (``MemoryModel.constant_folding_max_bytes``): nothing it waits
        for runs in the step, so the executor runs it when the step starts,
        and it lives until its last reader. Measured: a ``reduce_mean`` over
        a [64, 1024, 128] sequence, its gradient's ``Tile`` (32 MiB) was
        alive beside the forward pass's peak (two inter-op threads). Values
        computed from it alone are too (:attr:`early`)."""
        v = self.p.value(nbytes)
        if not self.fp.fg.xla:  # (XLA runs one thunk at a time, in its order)
            self.p.early_ids.append(v)
            self.early.add(v)
        return v

    def accumulate(self, t: int, got: list[int]) -> int | None:
        if not got:
            return None
        if len(got) == 1:
            return got[0]
        if all(g in self.constant for g in got) and self.fp.foldable[t]:
            return self.constant_value(t)
        v = self.p.value(self.fp.costs.tensor_bytes[t])
        self.p.instr((Event.SUM, t), list(got), [(v, tuple(got))])
        return v


class _FloorTables(NamedTuple):
    """What :meth:`ForwardProgram.peak_floor` reads, whatever the schedule."""

    flows: list[bool]  # per tensor: backprop sends it a gradient (as the builder does)
    runs: list[bool]  # per op: its gradient runs (it has one, and one reaches it)
    buffer_of: list[int]  # per tensor: the forward buffer it is on (-1: a resident one)
    reads_of: list[tuple[int, ...]]  # per op: the buffers its gradient reads (if it runs)
    grad_reads: list[tuple[int, ...]]  # per op: the tensors its gradient reads (if it runs)
    fresh: list[tuple[tuple[int, int], ...]]  # per op: (tensor, counted bytes) of the
    # gradients it writes to new buffers, if it runs (see peak_floor)
    fresh_xs: list[tuple[tuple[int, bool, int, int], ...]]  # per op: (tensor, internal,
    # x, counted bytes) of the gradients it writes to new buffers that become an x's
    producer: list[int]  # per tensor: its op, or -1
    copy_bytes: list[int]  # per tensor: counted bytes of a copy's new buffer (0: not one)
    proxy_bytes: list[int]  # per tensor: counted bytes of a buffer of its size
    seeds: int  # counted bytes of the seeds
    folded_seeds: int  # of those Grappler folds into constants (resident)
    open_seeds: tuple[tuple[int, int], ...]  # (y, counted bytes) of the others


class ForwardProgram:
    """The builder's state after the forward pass, which every schedule of one graph shares.

    Build it once (:func:`forward_program`) and pass it to :func:`simulate`
    as ``forward=`` to simulate many schedules of one graph (a planner's
    candidate plans, the budget solvers) without rebuilding it;
    :class:`memsave.problem.Problem` keeps one per memory model. Besides the
    forward program it holds what every simulation of the graph reads per
    op (what running a copy of it writes, what its gradient reads and
    writes) and per value (its last reader in the forward pass), computed
    here once.
    """

    def __init__(self, fg: ForwardGraph, costs: Costs, model: MemoryModel, *,
                 loop_figures: Mapping[int, BodyFigures] | None = None,
                 loops_prepared: bool = False) -> None:
        self.fg, self.costs, self.model = fg, costs, model
        # Op index -> the figures of a loop whose gradient is not while_v2's
        # (memsave.loopmodel.figures of its LoopChoice; Problem.with_loops).
        self.loop_figures = dict(loop_figures or {})
        # Whether a loop's gradient is memsave's: then memsave builds even a
        # plan without a schedule, as one ordered call (Builder.backward).
        self.loops_prepared = loops_prepared
        tensors, tensor_bytes = fg.tensors, costs.tensor_bytes
        xs = set(fg.xs)
        self.is_x = [node.id in xs for node in tensors]
        max_folded = model.constant_folding_max_bytes
        self.foldable = [node.size_known and tensor_bytes[node.id] <= max_folded
                         for node in tensors]
        self.overlap = 0 if fg.xla else model.weight_gradient_overlap
        # Gradients whose temporaries a kernel of their own sums afterwards (a
        # broadcast operand's per-example products, Costs.gradient_scratch).
        self.summed_scratch = frozenset(
            i for i, op in enumerate(fg.ops)
            if op.type in BATCH_MATMUL_OP_TYPES and costs.gradient_scratch[i])
        self.xla_model = XlaModel(fg, costs) if fg.xla else None
        # Loop op -> the loops running side by side with it (not under XLA:
        # one thunk at a time).
        self.side_by_side = {} if fg.xla else side_by_side_loops(fg)
        self._plan_ops()

        b = _Builder(self)
        p = b.p
        for node in tensors:
            if node.kind != "internal":
                b.orig[node.id] = p.value(tensor_bytes[node.id], resident=True)
                b.resident_bytes += tensor_bytes[node.id]
        b.run_ops(range(len(fg.ops)), b.orig)
        # Instruction lists are never changed once made: shared, not copied.
        self.program = (p.size, p.alias, p.resident_ids, p.reads, p.writes, p.labels)
        self.lists = frozenset(p.lists)
        self.orig = b.orig
        self.saved_of = b.saved_of
        self.early_of = b.early_of
        self.resident_bytes = b.resident_bytes
        self.constant = b.constant
        self._prepare_replays(p)
        self._identity: list[int] = []
        self._names: tuple[list[str], list[str]] | None = None  # of the ops, of the tensors
        self._forward_labels: list[str] | None = None
        self._floor: _FloorTables | None = None  # peak_floor's tables

    def _prepare_replays(self, p: _Program) -> None:
        """What every replay (:func:`_replay`) starts from.

        ``last``: each forward value's last reader in the forward pass (or
        where it is made); ``counted``: the bytes each value counts. Of the
        forward's writes, a replay need not look at the new buffers (made at
        their instruction whatever the schedule: ``made_bytes`` per
        instruction, ``new_buffers``) nor at the views of resident values
        (their buffer is known: ``replay_root``); ``replay_writes`` keeps the
        others, per instruction.
        """
        last = [-1] * len(p.size)
        for k, ws in enumerate(p.writes):
            for v, _ in ws:
                last[v] = k
        for k, rs in enumerate(p.reads):
            for r in rs:
                last[r] = k
        self.last = last
        self.counted_of = _Counted(self.model.allocator)
        counted = self.counted = list(map(self.counted_of.__getitem__, p.size))
        self.resident_counted = sum([counted[v] for v in p.resident_ids])
        root = list(range(len(p.size)))
        on_resident = [False] * len(p.size)
        for v in p.resident_ids:
            on_resident[v] = True
        saved = set(self.saved_of.values())
        self.saved_at: dict[int, int] = {}  # what a call's gradient keeps -> its instruction
        self.made_bytes = [0] * len(p.writes)
        self.new_buffers: list[int] = []
        self.replay_writes: list[list[tuple[int, tuple[int, ...]]]] = []
        for k, ws in enumerate(p.writes):
            left = []
            for w in ws:
                v, cands = w
                a = p.alias[v]
                if a < 0 and not cands:
                    self.made_bytes[k] += counted[v]
                    self.new_buffers.append(v)
                    if v in saved:
                        self.saved_at[v] = k
                elif a >= 0 and on_resident[a]:
                    root[v] = root[a]
                    on_resident[v] = True
                else:
                    left.append(w)
            self.replay_writes.append(left)
        self.replay_root = root

    def identity(self, start: int, stop: int) -> list[int]:
        """``list(range(start, stop))``, copied from one made once (no new int objects)."""
        if len(self._identity) < stop:
            self._identity = list(range(max(stop, 2 * len(self._identity))))
        return self._identity[start:stop]

    def _plan_ops(self) -> None:
        """Per op, what running a copy of it and differentiating it read and write.

        ``copy_plans[i]`` (read by :meth:`_Builder.run_ops`): its label, its
        inputs, its body's figures (or None), the bytes of its early gradient
        values and of its kernel's temporaries, and per output (tensor,
        bytes, the tensor it views or None, whether it lives in the loop's
        TensorLists, the positions of the inputs it may be written into).

        ``gradient_plans[i]`` (read by :meth:`_Builder.backward`): its label,
        outputs, whether it has a gradient, the tensors the gradient reads,
        whether it reads early values, the bytes of its temporaries, the
        loop invariants whose zero gradients Grappler folds, its body's
        backward bytes (or None), per input it writes a gradient to (tensor,
        internal, the output whose gradient is passed through or None,
        bytes, whether it feeds an x, foldable, in-place candidates: None
        for none, True for every value read, False for those of its size),
        whether it folds when its incoming gradients do, whether each
        buffer it writes is a kernel of its own, and whether it is a loop's.
        """
        fg, costs, model, is_x = self.fg, self.costs, self.model, self.is_x
        tensors, tensor_bytes, alias_of = fg.tensors, costs.tensor_bytes, costs.alias_of
        scratch_ops = costs.scratch or ((),) * len(fg.ops)
        # An x, or the read of one (an op whose inputs are all xs, e.g.
        # ReadVariableOp): its gradient is the x's, passed through.
        feeds_x = list(is_x)
        for op in fg.ops:
            if op.inputs:
                for u in op.inputs:
                    if not is_x[u]:
                        break
                else:
                    for t in op.outputs:
                        feeds_x[t] = True
        internal = [node.kind == "internal" for node in tensors]
        copy_plans = []
        gradient_plans = []
        recompute, gradient = Event.RECOMPUTE, Event.GRADIENT  # (an Enum member lookup is slow)
        for i, op in enumerate(fg.ops):
            use = costs.gradient[i]
            inputs, outputs = op.inputs, op.outputs
            figures = self.loop_figures.get(i) or (
                body_figures(op.body, model) if op.body is not None else None)
            inplace = costs.inplace[i]
            copied_outputs = []
            for t in outputs:
                nbytes = tensor_bytes[t]
                # In-place candidates: the inputs of its size, by position.
                same_size = (tuple([j for j, u in enumerate(inputs) if tensor_bytes[u] == nbytes])
                             if inplace else ())
                copied_outputs.append((t, nbytes, alias_of[t],
                                       figures is not None and tensors[t].dtype == "variant",
                                       same_size))
            copy_plans.append((
                (recompute, i),
                inputs,
                figures,
                use.early_bytes if use.has_gradient else (),
                scratch_ops[i],
                tuple(copied_outputs),
            ))

            read_ins, read_outs = costs.gradient_reads[i]
            loop_constants = ()
            sums_bytes = 0
            if op.body is not None and op.body.loop:
                summed = [t for t in (inputs[j] for j in op.body.invariant if j < len(inputs))
                          if tensors[t].trainable and tensors[t].dtype not in ("resource", "variant")]
                loop_constants = tuple([t for t in summed if self.foldable[t]])
                # A chunked gradient's loop of each chunk sums again the
                # gradients of those that receive one, from zeros of its own
                # (BodyFigures.invariant_sums).
                more = [t for t in summed if fg.receives_gradient(t)] * (figures.invariant_sums - 1)
                loop_constants += tuple([t for t in more if self.foldable[t]])
                sums_bytes = sum([tensor_bytes[t] for t in more])
            aliases = use.aliases
            # The sizes of the values the gradient may read (None: not known
            # here): when they are all a new buffer's, every value read is a
            # candidate to write it into in place (an elementwise op's).
            read_sizes = None
            if inplace and figures is None:
                read_sizes = {tensor_bytes[t] for t in (*outputs, *read_ins, *read_outs)}
                read_sizes.update(use.early_bytes if use.has_gradient else ())
            targets = []
            for j, t in costs.gradient_targets[i]:
                nbytes = tensor_bytes[t]
                targets.append((
                    t, internal[t], aliases[j] if j < len(aliases) else None, nbytes,
                    feeds_x[t], self.foldable[t],
                    # In-place candidates: none, every value read, or those of its size.
                    None if not inplace else read_sizes == {nbytes}))
            gradient_plans.append((
                (gradient, i),
                outputs,
                use.has_gradient,
                read_ins + read_outs,
                bool(use.early_bytes) and use.has_gradient,
                costs.gradient_scratch[i],
                loop_constants,
                figures.backward_bytes + sums_bytes if figures is not None else None,
                tuple(targets),
                not use.reads_outputs and all([tensors[inputs[j]].constant
                                               for j in use.reads_inputs if j < len(inputs)]),
                op.body is None and not costs.gradient_scratch[i],
                op.body is not None and op.body.loop,
            ))
        self.copy_plans, self.gradient_plans = copy_plans, gradient_plans
        if not fg.xla and model.runs_float16_without_onednn:
            self._plan_half_conv2d()
            self._plan_half_matmul()
        # Copies and their gradients: the same as the originals' but under XLA.
        self.recompute_plans, self.copy_gradient_plans = copy_plans, gradient_plans
        self.xla_forward_of: dict[int, int] = {}  # op -> where its XLA values start in early_of
        if self.xla_model is not None:
            self._plan_xla_ops()
        self.needed_copies = copies_that_run(fg, costs)
        proxy = Event.PROXY
        self.proxy_labels = [(proxy, t) for t in range(len(fg.tensors))]

    def _plan_half_conv2d(self) -> None:
        """Add to the gradient plans of float16 ``Conv2D`` ops the im2col
        buffers TensorFlow's CPU kernels hold while they run
        (:func:`memsave.memory_model.half_conv2d_gradient_scratch`): both
        kernels (input and filter) run side by side, each with its buffer."""
        fg, costs, plans = self.fg, self.costs, self.gradient_plans
        threads = cpu_threads()
        for i, op in enumerate(fg.ops):
            if op.type != "Conv2D" or len(op.inputs) < 2 or not op.outputs:
                continue
            x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
            out = fg.tensors[y]
            shapes = [fg.tensors[t].shape for t in (x, w, y)]
            if out.dtype != "float16" or any(s is None or len(s) != 4 for s in shapes) \
                    or any(d is None for s in shapes for d in s[1:]) or None in shapes[1]:
                continue
            per_image = out.itemsize * shapes[2][1] * shapes[2][2] * shapes[2][3]
            batch = max(costs.tensor_bytes[y] // per_image, 1) if per_image else 1
            targets = {j for j, _ in costs.gradient_targets[i]}
            scratch = half_conv2d_gradient_scratch(
                shapes[0], shapes[1], (batch, *shapes[2][1:]), input_gradient=0 in targets,
                filter_gradient=1 in targets, threads=threads, itemsize=out.itemsize)
            if scratch and costs.gradient[i].has_gradient:
                g = plans[i]
                plans[i] = g[:5] + (g[5] + scratch,) + g[6:10] + (False,) + g[11:]

    def _plan_half_matmul(self) -> None:
        """Add to the plans of float16 ``MatMul`` ops the float32 temporaries
        TensorFlow's CPU kernel computes in
        (:func:`memsave.memory_model.half_matmul_scratch`): the op's own, and
        each gradient product's (``dy w^T`` and ``x^T dy``, side by side)."""
        fg, costs = self.fg, self.costs
        copy_plans, plans, nbytes = self.copy_plans, self.gradient_plans, costs.tensor_bytes
        for i, op in enumerate(fg.ops):
            if op.type != "MatMul" or len(op.inputs) != 2 or len(op.outputs) != 1 \
                    or fg.tensors[op.outputs[0]].dtype != "float16":
                continue
            (a, b), y = op.inputs, op.outputs[0]
            c = copy_plans[i]
            copy_plans[i] = c[:4] + (half_matmul_scratch(nbytes[a], nbytes[b], nbytes[y]),) + c[5:]
            targets = {j for j, _ in costs.gradient_targets[i]}
            scratch = ()
            if 0 in targets:  # dy w^T
                scratch += half_matmul_scratch(nbytes[y], nbytes[b], nbytes[a])
            if 1 in targets:  # x^T dy
                scratch += half_matmul_scratch(nbytes[a], nbytes[y], nbytes[b])
            if scratch and costs.gradient[i].has_gradient:
                g = plans[i]
                plans[i] = g[:5] + (g[5] + scratch,) + g[6:10] + (False,) + g[11:]

    def _plan_xla_ops(self) -> None:
        """Under XLA, add to the per-op plans the buffers XLA makes for the
        gradients (:class:`memsave.xla.XlaModel`): written when the op runs
        (the original's, with its transformed kernel; a copy's kernel is
        made when its step's gate opens, :meth:`_Builder.xla_proxies`) and
        the gradient's temporaries, which differ for a recomputed copy."""
        xm, costs = self.xla_model, self.costs
        self.copy_plans = list(self.copy_plans)
        self.recompute_plans = list(self.copy_plans)
        self.gradient_plans = list(self.gradient_plans)
        self.copy_gradient_plans = list(self.gradient_plans)
        for i in range(len(self.fg.ops)):
            if not costs.gradient[i].has_gradient:
                continue
            kernel = xm.kernel(i)
            forward_early = xm.early(i, recomputed=False) + ((kernel[1],) if kernel else ())
            copy_early = xm.early(i, recomputed=True)
            plan = self.copy_plans[i]
            if forward_early:
                self.xla_forward_of[i] = len(plan[3])
                self.copy_plans[i] = plan[:3] + (plan[3] + forward_early,) + plan[4:]
            if copy_early:
                self.recompute_plans[i] = plan[:3] + (plan[3] + copy_early,) + plan[4:]
            for plans, recomputed in ((self.gradient_plans, False),
                                      (self.copy_gradient_plans, True)):
                g = plans[i]
                scratch = xm.gradient_scratch(i, recomputed=recomputed)
                early = bool(forward_early) or bool(copy_early) or g[4]
                reads = g[3]
                if recomputed:
                    reads = tuple(dict.fromkeys(reads + xm.copy_gradient_reads(i)))
                plans[i] = g[:3] + (reads, early, g[5] + ((scratch,) if scratch else ())) + g[6:]

    def peak_floor(self, schedule: Schedule | None, *, gradients_kept: bool = True) -> int:
        """A lower bound on the forecast peak of ``schedule`` (None: plain
        tf.gradients) without building its program, extra resident bytes
        not included: the most bytes certainly alive at one of these moments.

        * *The turn*, when backprop starts: the resident bytes, the seeds
          (``grad_ys``: made before any gradient runs), and each forward
          buffer a step reads after the turn: what the proxies of a
          recompute step read (its boundary) and what the gradients of a
          backprop step read, for the steps and ops that a gradient reaches
          (:meth:`_floor_tables`; the builder skips the others). Each of
          those buffers is made in the forward pass and read after the
          seeds, so all of them are alive together, and none was written in
          place (its last reader is later).
        * *Each step's gradients about to start*: in a recompute step, once
          its copies have run; in a backprop step, as it starts. Alive then:
          the resident bytes and the seeds Grappler folds (constants); the
          forward buffers later steps read (as at the turn) and those the
          step's gradients read (a boundary tensor's, through its proxy:
          once per buffer, at the smaller of the buffer's and the proxy's
          bytes); the copies the step's gradients read (a new buffer each;
          views and loops' outputs left out); and the gradients in flight:
          every new buffer an earlier step wrote for a boundary tensor whose
          gradient this step or a later one takes in (one per part: the
          parts are summed where they are taken), and the seeds not folded,
          leaving out pass-throughs (which may share a buffer with another
          gradient) and gradients Grappler may fold; and with
          ``gradients_kept`` (the peak every planner compares), one buffer
          per x whose gradient an earlier step wrote (the xs' gradients are
          the step's outputs, alive to its end; an x's parts are summed into
          one buffer at most, and the first part's bytes are no more than
          the sum's). Without it, the xs' are left out (an update may
          consume them as they are written).
          No two of these share a buffer: a buffer written in place takes
          over a value that dies there, and each of them is read later.

        On experiments/bench_planner.py's 1000-op DAG the bytes at those
        moments came to 0.99 of the simulated peak over the plans a budget
        of 0.9 simulated (the turn alone: 0.93): the peak is reached inside
        a step, once its recomputation has run. Under XLA, whose order
        interleaves forward and backward, only the resident bytes.
        tests/test_solvers.py checks it against every decision of its cases.
        """
        if self.fg.xla:
            return self.resident_counted
        if self._floor is None:
            self._floor = self._floor_tables()
        f = self._floor
        counted, buffer_of = self.counted, f.buffer_of
        if schedule is None:  # plain: one backprop stage over every op
            read = set(itertools.chain.from_iterable(f.reads_of))
            read.discard(-1)
            return self.resident_counted + f.seeds + sum([counted[v] for v in read])
        steps = schedule.steps
        n = len(steps)
        step_of: dict[int, int] = {}
        for s, step in enumerate(steps):
            for i in step.ops:
                step_of[i] = s
        flows, runs, producer = f.flows, f.runs, f.producer
        heads_of: list[set[int] | None] = [None] * n
        # Gradients in flight, as changes per step (a part made in step s and
        # taken in step c is alive at the moments of steps s+1 .. c).
        flight = [0] * (n + 1)

        def taken(t: int, s: int) -> int:
            """The step that takes in the gradient tensor ``t`` receives after
            step ``s``, or -1 (none does: the gradient is never read)."""
            p = producer[t]
            c = step_of.get(p, -1) if p >= 0 else -1
            if c <= s or not runs[p]:
                return -1
            if heads_of[c] is None:
                heads_of[c] = set(steps[c].heads)
            return c if t in heads_of[c] else -1

        for y, nbytes in f.open_seeds:
            c = taken(y, -1)
            if c >= 0:
                flight[0] += nbytes
                flight[c + 1] -= nbytes
        # The xs' gradients, kept: the step's outputs, alive to its end (an
        # x's parts are summed into one buffer at most), so one buffer per x
        # is alive at every moment after the step that first writes one.
        x_first: set[int] = set()
        fresh_xs = f.fresh_xs
        reads: list = [()] * n  # the forward buffers each step reads as it starts
        moments: list = [None] * n  # of a recompute step: (its gradients' buffers, copies' bytes)
        grad_reads, fresh = f.grad_reads, f.fresh
        copy_bytes, proxy_bytes = f.copy_bytes, f.proxy_bytes
        for s, step in enumerate(steps):
            boundary = set(step.boundary)
            if step.kind == "recompute":
                if not any(flows[h] for h in step.heads):
                    continue  # the builder skips it
                reads[s] = [buffer_of[t] for t in step.boundary]
                own: dict[int, int] = {}
                copies = 0
                for t in set(itertools.chain.from_iterable(map(grad_reads.__getitem__, step.ops))):
                    if t in boundary:
                        b = buffer_of[t]
                        if b >= 0:
                            nbytes = min(counted[b], proxy_bytes[t])
                            own[b] = min(own.get(b, nbytes), nbytes)
                    elif step_of.get(producer[t]) == s:
                        copies += copy_bytes[t]
                moments[s] = (own, copies)
            else:
                reads[s] = list(itertools.chain.from_iterable(map(f.reads_of.__getitem__,
                                                                   step.ops)))
            for i in step.ops:
                for t, nbytes in fresh[i]:
                    if t in boundary:
                        c = taken(t, s)
                        if c >= 0:
                            flight[s + 1] += nbytes
                            flight[c + 1] -= nbytes
                for t, internal, x, nbytes in fresh_xs[i] if gradients_kept else ():
                    if (internal or t in boundary) and x not in x_first:
                        x_first.add(x)
                        flight[s + 1] += nbytes
        floor = 0
        base = self.resident_counted + f.folded_seeds
        later: set[int] = set()  # forward buffers read after the moment
        later_bytes = 0
        in_flight = list(itertools.accumulate(flight))
        for s in range(n - 1, -1, -1):
            moment = moments[s]
            if moment is not None:
                own, copies = moment
                floor = max(floor, base + later_bytes + copies + in_flight[s]
                            + sum([nbytes for b, nbytes in own.items() if b not in later]))
            for b in reads[s]:
                if b >= 0 and b not in later:
                    later.add(b)
                    later_bytes += counted[b]
            if steps[s].kind != "recompute":
                floor = max(floor, base + later_bytes + in_flight[s])
        return max(floor, self.resident_counted + f.seeds + later_bytes)

    def _floor_tables(self) -> _FloorTables:
        """For :meth:`peak_floor`, whatever the schedule (see :class:`_FloorTables`)."""
        fg, costs, plans = self.fg, self.costs, self.gradient_plans
        tensors, tensor_bytes, counted_of = fg.tensors, costs.tensor_bytes, self.counted_of
        flows = [False] * len(tensors)
        for y in fg.ys:
            flows[y] = True
        for i in range(len(fg.ops) - 1, -1, -1):
            outputs, has_gradient, targets = plans[i][1], plans[i][2], plans[i][8]
            if has_gradient and any(flows[t] for t in outputs):
                for target in targets:
                    flows[target[0]] = True
        runs = [plan[2] and any(flows[t] for t in plan[1]) for plan in plans]
        root = view_roots(self.program[1])
        resident = frozenset(self.program[2])
        buffer_of = [-1 if v < 0 or root[v] in resident else root[v] for v in self.orig]
        reads_of = [tuple(buffer_of[t] for t in plan[3]) if run else ()
                    for plan, run in zip(plans, runs)]
        grad_reads = [plan[3] if run else () for plan, run in zip(plans, runs)]
        # A new buffer per part (targets: tensor, internal, passed-through
        # output, bytes, feeds an x, foldable, in-place candidates).
        fresh = [tuple((t, counted_of[nbytes]) for t, _, k, nbytes, feeds_x, foldable, _ in plan[8]
                       if k is None and not feeds_x and not (plan[9] and foldable))
                 if run else () for plan, run in zip(plans, runs)]
        # The x a tensor's gradient is, as it is written: an x's own, or a
        # read's whose gradient passes the x its incoming one (ReadVariableOp).
        is_x = self.is_x
        x_of = [t if is_x[t] else -1 for t in range(len(tensors))]
        for plan, run in zip(plans, runs):
            if run:
                for x, _, k, *_ in plan[8]:
                    if k is not None and is_x[x]:
                        x_of[plan[1][k]] = x
        fresh_xs = [tuple((t, internal, x_of[t], counted_of[nbytes])
                          for t, internal, k, nbytes, feeds_x, foldable, _ in plan[8]
                          if k is None and feeds_x and x_of[t] >= 0
                          and not (plan[9] and foldable))
                    if run else () for plan, run in zip(plans, runs)]
        producer = [-1 if node.producer is None else node.producer for node in tensors]
        proxy_bytes = [counted_of[nbytes] for nbytes in tensor_bytes]
        copy_bytes = [
            proxy_bytes[t] if p >= 0 and costs.alias_of[t] is None and fg.ops[p].body is None
            and p not in self.loop_figures else 0
            for t, p in enumerate(producer)]
        ys = list(dict.fromkeys(fg.ys))
        seeds = sum(proxy_bytes[y] for y in ys)
        folded_seeds = sum(proxy_bytes[y] for y in ys if self.foldable[y])
        open_seeds = tuple((y, proxy_bytes[y]) for y in ys if not self.foldable[y])
        return _FloorTables(flows, runs, buffer_of, reads_of, grad_reads, fresh, fresh_xs,
                            producer, copy_bytes, proxy_bytes, seeds, folded_seeds, open_seeds)

    def label(self, label: tuple[Event, int]) -> str:
        """An event's name (``"run dense/MatMul"``)."""
        return self._named([label])[0]

    def labels(self, labels: Sequence[tuple[Event, int]]) -> list[str]:
        """The names of the events of a program built on this one (the forward
        pass's events come first: their names are made once)."""
        if self._forward_labels is None:
            self._forward_labels = self._named(self.program[5])
        return self._forward_labels + self._named(labels[len(self._forward_labels):])

    def _named(self, labels: Sequence[tuple[Event, int]]) -> list[str]:
        if self._names is None:
            self._names = ([op.name for op in self.fg.ops],
                           [node.name for node in self.fg.tensors])
        op_names, tensor_names = self._names
        prefix, of_op = _PREFIX, _OF_OP
        return [prefix[kind] + (op_names if kind in of_op else tensor_names)[ref]
                for kind, ref in labels]


#: The last reader of a value that outlives the step (resident, or one of its outputs).
_NEVER = 1 << 62

_PREFIX = {kind: kind.value for kind in Event}
_OF_OP = frozenset(kind for kind in Event if kind.of_op)


class _Counted(dict):
    """Bytes an allocator counts, per buffer size (a graph has few distinct sizes)."""

    def __init__(self, allocator: Allocator) -> None:
        super().__init__()
        self.allocator = allocator

    def __missing__(self, nbytes: int) -> int:
        found = self[nbytes] = self.allocator.counted(nbytes)
        return found


def side_by_side_loops(fg: ForwardGraph) -> dict[int, tuple[int, ...]]:
    """Per loop op of ``fg``, the other loops that neither read its results
    nor give it theirs (directly or through other ops): the executor runs
    such loops side by side, forward and backward, each holding its trip's
    values while the other's run. Measured on a ``Bidirectional(LSTM(128))``
    (T=128, batch 1024, both halves' gradients in chunks of 6 trips kept
    whole): 89.8 MiB above resident with two inter-op threads (66.5 with
    one); forecast 90.5 so, 68.2 one after the other."""
    loops = [i for i, op in enumerate(fg.ops) if op.body is not None and op.body.loop]
    if len(loops) < 2:
        return {}
    bit = {i: 1 << n for n, i in enumerate(loops)}
    upstream = [0] * len(fg.tensors)  # tensor -> the loops it is computed from (a bit set)
    reach = {}
    for i, op in enumerate(fg.ops):
        mask = 0
        for t in op.inputs:
            mask |= upstream[t]
        if i in bit:
            reach[i] = mask
            mask |= bit[i]
        for t in op.outputs:
            upstream[t] = mask
    return {i: side for i in loops
            if (side := tuple(j for j in loops if j != i and not reach[j] & bit[i]
                              and not reach[i] & bit[j]))}


def view_roots(alias: Sequence[int]) -> list[int]:
    """Per value of a program, the value whose buffer it is on through views
    (``alias``: the value each one views, or -1; a view comes after what it
    views), itself when it views nothing. In-place writes are not followed:
    the replay decides those."""
    root = list(range(len(alias)))
    for v, a in enumerate(alias):
        if a >= 0:
            root[v] = root[a]
    return root


def copies_that_run(fg: ForwardGraph, costs: Costs):
    """The rule for which op copies of a recompute step run, as a function ``ops -> ops``.

    Those a gradient reads (through other copies), and calls and loops
    whose gradient keeps what they compute, and ops with gradient values
    computed in the forward pass; the rest (the copy of the loss itself,
    say) feed nothing that is fetched, and TensorFlow prunes them. Built
    once per graph; the simulator and the time model read the same rule.
    """
    needs = [ins + outs for ins, outs in costs.gradient_reads]
    for i, extra in copy_gradient_reads(fg, costs).items():  # (XLA only)
        needs[i] += extra
    always = [(op.body is not None and bool(op.body.saved)) or bool(use.early_bytes)
              for op, use in zip(fg.ops, costs.gradient)]
    inputs = [op.inputs for op in fg.ops]
    outputs = [op.outputs for op in fg.ops]

    def run(ops: Sequence[int]) -> list[int]:
        need = set(itertools.chain.from_iterable(map(needs.__getitem__, ops)))
        live = []
        for i in reversed(ops):
            if always[i] or not need.isdisjoint(outputs[i]):
                live.append(i)
                need.update(inputs[i])
        live.reverse()
        return live

    return run


def forward_program(fg: ForwardGraph, costs: Costs,
                    model: MemoryModel = MemoryModel()) -> ForwardProgram:
    """The schedule-independent forward program of ``fg`` (for ``simulate(forward=)``)."""
    with paused_gc():
        return ForwardProgram(fg, costs, model)


def _forward_of(fg: ForwardGraph, costs: Costs, model: MemoryModel,
                forward: ForwardProgram | None) -> ForwardProgram:
    if forward is None:
        return ForwardProgram(fg, costs, model)
    if forward.fg is not fg or forward.costs is not costs or forward.model != model:
        raise ArgumentError(
            "memsave.simulate: forward= was built for another graph, costs or memory model")
    return forward


def _build(fg: ForwardGraph, schedule: Schedule | None, costs: Costs, model: MemoryModel,
           forward: ForwardProgram | None = None) -> tuple[_Program, int, int]:
    """The program of ``schedule``, the bytes resident before the step, and
    the index of the first backward instruction."""
    return _build_program(_forward_of(fg, costs, model, forward), schedule)


def _build_program(forward: ForwardProgram, schedule: Schedule | None) -> tuple[_Program, int, int]:
    fg, costs = forward.fg, forward.costs
    b = _Builder(forward)
    b.restore()
    p = b.p
    cur = b.orig  # tensor id -> the value read for it (a recompute step's copies and proxies)
    orig = forward.orig
    if schedule is not None:
        # TensorFlow adds what a call's or loop's gradient keeps (the forward
        # function's extra outputs, while_v2's accumulators) only to the op
        # it differentiates: an original whose copy is differentiated keeps
        # nothing.
        differentiated = {i for step in schedule.steps if step.kind == "backprop" for i in step.ops}
        for i, v in b.saved_of.items():
            if i not in differentiated:
                p.size[v] = 0
        if fg.xla:
            # An op whose gradient a recompute step takes on its copy makes
            # its XLA values (memsave.xla) in that step, not in the forward pass.
            for step in schedule.steps:
                if step.kind == "recompute":
                    for i in step.ops:
                        start = forward.xla_forward_of.get(i)
                        if start is not None:
                            for v in b.early_of[i][start:]:
                                p.size[v] = 0
    backward_start = len(p.reads)

    # Seeds: grad_ys = ones_like(y), a folded constant when y's shape is static.
    # (Under XLA memsave's seeds read the ys, memsave.rewrite._after_forward.)
    xla_seeds = fg.xla and schedule is not None
    for y in dict.fromkeys(fg.ys):
        if forward.foldable[y] and not xla_seeds:
            v = b.constant_value(y)
        else:
            v = p.value(costs.tensor_bytes[y])
            p.instr((Event.SEED, y), [orig[y]] if xla_seeds else [], [(v, ())])
        b.grads.setdefault(y, []).append(v)

    if schedule is None:
        b.backward(range(len(fg.ops)), cur, set(fg.ys), set(fg.xs),
                   ordered=forward.loops_prepared)
    else:
        grads, constant = b.grads, b.constant
        for step in schedule.steps:
            heads = set(step.heads)
            boundary = set(step.boundary)
            if step.kind == "backprop":
                b.backward(step.ops, cur, heads, boundary)
                continue
            if not any(grads.get(h) for h in step.heads):
                continue
            gated = set(step.gated)
            if not fg.xla and all(g in constant for h in step.heads for g in grads.get(h, ())):
                # The heads' gradients are constants (the seeds ones_like(y)):
                # Grappler folds the gate to 0 and ``t + 0`` into an Identity
                # (step stats: the first step's gated proxy of a U-Net's 3 MiB
                # concat ran as Identity, allocating nothing).
                gated = set()
            touched: list[int] = []  # tensors whose value is the step's own
            if fg.xla:
                b.xla_proxies(step, cur, touched)
                b.run_ops(forward.needed_copies(step.ops), cur, boundary, touched)
                for i, v in b.xla_kernels.items():
                    b.early_of[i] = b.early_of.get(i, []) + [v]
                b.backward(step.ops, cur, heads, boundary, recomputed=True)
            else:
                b.proxies(step.boundary, gated, cur, touched)
                b.run_ops(forward.needed_copies(step.ops), cur, boundary, touched)
                b.backward(step.ops, cur, heads, boundary)
            for t in touched:
                cur[t] = orig[t]
    # The xs' gradients are the step's outputs.
    grads, pinned = b.grads, p.pinned
    for x in dict.fromkeys(fg.xs):
        got = grads.pop(x, None)
        if got:
            pinned.append(got[0] if len(got) == 1 else b.accumulate(x, got))
    return p, b.resident_bytes, backward_start


def simulate(
    fg: ForwardGraph,
    schedule: Schedule | None,
    costs: Costs,
    *,
    model: MemoryModel = MemoryModel(),
    timeline: bool = True,
    forward: ForwardProgram | None = None,
    gradients_kept: bool = True,
    extra_resident_bytes: int = 0,
) -> MemoryTrace:
    """Forecast the allocator peak of one step: forward and gradients.

    Parameters
    ----------
    fg : ForwardGraph
    schedule : Schedule or None
        The checkpointed backward pass, or None for plain ``tf.gradients``.
    costs : Costs
        From :func:`memsave.costs.estimate_costs` on the same ``fg``.
    model : MemoryModel
        The memory model's settings (the allocator among them:
        :data:`CPU_ONEDNN` by default, :data:`BFC` for a GPU).
    timeline : bool
        Record the bytes alive after every event (off for solvers that only
        need the peak).
    forward : ForwardProgram, optional
        :func:`forward_program` of ``fg``, ``costs`` and ``model``, built
        once for many simulations of one graph (the same result, less work).
    gradients_kept : bool
        True (default): the xs' gradients are the step's outputs, alive to
        its end. False: the gradients of the xs (and of their reads, e.g.
        ReadVariableOp outputs, which pass them through) cost nothing, as
        when an optimizer update in the same step consumes each one as it
        is written (the executor runs a variable's update as soon as its
        gradient is ready; XLA reuses the buffer). The peak is then the
        working memory that the choice of checkpoints controls: with the
        gradients kept, the peak of a chain whose weights outweigh its
        activations is at the end of the step and the same for every plan.
        (A weight read by several segments has its parts summed; counting
        them as free makes this an estimate for such weights.)
    extra_resident_bytes : int
        Bytes the step holds besides what the graph reads (an optimizer's
        slots, metric state), resident from start to end: counted in every
        figure of the trace.

    Returns
    -------
    MemoryTrace

    Examples
    --------
    >>> from memsave.costs import estimate_costs
    >>> trace = simulate(fg, None, estimate_costs(fg))  # doctest: +SKIP
    >>> trace.peak_bytes  # doctest: +SKIP
    """
    with paused_gc():
        return _simulate(fg, schedule, costs, model, timeline, forward, gradients_kept,
                         extra_resident_bytes)


@contextlib.contextmanager
def paused_gc():
    """Pause Python's cyclic garbage collector for a burst of allocations.

    Building and replaying a program allocates tens of thousands of small
    lists and tuples, and the rewrite thousands of TensorFlow objects, which
    trigger full collections; in a process holding a TensorFlow graph each
    one walks every Python object of that graph (measured: a third of
    ``memsave.plan``'s time on a 1000-op chain). What memsave builds holds
    no cycles for the collector to find: it runs again, if it must, after
    the burst. Its previous state is restored on exit; works as a decorator.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _simulate(fg, schedule, costs, model, timeline, forward, gradients_kept,
              extra_resident_bytes) -> MemoryTrace:
    forward = _forward_of(fg, costs, model, forward)
    return _traced(forward, schedule, timeline, gradients_kept, extra_resident_bytes)[2]


def program_and_timeline(forward: ForwardProgram, schedule: Schedule | None, *,
                         extra_resident_bytes: int = 0) -> tuple[_Program, int, MemoryTrace]:
    """``(program, backward_start, trace)`` of ``schedule``: the program the
    simulator replays (the index of its first backward instruction) and the
    trace :func:`simulate` gives with ``timeline=True``, from one build, for
    a planner that reads both (:mod:`memsave.planners.dp`)."""
    with paused_gc():
        return _traced(forward, schedule, True, True, extra_resident_bytes)


def _traced(forward: ForwardProgram, schedule, timeline, gradients_kept, extra_resident_bytes):
    p, _, backward_start = _build_program(forward, schedule)
    if forward.fg.xla:
        # With the update in the compiled step, each gradient is consumed by
        # its update (MemoryModel.xla_update_in_step): as gradients_kept=False;
        # a float16 graph's loss scale holds them to the end by default.
        consumed = forward.model.xla_updates_consume_gradients(forward.fg.computes_in_float16())
        trace = _replay_xla(forward, p, backward_start, timeline,
                            gradients_kept and not consumed, extra_resident_bytes)
    else:
        trace = _replay(forward, p, backward_start, timeline, gradients_kept,
                        extra_resident_bytes)
    return p, backward_start, trace


def _replay(forward: ForwardProgram, p: _Program, backward_start: int, timeline: bool,
            gradients_kept: bool, extra_resident_bytes: int) -> MemoryTrace:
    """The trace of program ``p`` (built from ``forward``).

    The same as replaying it event by event with reference counts (each
    value holds its buffer from its write to its last reader; a buffer is
    freed with its last holder; a new value goes in place into a candidate's
    buffer when the candidate's last reader is this instruction, it is the
    buffer's only holder left and the sizes match), but each buffer is
    settled once: the in-place test reads, per buffer, the latest last
    reader of the values on it so far (``top``, read by ``top_value``) and
    the latest of the others (``second``). The candidate is the only holder
    left when it is ``top_value`` and ``second`` is before this instruction.
    """
    reads, writes, size, alias, lists = p.reads, p.writes, p.size, p.alias, p.lists
    n_instr = len(reads)
    n_val = len(size)
    # Each value's last reader, or where it is made if nothing reads it: the
    # forward pass's are known, the backward's readers come after them.
    n_forward = len(forward.last)
    last = forward.last + [-1] * (n_val - n_forward)
    for k in range(backward_start, n_instr):
        for v, _ in writes[k]:
            last[v] = k
        for r in reads[k]:
            last[r] = k
    if gradients_kept:
        for v in p.pinned:
            last[v] = _NEVER  # the step's outputs: alive after it
    counted_of = forward.counted_of
    counted = forward.counted + list(map(counted_of.__getitem__, size[n_forward:]))
    # Bytes made at each instruction, minus those freed before it (the
    # forward's new buffers made).
    delta = forward.made_bytes + [0] * (n_instr + 1 - backward_start)
    for v, k in forward.saved_at.items():
        counted[v] = counted_of[size[v]]  # (zero when its op's copy is differentiated)
        delta[k] += counted[v] - forward.counted[v]
    if not gradients_kept:
        for v in p.xs_grads:
            counted[v] = 0  # consumed by the update as soon as written
    # The resident values (the forward's, then the folded constants of the
    # backward) are alive before and after the step.
    resident = p.resident_ids
    for v in resident:
        last[v] = _NEVER
    alive = extra_resident_bytes + forward.resident_counted
    for v in resident[len(forward.program[2]):]:
        alive += counted[v]

    # Buffers: a value is a new buffer, or a view of another value's buffer,
    # or written into a candidate's buffer (in place) when that candidate
    # dies here and is the only value still on it. A buffer lives from the
    # instruction that makes it to the last reader of any value on it.
    # ``top`` is that last reader so far, ``top_value`` the value it reads,
    # ``second`` the latest last reader of the other values on it. (A
    # resident buffer's top is _NEVER: none of its values is written into.)
    root = forward.replay_root + forward.identity(n_forward, n_val)
    top = last[:]
    top_value = forward.identity(0, n_val)
    second = [-1] * n_val
    buffers = []
    for k, ws in enumerate(itertools.chain(forward.replay_writes, writes[backward_start:])):
        for v, cands in ws:
            a = alias[v]
            if a < 0:
                for c in cands:
                    r = root[c]
                    if last[c] == k and top_value[r] == c and second[r] < k:
                        if size[r] == size[v]:
                            if a < 0:
                                a = c
                        elif size[v] < size[r] and r not in lists:  # a row slice (module docstring, 2.)
                            a = c
                            break
                if a < 0:
                    delta[k] += counted[v]
                    buffers.append(v)
                    continue
            r = root[v] = root[a]
            t = last[v]
            if t > top[r]:
                second[r] = top[r]
                top[r] = t
                top_value[r] = v
            elif t > second[r]:
                second[r] = t
    for r in itertools.chain(forward.new_buffers, buffers):
        t = top[r]
        if t < n_instr:
            delta[t + 1] -= counted[r]
    if p.early_ids:
        # Made when the step starts (_Builder.early_value), whatever
        # instruction the program writes them at.
        early = set(p.early_ids)
        for k in range(backward_start, n_instr):
            for v, _ in writes[k]:
                if v in early:
                    delta[k] -= counted[v]
                    delta[0] += counted[v]
    events = list(itertools.accumulate(delta, initial=alive))[1:]
    end = events.pop()  # after the last instruction
    peak = max(events, default=alive)
    if peak > alive:
        peak_k = events.index(peak)
    else:
        peak, peak_k = alive, -1
    return MemoryTrace(
        peak_bytes=peak,
        resident_bytes=alive,
        timeline=tuple(zip(events, forward.labels(p.labels))) if timeline else (),
        peak_event=forward.label(p.labels[peak_k]) if peak_k >= 0 else "start",
        backward_start=backward_start,
        end_bytes=end,
    )


def _replay_xla(forward: ForwardProgram, p: _Program, backward_start: int, timeline: bool,
                gradients_kept: bool, extra_resident_bytes: int) -> MemoryTrace:
    """:func:`_replay` of a program XLA compiles: its instructions run
    breadth-first (:func:`memsave.xla.breadth_first_order`), forward and
    backward interleaved, so the replay goes event by event with reference
    counts (the same rules, none of the forward program's precomputed order)."""
    order = breadth_first_order(p.reads, p.writes, len(p.size))
    reads = [p.reads[k] for k in order]
    writes = [p.writes[k] for k in order]
    labels = [p.labels[k] for k in order]
    backward_start = next((j for j, k in enumerate(order) if k >= backward_start), len(order))
    size, alias = p.size, p.alias
    n_instr, n_val = len(reads), len(size)
    # Each value's last reader, or where it is made if nothing reads it.
    last = [-1] * n_val
    for k, ws in enumerate(writes):
        for v, _ in ws:
            last[v] = k
    for k, rs in enumerate(reads):
        for r in rs:
            last[r] = k
    if gradients_kept:
        for v in p.pinned:
            last[v] = n_instr  # past the last instruction: the step's outputs
    resident = p.resident_ids
    for v in resident:
        last[v] = n_instr  # alive before and after the step
    dying: list[list[int]] = [[] for _ in range(n_instr)]
    for v, k in enumerate(last):
        if 0 <= k < n_instr:
            dying[k].append(v)
    # XLA places the step's temporaries in one allocation (the buffer
    # assignment's "preallocated-temp"), so each counts whole, however small
    # (the CPU allocator leaves out buffers under 256 KiB: measured on
    # MobileNetV2's loss-scaled step, 2.6 of the 60.4 MiB at XLA's peak);
    # the resident tensors and the step's outputs are the allocator's own.
    counted_of = forward.counted_of
    counted = list(size)
    for v in (*resident, *p.pinned):
        counted[v] = counted_of[size[v]]
    if not gradients_kept:
        for v in p.xs_grads:
            counted[v] = 0  # consumed by the update as soon as written
    # A view holds a reference to its buffer's root; a buffer is freed when
    # the last value on it (base or view) has had its last reader.
    root = list(range(n_val))
    refs = [0] * n_val
    alive = extra_resident_bytes
    for v in resident:
        refs[v] = 1 << 30
        alive += counted[v]
    resident_counted = alive
    peak, peak_k = alive, -1
    events: list[int] = []
    for k, dies in enumerate(dying):
        for v, cands in writes[k]:
            a = alias[v]
            if a >= 0:
                r = root[a]
                root[v] = r
                refs[r] += 1
                continue
            for c in cands:
                r = root[c]
                # (No row slices under XLA: OpNode.views_input is None there.)
                if last[c] == k and refs[r] == 1 and size[r] == size[v]:
                    root[v] = r
                    refs[r] += 1
                    break
            else:
                refs[v] = 1
                alive += counted[v]
        if alive > peak:
            peak, peak_k = alive, k
        events.append(alive)
        for v in dies:
            r = root[v]
            refs[r] -= 1
            if not refs[r]:
                alive -= counted[r]
    return MemoryTrace(
        peak_bytes=peak,
        resident_bytes=resident_counted,
        timeline=tuple(zip(events, forward._named(labels))) if timeline else (),
        peak_event=forward.label(labels[peak_k]) if peak_k >= 0 else "start",
        backward_start=backward_start,
        end_bytes=alive,
    )
