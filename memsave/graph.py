"""The forward graph between xs and ys, as plain data (no TensorFlow).

:mod:`memsave.extract` reads a TensorFlow graph into a :class:`ForwardGraph`;
everything after that (strategies, the schedule, the memory estimate) works on
this value alone, so it can be tested on graphs built by hand.

Numbering
---------
Ops are numbered ``0..len(ops)-1`` in a topological order of the forward
graph (inputs before consumers, ties broken by creation order, so the numbering
is deterministic). Tensors are numbered separately: every tensor an op of the
forward graph produces or consumes has an id. A tensor is

* ``internal`` when an op of the forward graph produces it,
* ``source`` when it is one of the xs and no op of the forward graph produces
  it (a variable handle, a placeholder given as x),
* ``external`` otherwise: consumed by the forward graph but not reachable from
  any x (input data, constants, random masks). External tensors carry no
  gradient and are never recomputed.

An op is *recomputable* when copying it gives the same values: stateful ops
(random draws, variable reads, assignments) are not, and their outputs are kept
whatever the strategy says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

__all__ = ["OpNode", "TensorNode", "ForwardGraph", "GradientUse", "Body"]


@dataclasses.dataclass(frozen=True)
class GradientUse:
    """What an op's registered gradient reads, as learned from TensorFlow.

    Attributes
    ----------
    reads_inputs, reads_outputs : tuple of int
        Positions of the op's inputs/outputs that the gradient ops read
        (so the executor keeps them alive until the op's gradient runs).
    aliases : tuple of (int or None)
        Per input: the position of the output whose incoming gradient *is*
        that input's gradient (same buffer, as AddV2's ``(grad, grad)``),
        else None.
    has_gradient : bool
        False when the op has no gradient (``StopGradient``, registered
        not-differentiable): backprop stops there.
    by_input : tuple of (tuple of int, tuple of int), or None
        Per input: the (input positions, output positions) that computing
        that input's gradient reads. TensorFlow prunes the gradient ops of
        inputs that need no gradient (``x * mask`` keeps ``mask`` for
        ``x``'s gradient, and ``x`` only when the mask needs one), so what
        stays alive depends on which inputs need a gradient
        (:meth:`needed`). None: not known, the union above for any input.
        A third entry, when present, lists the ``early_bytes`` values read.
    early_bytes : tuple of int
        Bytes of values the gradient computes from the op's inputs and
        outputs alone (``Square(x)`` in Erfc's gradient, ``x * y`` terms):
        they do not wait for the incoming gradient, so the executor runs
        them in the forward pass, right after the op, and keeps them until
        the gradient runs (what they were computed from is not kept for
        them).
    early_from : tuple of (tuple of int, tuple of int)
        Per early value, the (input, output) positions it is computed from:
        inside a function or loop body, whose backward runs separately,
        those are what the gradient keeps.
    gives : tuple of int, or None
        Input positions that receive a gradient; None: every differentiable
        input. A ``tf.custom_gradient`` gives one to its arguments only, not
        to the results it passes through, so the ops computing those results
        are never differentiated.
    products : tuple of (tuple of int, tuple of int, int) or None, or None
        Per input: when its gradient is the product of one of the op's own
        inputs or outputs and a value that depends on the incoming gradient
        (Softmax's ``(g - sum(g * y)) * y``), that factor's (input, output)
        position and its bytes; else None. Grappler's
        constant push-down moves a constant factor applied to that gradient
        next (the gradient of ``x * c``) onto the first value: ``y * c``,
        computed in the forward pass (:func:`memsave.costs.estimate_costs`).
    captured : bool
        The gradient reads the forward pass's own tensors (the inputs at
        ``reads_inputs``), whichever copy of the op it differentiates: a
        ``tf.custom_gradient``'s gradient function closes over its
        arguments. :func:`memsave.schedule.build_schedule` keeps them.
    """

    reads_inputs: tuple[int, ...]
    reads_outputs: tuple[int, ...]
    aliases: tuple[int | None, ...]
    has_gradient: bool = True
    by_input: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    early_bytes: tuple[int, ...] = ()
    early_from: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    gives: tuple[int, ...] | None = None
    captured: bool = False
    products: tuple[tuple[tuple[int, ...], tuple[int, ...], int] | None, ...] | None = None

    def needed(self, inputs: Sequence[bool]) -> "GradientUse":
        """What the gradient reads when only the inputs flagged in ``inputs``
        need a gradient (the rest are pruned)."""
        if self.by_input is None or all(inputs) or len(inputs) != len(self.by_input):
            return self
        ins: set[int] = set()
        outs: set[int] = set()
        early: set[int] = set()
        for need, reads in zip(inputs, self.by_input):
            if need:
                ins.update(reads[0])
                outs.update(reads[1])
                if len(reads) > 2:
                    early.update(reads[2])
        return dataclasses.replace(
            self, reads_inputs=tuple(sorted(ins)), reads_outputs=tuple(sorted(outs)),
            early_bytes=tuple(b for k, b in enumerate(self.early_bytes) if k in early),
            early_from=tuple(f for k, f in enumerate(self.early_from) if k in early))


@dataclasses.dataclass(frozen=True)
class TensorNode:
    """One tensor of the forward graph.

    Attributes
    ----------
    id : int
        Position in :attr:`ForwardGraph.tensors`.
    name : str
        The TensorFlow name (``"dense/MatMul:0"``), for messages only.
    kind : str
        ``"internal"``, ``"source"`` or ``"external"`` (see module docstring).
    producer : int or None
        Index of the producing op for internal tensors, else None.
    size_bytes : int
        Static size in bytes; dimensions unknown at graph-build time count
        as 1 (see ``size_known``), so sizes stay comparable between tensors
        that share an unknown batch dimension.
    size_known : bool
        Whether every dimension was known.
    trainable : bool
        Whether a gradient can flow through the tensor (floating, complex,
        resource or variant dtype), by TensorFlow's own rule.
    tagged : bool
        Whether the user added the tensor to the ``'checkpoints'`` collection.
    shape : tuple of (int or None), or None
        Static shape, None dimensions unknown; None when the rank is unknown
        (or not recorded: graphs built by hand give ``size_bytes`` only).
    itemsize : int
        Bytes per element (0 for handles and variants).
    dtype : str
        TensorFlow dtype name, for messages.
    held_bytes : int or None
        For a resource handle: bytes of the variable it refers to (resident
        for the whole step), None if unknown or not a handle.
    constant : bool
        Produced by a ``Const`` op (known before the step runs).
    """

    id: int
    name: str
    kind: str
    producer: int | None
    size_bytes: int
    size_known: bool
    trainable: bool
    tagged: bool = False
    shape: tuple[int | None, ...] | None = None
    itemsize: int = 0
    dtype: str = ""
    held_bytes: int | None = None
    constant: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """The function a call op (PartitionedCall, StatefulPartitionedCall) or a
    loop (While) runs, read as a ForwardGraph of its own.

    Attributes
    ----------
    fg : ForwardGraph
        The body's ops between its inputs (xs: the function's arguments)
        and its outputs (ys).
    trips : int
        How often the body runs in one call: 1 for a call; for a loop, its
        ``maximum_iterations`` or the trip count read from its counter (see
        ``trips_known``).
    trips_known : bool
        False when the trip count was not known statically and ``trips`` is
        a guess.
    saved : tuple of int
        Body tensor ids whose buffers the op's gradient keeps, one buffer
        each per trip: the intermediates TensorFlow adds as extra outputs of
        the forward call (a tf.function's forward/backward split) or pushes to
        accumulators (while_v2), deduplicated by buffer; loop invariants,
        constants and resource handles are not saved.
    stored : tuple of int
        Body tensor ids written into a TensorList (TensorArray) that the
        loop carries: each trip adds one buffer the list keeps alive. Some
        may be in ``saved`` too (a ``tanh`` written out, which its gradient
        reads): while_v2's gradient keeps that buffer once.
    loop : bool
        A While: the gradient runs a loop of its own, with one gradient
        buffer per loop-invariant input besides each trip's gradient.
    invariant : tuple of int
        A While's input positions that the body passes through unchanged
        (captured tensors, weights): the gradient loop sums their gradients
        from ``zeros_like`` of them.
    state : tuple of int
        A While's body tensor ids of the loop state: the body's inputs that
        change from trip to trip and hold data (not TensorLists, resources or
        the counter). What a per-step gradient stores each trip
        (:mod:`memsave.loopmodel`).
    kept_bytes : tuple of int
        Bytes of each value of an op that must not run twice (a random draw
        inside the body) that the gradient reads, itself or through what is
        computed from it (a dropout mask): stored each trip whatever the
        choice.
    once : str
        The name of an op of the loop's body that must not run twice (a
        random draw, an assignment, a print), "" when none: chunked
        gradients would run it again, so only plain and per step are
        weighed (:func:`memsave.loopmodel.candidates`), as
        :func:`memsave.loops.prepare` applies them.
    read_lists_bytes : int
        Bytes of the TensorLists the loop reads items from and passes
        through (a Keras RNN's unstacked input sequence) that need a
        gradient: a gradient that recomputes trips reads them again, so they
        stay alive until it runs. (Lists that need none are not counted: a
        prepared loop reads their items from the tensor they were made of.)
    no_gradient : tuple of int
        Body tensor ids of loop-invariant inputs whose gradient nobody reads
        (their outer tensors carry none): its per-trip sum is not computed
        (Grappler drops it from while_v2's gradient loop; memsave.loops
        does not build it).
    pinned : str
        Why the loop keeps while_v2's gradient whatever the plan ("" when
        it need not): its body reads a variable another op of the graph
        writes (:func:`memsave._tf_private.written_variable`), and a trip
        recomputed after that write would read the new value.
    stored_outputs : tuple of int
        For each of ``stored``, the output position of the loop through
        which the TensorList it is written into leaves the loop (-1 when
        not found): what the list's items cost depends on whether the
        enclosing graph reads that output (:mod:`memsave.loopmodel`).
    stored_state : tuple of int
        The ids of ``stored`` that are also the next trip's loop state (the
        body outputs them at a state position, as a ``tf.scan`` its carried
        value): a gradient that stores the state keeps the same buffers.
    batch_size : int or None
        The size its tensors' unknown first dimension is counted at (the
        ``batch_size`` hint of the plan it was read for; None: 1), as the
        enclosing graph's are (:func:`memsave.costs.body_costs`).
    """

    fg: "ForwardGraph"
    trips: int
    trips_known: bool
    saved: tuple[int, ...]
    stored: tuple[int, ...] = ()
    loop: bool = False
    invariant: tuple[int, ...] = ()
    state: tuple[int, ...] = ()
    kept_bytes: tuple[int, ...] = ()
    once: str = ""
    read_lists_bytes: int = 0
    no_gradient: tuple[int, ...] = ()
    pinned: str = ""
    stored_outputs: tuple[int, ...] = ()
    stored_state: tuple[int, ...] = ()
    batch_size: int | None = None


@dataclasses.dataclass(frozen=True)
class OpNode:
    """One op of the forward graph.

    ``inputs`` and ``outputs`` are tensor ids. ``flops`` is TensorFlow's
    registered FLOP count (None where it has none, or where a shape it
    needs is not static); ``flops_linear``, where ``flops`` is None
    because only the leading dimension of some shapes is unknown (the
    batch of a Keras step traced for a partial last batch), the same count
    as ``(a, b)``: ``a + b * n`` for that dimension ``n``. ``gradient`` what the
    op's gradient reads (None: not learned, assume it reads everything).
    ``body``: for calls and loops, the function they run (None otherwise).
    ``reuses_statistics``: a training-mode batch norm whose copy in a
    recompute step normalises with the statistics the forward pass computed
    (:func:`memsave._tf_private.reuses_batch_statistics`; no op of the
    graph reads its other outputs; not under XLA), one pass instead of a
    reduction and a pass. ``views_input``: the position of the input whose
    buffer every output is a part of (TensorFlow's row slices:
    :func:`memsave.extract.views_rows`), None when each output is a buffer
    of its own. ``temporaries``: for an Einsum, what its kernel allocates
    besides its output (:func:`memsave.costs.einsum_temporaries`), None
    when not read from its equation.
    """

    index: int
    name: str
    type: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    recomputable: bool
    flops: int | None = None
    gradient: GradientUse | None = None
    body: Body | None = None
    flops_linear: tuple[int, int] | None = None
    reuses_statistics: bool = False
    views_input: int | None = None
    temporaries: tuple[tuple[str, int], ...] | None = None


@dataclasses.dataclass(frozen=True)
class ForwardGraph:
    """The ops on paths from xs to ys, in topological order.

    Attributes
    ----------
    ops : tuple of OpNode
        ``ops[i].index == i``; producers come before consumers.
    tensors : tuple of TensorNode
        ``tensors[i].id == i``.
    xs, ys : tuple of int
        Tensor ids of the xs and ys, in the caller's order (an entry may
        repeat if the caller repeated a tensor).
    xla : bool
        The graph is traced to be compiled by XLA (``jit_compile=True``):
        the rewrite then gates every floating boundary tensor of a
        recomputed segment, weights included (see :mod:`memsave.rewrite`),
        and the simulator counts those gated copies.
    """

    ops: tuple[OpNode, ...]
    tensors: tuple[TensorNode, ...]
    xs: tuple[int, ...]
    ys: tuple[int, ...]
    xla: bool = False

    def __post_init__(self) -> None:
        for i, op in enumerate(self.ops):
            if op.index != i:
                raise ValueError(f"ops[{i}].index is {op.index}: ops must be numbered in order")
            for t in op.inputs:
                p = self.tensors[t].producer
                if p is not None and p >= i:
                    raise ValueError(
                        f"op {op.name!r} (#{i}) consumes {self.tensors[t].name!r} "
                        f"produced by op #{p}: ops must be in topological order"
                    )
        for i, t in enumerate(self.tensors):
            if t.id != i:
                raise ValueError(f"tensors[{i}].id is {t.id}: tensors must be numbered in order")

    # -- queries -----------------------------------------------------------

    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """For each tensor id, the forward-graph ops that consume it, in order.

        Computed once per graph (the graph is immutable): planners ask for
        it once per simulated plan.
        """
        found = self.__dict__.get("_consumers")
        if found is None:
            out: list[list[int]] = [[] for _ in self.tensors]
            for op in self.ops:
                for t in dict.fromkeys(op.inputs):
                    out[t].append(op.index)
            found = tuple(map(tuple, out))
            object.__setattr__(self, "_consumers", found)  # a cache, not a field
        return found

    def numbering_key(self) -> tuple:
        """What the tensor and op ids of a plan refer to: two forward graphs
        with equal keys number the same tensors alike (tf.function retraces
        included), so a plan of one is a plan of the other."""
        return (tuple((op.name, op.type, op.inputs, op.outputs) for op in self.ops),
                tuple((t.name, t.kind, t.shape, t.size_bytes) for t in self.tensors),
                self.xs, self.ys, self.xla)

    def receives_gradient(self, t: int) -> bool:
        """Whether backprop sends tensor ``t`` a gradient: it is differentiable
        and not external (input data and constants get none).

        The one definition of "receives a gradient"; an op's inputs that do
        are ``Costs.gradient_targets``.
        """
        node = self.tensors[t]
        return node.trainable and node.kind != "external"

    def computes_in_float16(self) -> bool:
        """Whether a tensor of the graph is float16. Training in float16
        needs a loss scale, whose finite check holds every weight update to
        the step's end; under XLA the rewrite (``rewrite._ordered_after_step``)
        and the forecast (:attr:`memsave.MemoryModel.xla_update_in_step`)
        act on it. Computed once per graph."""
        found = self.__dict__.get("_float16")
        if found is None:
            found = any(t.dtype == "float16" for t in self.tensors)
            object.__setattr__(self, "_float16", found)  # a cache, not a field
        return found

    def captured(self) -> frozenset[int]:
        """Internal tensors a gradient reads as the forward pass made them,
        whichever copy of its op it differentiates (``GradientUse.captured``:
        a ``tf.custom_gradient``'s arguments, which its function closed over)."""
        return frozenset(
            op.inputs[j] for op in self.ops if op.gradient is not None and op.gradient.captured
            for j in op.gradient.reads_inputs if self.tensors[op.inputs[j]].kind == "internal")

    def internal_tensors(self) -> Iterable[TensorNode]:
        """Tensors produced by forward-graph ops, in op order."""
        for op in self.ops:
            for t in op.outputs:
                yield self.tensors[t]

    def describe(self, tensor_ids: Sequence[int]) -> list[str]:
        """Names of the given tensors, for messages."""
        return [self.tensors[t].name for t in tensor_ids]
