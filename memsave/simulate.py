"""The one memory model: simulate what the TensorFlow executor keeps alive.

Data flow: ``simulate(fg, schedule, costs)`` turns the forward graph and a
:class:`~memsave.schedule.Schedule` (or None for plain ``tf.gradients``)
into a straight-line *program* of buffer reads and writes, then replays it
once with reference counts, as the executor frees a tensor when its last
reader has run. It returns a :class:`MemoryTrace`: the allocator peak, the
bytes resident before the step, and the timeline of bytes alive during each
event. Every strategy, the Plan, the no-saving warning and the budget
solvers read this one function; nothing here touches TensorFlow.

The program
-----------
1. Resident: the xs' variables and the inputs (sources and external
   tensors) are alive from the start to the end, and so are the gradients
   Grappler folds into constants (``MemoryModel.constant_folding_max_bytes``).
2. Forward: every op in topological order allocates its outputs, except
   views (:data:`memsave.costs.ALIAS_OP_TYPES`) and elementwise ops writing
   into an input that dies there (:data:`memsave.costs.INPLACE_OP_TYPES`).
   A tensor dies after its last reader; a tensor some gradient reads
   (``Costs.gradient``) is read by that gradient, so it lives until then.
3. Backward, one stage per step of the schedule (plain backprop is one
   ``backprop`` stage over every op): a ``recompute`` step makes fresh
   proxies of its boundary (``t + gate`` for the tensors the schedule
   gates, ``Step.gated``: a new buffer unless the original dies there;
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
   (:func:`memsave.bodies.body_figures`).

The settings come as one value, a :class:`~memsave.memory_model.MemoryModel`:
its allocator decides what a byte costs (oneDNN's CPU allocator does not
report allocations under 256 KiB; the BFC allocator of GPUs counts
everything, rounded up to 256 bytes), and it says how far a weight's
gradient kernel overlaps the next gradient and what Grappler folds.

Notes
-----
Building and replaying the program is linear in ops plus tensors: one pass
to build, one to find each value's last reader, one to replay. Ops run in
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
from collections.abc import Sequence

from memsave.bodies import body_figures
from memsave.costs import Costs
from memsave.errors import ArgumentError
from memsave.graph import ForwardGraph
from memsave.memory_model import BFC, CPU_ONEDNN, Allocator, MemoryModel
from memsave.schedule import Schedule
from memsave.xla import XlaModel, breadth_first_order

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

    __slots__ = ("size", "alias", "resident", "reads", "writes", "labels", "pinned", "xs_grads",
                 "lingering")

    def __init__(self) -> None:
        self.size: list[int] = []
        self.alias: list[int] = []  # value it views, or -1
        self.resident: list[bool] = []
        self.reads: list[list[int]] = []
        self.writes: list[list[tuple[int, tuple[int, ...]]]] = []
        self.labels: list[tuple] = []
        self.pinned: list[int] = []
        self.xs_grads: list[int] = []  # gradients of the xs and of their reads
        # (allocating instructions left, values): values still read by a
        # kernel that runs beside the next instructions (weight_gradient_overlap).
        self.lingering: list[tuple[int, list[int]]] = []

    def value(self, size: int, alias: int = -1, resident: bool = False) -> int:
        self.size.append(size)
        self.alias.append(alias)
        self.resident.append(resident)
        return len(self.size) - 1

    def instr(self, label: tuple, reads: list[int], writes: list[tuple[int, tuple[int, ...]]],
              kernels: bool = False) -> None:
        """Append an instruction. ``kernels``: each new buffer it writes is
        the output of a kernel of its own (an op's input gradients)."""
        if self.lingering and any(self.alias[v] < 0 for v, _ in writes):
            # A kernel that writes a buffer: the one run beside the lingering one.
            ending = [v for left, values in self.lingering if left == 1 for v in values]
            going = [v for left, values in self.lingering if left > 1 for v in values]
            self.lingering = [(left - 1, values) for left, values in self.lingering if left > 1]
            new = [w for w in writes if self.alias[w[0]] < 0 and not w[1]]
            if ending and kernels and len(new) > 1:
                # An op's gradient writing several new buffers is one kernel
                # each (a concat's: one Slice per input); the lingering kernel
                # runs beside the first (the largest, as the worst case).
                first = max(new, key=lambda w: self.size[w[0]])
                self.reads.append(reads + ending + going)
                self.writes.append([first])
                self.labels.append(label)
                writes = [w for w in writes if w is not first]
                ending = []
            reads = reads + ending + going
        elif self.lingering:
            reads = reads + [v for _, values in self.lingering for v in values]
        self.reads.append(reads)
        self.writes.append(writes)
        self.labels.append(label)


class _Builder:
    """Builds the program of one step (see module docstring)."""

    def __init__(self, fg: ForwardGraph, costs: Costs, model: MemoryModel,
                 forward: ForwardProgram | None = None) -> None:
        self.fg = fg
        self.costs = costs
        self.model = model
        self.saved_of: dict[int, int] = {}  # op with a body -> what its gradient keeps
        self.early_of: dict[int, list[int]] = {}  # op -> gradient values run in the forward
        self.p = _Program()
        self.grads: dict[int, list[int]] = {}  # tensor id -> gradient values received
        self.orig: list[int] = [-1] * len(fg.tensors)
        self.resident_bytes = 0
        self.constant: set[int] = set()  # gradient values Grappler folds into constants
        self.xs = set(fg.xs)
        # Under XLA: what the compiled step holds besides (memsave.xla): where
        # in an op's early values its forward run put XLA's, each op's
        # transformed kernel, and whether a recompute step's copies are
        # being differentiated.
        self.xla_forward_of: dict[int, tuple[int, int]] = {}
        self.xla_kernel_of: dict[int, int] = {}
        self.recomputing = False
        if forward is not None:  # the state after its forward pass (which it built once)
            self.feeds_x = forward.feeds_x
            self.gradient_targets = forward.gradient_targets
            self.xla_model = forward.xla_model
            forward.restore(self)
            return
        self.xla_model = XlaModel(fg, costs) if fg.xla else None
        # An x, or the read of one (an op whose inputs are all xs, e.g.
        # ReadVariableOp): its gradient is the x's, passed through.
        self.feeds_x = [
            node.id in self.xs or (node.producer is not None and bool(fg.ops[node.producer].inputs)
                              and all(u in self.xs for u in fg.ops[node.producer].inputs))
            for node in fg.tensors
        ]
        for node in fg.tensors:
            if node.kind != "internal":
                self.orig[node.id] = self.p.value(costs.tensor_bytes[node.id], resident=True)
                self.resident_bytes += costs.tensor_bytes[node.id]

    # -- forward ----------------------------------------------------------

    def run_op(self, i: int, vmap, phase: Event) -> None:
        fg, costs, p = self.fg, self.costs, self.p
        op = fg.ops[i]
        reads = [vmap(t) for t in op.inputs]
        writes = []
        lists = -1
        if op.body is not None:
            figures = body_figures(op.body, self.model)
            # What the gradient keeps (alive until it runs), what the loop's
            # TensorLists hold (alive while the lists are), and the body's
            # own transient peak (freed when the op ends).
            saved = p.value(figures.saved_bytes)
            self.saved_of[i] = saved
            lists = p.value(figures.stored_bytes)
            writes += [(saved, ()), (lists, ()), (p.value(figures.forward_bytes), ())]
        early = costs.gradient[i].early_bytes
        if self.xla_model is not None:
            # What XLA makes for the gradient when the op runs (memsave.xla).
            xla_early = self.xla_model.early(i, recomputed=phase is Event.RECOMPUTE)
            if xla_early and phase is Event.FORWARD:
                self.xla_forward_of[i] = len(early), len(xla_early)
            early = early + xla_early
            kernel = self.xla_model.kernel(i) if phase is Event.FORWARD else None
            if kernel is not None:
                self.xla_kernel_of[i] = p.value(kernel[1])
                writes.append((self.xla_kernel_of[i], ()))
        if early and costs.gradient[i].has_gradient:
            # Gradient values computed from this op's values alone: they run
            # right after it and wait for its gradient.
            values = [p.value(b) for b in early]
            self.early_of[i] = values
            writes += [(v, ()) for v in values]
        if costs.scratch and costs.scratch[i]:
            # The kernel's temporaries (freed when it ends): one per operand.
            writes += [(p.value(costs.tensor_bytes[t]), ()) for t in op.inputs]
        for t in op.outputs:
            src = costs.alias_of[t]
            if lists >= 0 and self.fg.tensors[t].dtype == "variant":
                writes.append((p.value(costs.tensor_bytes[t], alias=lists), ()))
                self.bind(t, writes[-1][0])
                continue
            if src is not None:
                v = p.value(costs.tensor_bytes[t], alias=vmap(src))
                writes.append((v, ()))
            else:
                v = p.value(costs.tensor_bytes[t])
                cands = ()
                if costs.inplace[i]:
                    cands = tuple(r for r, t_in in zip(reads, op.inputs)
                                  if costs.tensor_bytes[t_in] == costs.tensor_bytes[t])
                writes.append((v, cands))
            self.bind(t, v)
        p.instr((phase, i), reads, writes)

    # -- backward ---------------------------------------------------------

    def backward(self, ops: Sequence[int], vmap, heads, boundary) -> None:
        """Differentiate ``ops`` (reverse order). Gradients of ``heads`` come
        from (and of ``boundary`` go to) ``self.grads``; others stay local."""
        fg, costs, p = self.fg, self.costs, self.p
        # Hot loop (every op of every simulated plan): names bound once.
        tensors, gradient, tensor_bytes, inplace = fg.tensors, costs.gradient, costs.tensor_bytes, costs.inplace
        grads, xs, constant, feeds_x = self.grads, self.xs, self.constant, self.feeds_x
        size = p.size
        local: dict[int, list[int]] = {}
        for i in reversed(ops):
            op = fg.ops[i]
            use = gradient[i]
            out_grads: list[int | None] = []
            any_grad = False
            for t in op.outputs:
                got = local.pop(t, [])
                if t in heads or t in xs:
                    got += grads.pop(t, [])
                if not got:
                    out_grads.append(None)
                    continue
                g = got[0] if len(got) == 1 else self.accumulate(t, got)
                if t in xs:
                    # An x produced in the graph (an activation given as x):
                    # its gradient is a result of the step and flows on.
                    grads[t] = [g]
                out_grads.append(g)
                any_grad = True
            if not any_grad or not use.has_gradient:
                continue
            inputs, n_in = op.inputs, len(op.inputs)
            reads = [g for g in out_grads if g is not None]
            read_ins, read_outs = costs.gradient_reads[i]
            reads += [vmap(t) for t in read_ins]
            reads += [vmap(t) for t in read_outs]
            if i in self.early_of:
                reads += self.early_of[i]
            if i in self.xla_kernel_of:
                reads.append(self.xla_kernel_of[i])
            writes = []
            if costs.scratch and costs.scratch[i]:
                # Each input's gradient is a kernel of the same type, run one
                # after the other: temporaries of the incoming gradient and
                # the other operand, the largest input at most.
                writes.append((p.value(max(tensor_bytes[t] for t in op.outputs)), ()))
                writes.append((p.value(max((tensor_bytes[t] for t in inputs), default=0)), ()))
            if self.xla_model is not None:
                scratch = self.xla_model.gradient_scratch(i, recomputed=self.recomputing)
                if scratch:
                    writes.append((p.value(scratch), ()))
            if op.body is not None:
                if i in self.saved_of:
                    reads.append(self.saved_of[i])
                if op.body.loop:
                    # The gradient loop sums a loop invariant's gradient from
                    # zeros_like(it): a constant Grappler folds when the shape is static.
                    # while_v2 differentiates every floating loop input, used or not.
                    for j in op.body.invariant:
                        t = inputs[j] if j < n_in else None
                        if (t is not None and tensors[t].trainable
                                and tensors[t].dtype not in ("resource", "variant")
                                and self.foldable(t)):
                            self.constant_value(t)
                writes.append((p.value(body_figures(op.body, self.model).backward_bytes), ()))
            to_weight = flows_on = False
            aliases = use.aliases
            folded = None  # whether Grappler folds this gradient (computed when first asked)
            for j, t, internal in self.gradient_targets[i]:
                if not internal and t not in boundary:
                    continue
                k = aliases[j] if j < len(aliases) else None
                if k is not None and out_grads[k] is not None:
                    v = p.value(tensor_bytes[t], alias=out_grads[k])
                    writes.append((v, ()))
                    if out_grads[k] in constant:
                        constant.add(v)
                else:
                    if folded is None:
                        folded = (not use.reads_outputs
                                  and all(tensors[inputs[j]].constant for j in use.reads_inputs
                                          if j < n_in)
                                  and all(g in constant for g in out_grads if g is not None))
                    if folded and self.foldable(t):
                        v = self.constant_value(t)
                    else:
                        v = p.value(tensor_bytes[t])
                        cands = ()
                        if inplace[i]:
                            cands = tuple(r for r in reads if size[r] == tensor_bytes[t])
                        writes.append((v, cands))
                (grads if t in boundary else local).setdefault(t, []).append(v)
                if feeds_x[t]:
                    p.xs_grads.append(v)
                    to_weight = True
                else:
                    flows_on = True
            # A call's or loop's gradient, or a kernel's temporaries, are not
            # one kernel per buffer.
            p.instr((Event.GRADIENT, i), reads, writes,
                    kernels=op.body is None and not (costs.scratch and costs.scratch[i]))
            overlap = self.model.weight_gradient_overlap
            if to_weight and flows_on and overlap and not fg.xla:
                # The weight's gradient kernel (Conv2DBackpropFilter, the
                # MatMul of x^T and dy) is ready with the input's, but nothing
                # downstream waits for it: the executor runs it beside the
                # next gradient ops, which allocate while it still holds what
                # it reads (the layer's input, the incoming gradient).
                p.lingering.append((overlap, reads))

    def foldable(self, t: int) -> bool:
        return (self.fg.tensors[t].size_known
                and self.costs.tensor_bytes[t] <= self.model.constant_folding_max_bytes)

    def constant_value(self, t: int) -> int:
        """A gradient Grappler folds: resident from before the step."""
        v = self.p.value(self.costs.tensor_bytes[t], resident=True)
        self.constant.add(v)
        self.resident_bytes += self.costs.tensor_bytes[t]
        return v

    def accumulate(self, t: int, got: list[int]) -> int | None:
        if not got:
            return None
        if len(got) == 1:
            return got[0]
        if all(g in self.constant for g in got) and self.foldable(t):
            return self.constant_value(t)
        v = self.p.value(self.costs.tensor_bytes[t])
        self.p.instr((Event.SUM, t), list(got), [(v, tuple(got))])
        return v

    def bind(self, t: int, v: int) -> None:
        pass  # replaced per stage


class ForwardProgram:
    """The builder's state after the forward pass, which every schedule of one graph shares.

    Build it once (:func:`forward_program`) and pass it to :func:`simulate`
    as ``forward=`` to simulate many schedules of one graph (a planner's
    candidate plans, the budget solvers) without rebuilding it;
    :class:`memsave.problem.Problem` keeps one per memory model.
    """

    def __init__(self, fg: ForwardGraph, costs: Costs, model: MemoryModel) -> None:
        b = _Builder(fg, costs, model)
        orig = b.orig

        def bind_orig(t: int, v: int) -> None:
            orig[t] = v

        b.bind = bind_orig
        for i in range(len(fg.ops)):
            b.run_op(i, orig.__getitem__, Event.FORWARD)
        self.fg, self.costs, self.model = fg, costs, model
        p = b.p
        # Instruction lists are never changed once made: shared, not copied.
        self.program = (list(p.size), list(p.alias), list(p.resident), list(p.reads),
                        list(p.writes), list(p.labels))
        self.orig = list(b.orig)
        self.feeds_x = b.feeds_x
        # Per op, (position, tensor, internal) of the inputs its gradient writes.
        internal = [node.kind == "internal" for node in fg.tensors]
        self.gradient_targets = [tuple((j, t, internal[t]) for j, t in targets)
                                 for targets in costs.gradient_targets]
        self.saved_of = dict(b.saved_of)
        self.early_of = dict(b.early_of)
        self.resident_bytes = b.resident_bytes
        self.constant = set(b.constant)
        self.xla_model = b.xla_model
        self.xla_forward_of = dict(b.xla_forward_of)
        self.xla_kernel_of = dict(b.xla_kernel_of)

    def restore(self, b: _Builder) -> None:
        """Put ``b`` (fresh, for the same graph) in the state after the forward pass."""
        p = b.p
        p.size, p.alias, p.resident, p.reads, p.writes, p.labels = (list(x) for x in self.program)
        b.orig[:] = self.orig
        b.saved_of = dict(self.saved_of)
        b.early_of = dict(self.early_of)
        b.resident_bytes = self.resident_bytes
        b.constant = set(self.constant)
        b.xla_forward_of = self.xla_forward_of
        b.xla_kernel_of = dict(self.xla_kernel_of)


def forward_program(fg: ForwardGraph, costs: Costs,
                    model: MemoryModel = MemoryModel()) -> ForwardProgram:
    """The schedule-independent forward program of ``fg`` (for ``simulate(forward=)``)."""
    with paused_gc():
        return ForwardProgram(fg, costs, model)


def _build(fg: ForwardGraph, schedule: Schedule | None, costs: Costs, model: MemoryModel,
           forward: ForwardProgram | None = None) -> tuple[_Program, int, int]:
    if forward is None:
        forward = ForwardProgram(fg, costs, model)
    elif forward.fg is not fg or forward.costs is not costs or forward.model != model:
        raise ArgumentError(
            "memsave.simulate: forward= was built for another graph, costs or memory model")
    b = _Builder(fg, costs, model, forward)
    p = b.p
    orig = b.orig

    def bind_orig(t: int, v: int) -> None:
        orig[t] = v

    b.bind = bind_orig
    if schedule is not None:
        # TensorFlow adds what a call's or loop's gradient keeps (the forward
        # function's extra outputs, while_v2's accumulators) only to the op
        # it differentiates: an original whose copy is differentiated keeps
        # nothing.
        differentiated = {i for step in schedule.steps if step.kind == "backprop" for i in step.ops}
        for i, v in b.saved_of.items():
            if i not in differentiated:
                p.size[v] = 0
    if b.xla_model is not None and schedule is not None:
        _drop_recomputed_xla_values(b, schedule)
    backward_start = len(p.reads)

    # Seeds: grad_ys = ones_like(y), a folded constant when y's shape is static.
    # (Under XLA memsave's seeds read the ys, memsave.rewrite._after_forward.)
    xla_seeds = fg.xla and schedule is not None
    for y in dict.fromkeys(fg.ys):
        if b.foldable(y) and not xla_seeds:
            v = b.constant_value(y)
        else:
            v = p.value(costs.tensor_bytes[y])
            p.instr((Event.SEED, y), [orig[y]] if xla_seeds else [], [(v, ())])
        b.grads.setdefault(y, []).append(v)

    xs = set(fg.xs)
    if schedule is None:
        b.backward(range(len(fg.ops)), orig.__getitem__, set(fg.ys), xs)
    else:
        tensor_bytes, grads, constant = costs.tensor_bytes, b.grads, b.constant
        for step in schedule.steps:
            heads = set(step.heads)
            boundary = set(step.boundary)
            if step.kind == "backprop":
                b.backward(step.ops, orig.__getitem__, heads, boundary)
                continue
            if not any(grads.get(h) for h in step.heads):
                continue
            local = dict()
            gated = set(step.gated)
            if not fg.xla and all(g in constant for h in step.heads for g in grads.get(h, ())):
                # The heads' gradients are constants (the seeds ones_like(y)):
                # Grappler folds the gate to 0 and ``t + 0`` into an Identity
                # (step stats: the first step's gated proxy of a U-Net's 3 MiB
                # concat ran as Identity, allocating nothing).
                gated = set()
            for t in step.boundary:
                src = orig[t]
                if t in gated and b.xla_model is not None:
                    # XLA fuses the gated add with t's elementwise producers:
                    # it reads what t is computed from (memsave.xla.fused_sources),
                    # and the gate (the heads' gradients).
                    v = p.value(tensor_bytes[t])
                    p.instr((Event.PROXY, t), [orig[u] for u in b.xla_model.fused_sources(t)]
                            + [g for h in step.heads for g in grads.get(h, ())], [(v, ())])
                elif t in gated:
                    v = p.value(tensor_bytes[t])
                    p.instr((Event.PROXY, t), [src], [(v, (src,))])
                else:
                    v = p.value(tensor_bytes[t], alias=src)
                    p.instr((Event.PROXY, t), [src], [(v, ())])
                local[t] = v
            if b.xla_model is not None:
                # XLA transforms the step's kernels as soon as their gate opens.
                for i in step.ops:
                    kernel = b.xla_model.kernel(i)
                    if kernel is not None:
                        w = kernel[0]
                        v = p.value(kernel[1])
                        p.instr((Event.PROXY, w), [local.get(w, orig[w])], [(v, ())])
                        b.xla_kernel_of[i] = v

            def vmap(t: int, local=local) -> int:
                v = local.get(t)
                return orig[t] if v is None else v

            def bind_local(t: int, v: int, local=local, boundary=boundary) -> None:
                if t not in boundary:
                    local[t] = v

            b.bind = bind_local
            for i in _needed_copies(fg, costs, step.ops):
                b.run_op(i, vmap, Event.RECOMPUTE)
            b.recomputing = True
            b.backward(step.ops, vmap, heads, boundary)
            b.recomputing = False
    # The xs' gradients are the step's outputs.
    for x in dict.fromkeys(fg.xs):
        g = b.accumulate(x, b.grads.pop(x, []))
        if g is not None:
            p.pinned.append(g)
    return p, b.resident_bytes, backward_start


def _drop_recomputed_xla_values(b: _Builder, schedule: Schedule) -> None:
    """Under XLA, drop the forward pass's XLA values of ops ``schedule`` recomputes.

    An op whose gradient a recompute step takes on its copy makes its XLA
    values (a transposed input, a transformed kernel: memsave.xla) in that
    step, not in the forward pass.
    """
    size, early_of = b.p.size, b.early_of
    recomputed = {i for step in schedule.steps if step.kind == "recompute" for i in step.ops}
    for i, (start, n) in b.xla_forward_of.items():
        if i in recomputed:
            for v in early_of[i][start:start + n]:
                size[v] = 0
    for i, v in b.xla_kernel_of.items():
        if i in recomputed:
            size[v] = 0


def _needed_copies(fg: ForwardGraph, costs: Costs, ops: Sequence[int]) -> list[int]:
    """The ops of a recompute step whose copies run: those a gradient reads
    (through other copies). The rest, e.g. the copy of the loss itself, feed
    nothing that is fetched, and TensorFlow prunes them."""
    need: set[int] = set()
    gradient_reads = costs.gradient_reads
    for i in ops:
        read_ins, read_outs = gradient_reads[i]
        need.update(read_ins)
        need.update(read_outs)
    live = []
    gradient = costs.gradient
    for i in reversed(ops):
        op = fg.ops[i]
        if (any(t in need for t in op.outputs) or (op.body is not None and op.body.saved)
                or gradient[i].early_bytes):
            live.append(i)
            need.update(op.inputs)
    live.reverse()
    return live


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
    p, resident_bytes, backward_start = _build(fg, schedule, costs, model, forward)
    allocator = model.allocator
    reads, writes, size, alias = p.reads, p.writes, p.size, p.alias
    labels = p.labels
    if fg.xla:
        # XLA runs the instructions breadth-first (memsave.xla).
        order = breadth_first_order(reads, writes, len(size))
        reads = [reads[k] for k in order]
        writes = [writes[k] for k in order]
        labels = [labels[k] for k in order]
        backward_start = next((j for j, k in enumerate(order) if k >= backward_start), len(order))
    n_instr = len(reads)
    n_val = len(size)
    # Each value's last reader, or where it is made if nothing reads it.
    last = [-1] * n_val
    for k, ws in enumerate(writes):
        for v, _ in ws:
            last[v] = k
    for k, rs in enumerate(reads):
        for r in rs:
            last[r] = k
    # Under XLA with the update in the step, each gradient is consumed by
    # its update (MemoryModel.xla_update_in_step): as gradients_kept=False.
    gradients_kept = gradients_kept and not (fg.xla and model.xla_update_in_step)
    if gradients_kept:
        for v in p.pinned:
            last[v] = n_instr  # past the last instruction: the step's outputs
    resident = list(itertools.compress(range(n_val), p.resident))
    for v in resident:
        last[v] = n_instr  # alive before and after the step
    dying: list[list[int]] = [[] for _ in range(n_instr)]
    for v, k in enumerate(last):
        if 0 <= k < n_instr:
            dying[k].append(v)
    # A view holds a reference to its buffer's root; a buffer is freed when
    # the last value on it (base or view) has had its last reader.
    counted_of = {n: allocator.counted(n) for n in set(size)}  # few distinct sizes
    counted = [counted_of[n] for n in size]
    if not gradients_kept:
        for v in p.xs_grads:
            counted[v] = 0  # consumed by the update as soon as written
    root = list(range(n_val))
    refs = [0] * n_val
    alive = extra_resident_bytes
    for v in resident:
        refs[v] = 1 << 30
        alive += counted[v]
    resident_counted = alive
    peak = alive
    peak_k = -1
    events: list[tuple[int, str]] = []
    for k, dies in enumerate(dying):
        for v, cands in writes[k]:
            a = alias[v]
            if a >= 0:
                r = root[a]
                root[v] = r
                refs[r] += 1
                continue
            chosen = -1
            for c in cands:
                r = root[c]
                if last[c] == k and refs[r] == 1 and size[r] == size[v]:
                    chosen = r
                    break
            if chosen >= 0:
                root[v] = chosen
                refs[chosen] += 1
            else:
                refs[v] = 1
                alive += counted[v]
        if alive > peak:
            peak, peak_k = alive, k
        if timeline:
            events.append((alive, _label(fg, labels[k])))
        for v in dies:
            r = root[v]
            refs[r] -= 1
            if not refs[r]:
                alive -= counted[r]
    return MemoryTrace(
        peak_bytes=peak,
        resident_bytes=resident_counted,
        timeline=tuple(events),
        peak_event=_label(fg, labels[peak_k]) if peak_k >= 0 else "start",
        backward_start=backward_start,
        end_bytes=alive,
    )


def _label(fg: ForwardGraph, label: tuple) -> str:
    kind, ref = label
    name = fg.ops[ref].name if kind.of_op else fg.tensors[ref].name
    return kind.value + name
