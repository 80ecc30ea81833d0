"""The cost model: bytes per tensor, compute per op, what each gradient reads.

Data flow: :func:`estimate_costs` takes a :class:`~memsave.graph.ForwardGraph`
(whose TensorFlow facts :mod:`memsave.extract` recorded: static shapes,
dtypes, the variable behind each handle, registered FLOP counts, learned
gradient reads) and an optional ``batch_size`` hint, and returns a
:class:`Costs`: plain numbers per tensor and per op, and the list of
assumptions it had to make. The simulator (:mod:`memsave.simulate`) and the
strategies read it; nothing here touches TensorFlow.

What the numbers mean
---------------------
* ``tensor_bytes[t]``: bytes of tensor ``t``'s buffer, from its static shape and
  dtype. An unknown first dimension takes ``batch_size`` when given; any
  other unknown dimension counts as 1. Each such guess is listed in
  ``assumptions``, never made silently. A resource handle weighs what its
  variable holds (``TensorNode.held_bytes``).
* ``op_flops[i]``: TensorFlow's registered FLOP count for op ``i`` (matrix
  products, convolutions, ...), else the number of elements it produces.
  Where only the leading dimension is unknown, the count at ``batch_size``
  (1 without it) for that dimension, as for the bytes.
* Gradient reads: the inputs/outputs of op ``i`` that its gradient reads
  (learned from the gradient TensorFlow builds for the op type; when that
  failed, all of them, and ``assumptions`` says so), and which input
  gradients are the incoming gradient's own buffer (AddV2's ``(grad, grad)``).
  Only the gradients of inputs that need one count: TensorFlow prunes the
  others (``h * mask`` keeps ``mask``, not ``h``). Calls and loops read
  what their bodies' gradients read (:class:`~memsave.graph.Body`).
* Aliases and in-place: ops of :data:`ALIAS_OP_TYPES` return a view of their
  first input (no allocation), and row slices (``OpNode.views_input``) a
  view of part of theirs; ops of :data:`INPLACE_OP_TYPES` reuse an
  input buffer of the same size when that input dies at the op, as the
  TensorFlow kernels do with ``forward_input_or_allocate_output``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from collections.abc import Sequence

from memsave.errors import ArgumentError
from memsave.graph import Body, ForwardGraph, GradientUse, OpNode

__all__ = [
    "Costs",
    "estimate_costs",
    "is_activation",
    "body_costs",
    "gradient_scratch_bytes",
    "ALIAS_OP_TYPES",
    "INPLACE_OP_TYPES",
    "SCRATCH_OP_TYPES",
]

#: Op types whose output shares its first input's buffer: the kernel sets the
#: output to the input tensor (Identity, Reshape, ExpandDims, Squeeze,
#: StopGradient, EnsureShape, CheckNumerics), or, for ReadVariableOp of a
#: resource variable, to the variable's own tensor (copy-on-read is off outside
#: tf.distribute's sync-on-read variables). They allocate nothing.
ALIAS_OP_TYPES = frozenset(
    {
        "Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "StopGradient",
        "PreventGradient", "EnsureShape", "CheckNumerics", "ReadVariableOp", "Bitcast",
        "Snapshot",
    }
)

#: Elementwise op types whose CPU/GPU kernels write their output into an
#: input's buffer when that input is not used afterwards
#: (``OpKernelContext::forward_input_or_allocate_output``: the cwise unary and
#: binary ops, BiasAdd, Relu and its gradients, AddN, Softmax). Their gradient
#: ops are elementwise too and forward the same way.
INPLACE_OP_TYPES = frozenset(
    {
        "Abs", "Add", "AddV2", "AddN", "BiasAdd", "Cos", "Elu", "Erf", "Exp", "Expm1", "Gelu",
        "LeakyRelu", "Log", "Log1p", "Maximum", "Minimum", "Mul", "Neg", "Pow", "RealDiv",
        "Reciprocal", "Relu", "Relu6", "Rsqrt", "Selu", "Sigmoid", "Sin", "Softplus",
        "Softsign", "Sqrt", "Square", "SquaredDifference", "Sub", "Tanh", "DivNoNan",
        "Div", "Floor", "Sign", "Round", "Softmax", "LogSoftmax", "Swish", "MulNoNan",
    }
)


#: Op types whose kernels may allocate temporaries beside their outputs,
#: about the size of their operands: TensorFlow's Einsum kernel (and
#: oneDNN's ``_MklEinsum``) transposes an operand whose labels are not in
#: the order its batched matrix product reads, and the product when it is
#: not in the output's order (:func:`einsum_temporaries`, from the
#: equation; where the equation is not read, a temporary the size of each
#: input). While its gradient runs, the simulator holds one the size of the
#: incoming gradient and one of its largest input
#: (:func:`gradient_scratch_bytes`).
SCRATCH_OP_TYPES = frozenset({"Einsum"})


def einsum_temporaries(equation: str | bytes) -> tuple[tuple[str, int], ...] | None:
    """What TensorFlow's Einsum kernel allocates besides its output, for a
    two-operand ``equation`` (``"abcd,aecd->acbe"``): a tuple of ``("i", j)``
    / ``("o", 0)``, a temporary the size of that input or output; None for
    an equation this does not read (an ellipsis, one or three operands, a
    label repeated in a subscript).

    The kernel (einsum_op_impl.h) gives each label an id in order of first
    appearance and a type: batch (in both operands and the output), free
    (one operand and the output), contract (both operands only), reduce
    (one operand only). It transposes an operand unless its labels are
    sorted by (type, id), batch < free < contract, or the same with free
    and contract swapped (it then flips the product's adjoint flag); the
    product comes out as batch, the first operand's free labels, the
    second's, and is transposed into a new output when the equation asks
    another order. Measured (allocator records, TF 2.21,
    oneDNN, ``tf.function`` and Session): ``tbd,de->tbe`` and
    ``abc,cde->abde`` allocate their output only; ``aecd,abcd->acbe`` both
    operands and the product (1 + 1 + 4 MiB, then the 4 MiB output);
    ``acbe,aecd->abcd`` its second operand and the product; ``ijb,bjk->bik``
    its first operand.
    """
    if isinstance(equation, bytes):  # (as Operation.get_attr gives it)
        equation = equation.decode()
    if "." in equation or "->" not in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    subs = lhs.split(",")
    if len(subs) != 2 or any(len(set(s)) != len(s) for s in (*subs, out)):
        return None
    names = {0: ("i", 0), 1: ("i", 1), "out": ("o", 0)}
    return tuple(names[k] for k in _einsum_copies(*subs, out))


def _einsum_copies(x: str, y: str, out: str) -> list:
    """Which of ``x,y->out``'s operands (0, 1) and whether its product
    ("out") TensorFlow's Einsum kernel copies (see :func:`einsum_temporaries`)."""
    ids: dict[str, int] = {}
    for s in x + y + out:
        ids.setdefault(s, len(ids))
    batch, free, contract, reduce = 1, 2, 3, 4

    def kind(s: str) -> int:
        both = s in x and s in y
        if s in out:
            return batch if both else free
        return contract if both else reduce

    def in_order(sub: str, swapped: bool) -> bool:
        keys = []
        for s in sub:
            k = kind(s)
            if swapped and k in (free, contract):
                k = free + contract - k
            keys.append((k, ids[s]))
        return keys == sorted(keys)

    copies: list = [j for j, sub in enumerate((x, y))
                    if not (in_order(sub, False) or in_order(sub, True))]
    by_id = ids.__getitem__
    product = (sorted((s for s in x if kind(s) == batch), key=by_id)
               + sorted((s for s in x if kind(s) == free), key=by_id)
               + sorted((s for s in y if kind(s) == free), key=by_id))
    if "".join(product) != out:
        copies.append("out")
    return copies


#: Batched matrix products whose gradient, where one operand is broadcast
#: over the other's batch dimensions (``x @ w``, x ``[B, T, D]`` and w
#: ``[D, U]``: a dense layer on a sequence written with ``@``), computes that operand's
#: gradient for every batch element (``[B, D, U]``) and then sums it
#: (TensorFlow's ``_BatchMatMulV2`` gradient). Measured: 4 such layers, B =
#: 512, T = 64, D = U = 256, float32: plain tf.gradients peaked at 386 MiB,
#: the forecast without that 128 MiB temporary 193 MiB.
BATCH_MATMUL_OP_TYPES = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def _without_early(use: GradientUse) -> GradientUse:
    ins, outs = set(use.reads_inputs), set(use.reads_outputs)
    for i, o in use.early_from:
        ins.update(i)
        outs.update(o)
    return dataclasses.replace(use, reads_inputs=tuple(sorted(ins)), reads_outputs=tuple(sorted(outs)),
                               early_bytes=(), early_from=())


def _pushed_down(fg: ForwardGraph, op: OpNode, use: GradientUse) -> GradientUse:
    """``use`` with the early values Grappler's constant push-down makes of
    ``op``'s gradient.

    Where an input's gradient is a product ``x * y`` whose ``y`` is one of
    ``op``'s own inputs or outputs (:attr:`GradientUse.products`) and that input
    is ``a * c``, ``c`` a scalar constant and ``op`` its only reader, the
    gradient of ``a``, ``(x * y) * c``, is rewritten ``x * (y * c)``
    (constant_folding.cc, ConstantPushDown): ``y * c`` runs in the forward
    pass and waits for the gradient, an early value of ``y``'s bytes.
    Measured: the scale before Keras ``MultiHeadAttention``'s softmax made
    one ``[16, 4, 128, 128]`` buffer a layer beside the softmax, alive until
    its gradient (the peak of a two-layer encoder's step was 18% over the
    forecast without it).
    """
    if not use.products or fg.xla:  # (XLA compiles the gradient whole)
        return use
    sizes, origins = [], []
    consumers = fg.consumers()
    for j, found in enumerate(use.products):
        if found is None or j >= len(op.inputs):
            continue
        t = op.inputs[j]
        producer = fg.tensors[t].producer
        if producer is None or consumers[t] != (op.index,) or not fg.receives_gradient(t):
            continue
        scale = fg.ops[producer]
        if scale.type == "Mul" and len(scale.inputs) == 2 and any(
                _scalar_constant(fg.tensors[u]) for u in scale.inputs):
            sizes.append(found[2])
            origins.append((found[0], found[1]))
    if not sizes:
        return use
    return dataclasses.replace(use, early_bytes=use.early_bytes + tuple(sizes),
                               early_from=use.early_from + tuple(origins))


def _scalar_constant(node) -> bool:
    return node.constant and node.shape is not None and all(d == 1 for d in node.shape)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Numbers per tensor and per op of one ForwardGraph.

    Attributes
    ----------
    tensor_bytes : tuple of int
        Bytes of each tensor's buffer (see module docstring).
    op_flops : tuple of int
        Compute cost of each op (FLOPs, or elements produced).
    alias_of : tuple of (int or None)
        Per tensor: the tensor whose buffer it is (outputs of
        :data:`ALIAS_OP_TYPES`), else None.
    inplace : tuple of bool
        Per op: may write its output into a dying input of the same size.
    gradient : tuple of GradientUse
        Per op: what its gradient reads (all inputs and outputs when not
        learned).
    resident_bytes : int
        Bytes alive for the whole step before it starts: the variables behind
        the xs' handles and the inputs (sources and external tensors).
    assumptions : tuple of str
        Every guess the model made (unknown dimensions, unlearned gradients).
    batch_size : int or None
        The hint used for unknown first dimensions.
    scratch : tuple of tuple of int
        Per op: bytes of the temporaries its kernel allocates while it runs
        (:data:`SCRATCH_OP_TYPES`).
    gradient_scratch : tuple of tuple of int
        Per op: bytes of the temporaries its gradient allocates while it
        runs, beside what it writes (:func:`gradient_scratch_bytes`).
    gradient_reads : tuple of (tuple of int, tuple of int)
        Per op: the input and the output tensor ids its gradient reads (from
        ``gradient``): the one definition of what backprop keeps alive for
        an op, read by the simulator, the solvers and the body reader.
    gradient_targets : tuple of tuple of (int, int)
        Per op: ``(position, tensor id)`` of the inputs its gradient writes a
        gradient to (:meth:`memsave.graph.ForwardGraph.receives_gradient`,
        and only a ``tf.custom_gradient``'s arguments, ``GradientUse.gives``).
    """

    tensor_bytes: tuple[int, ...]
    op_flops: tuple[int, ...]
    alias_of: tuple[int | None, ...]
    inplace: tuple[bool, ...]
    gradient: tuple[GradientUse, ...]
    resident_bytes: int
    assumptions: tuple[str, ...]
    batch_size: int | None = None
    scratch: tuple[tuple[int, ...], ...] = ()
    gradient_scratch: tuple[tuple[int, ...], ...] = ()
    gradient_reads: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    gradient_targets: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def forward_flops(self) -> int:
        """Compute of one forward pass (sum of ``op_flops``)."""
        return sum(self.op_flops)

    def recompute_flops(self, schedule) -> int:
        """FLOPs of the op copies ``schedule``'s recompute steps run (None: 0).

        The one definition of a plan's recompute cost.
        """
        if schedule is None:
            return 0
        op_flops = self.op_flops
        return sum(op_flops[o] for s in schedule.steps if s.kind == "recompute" for o in s.ops)


def is_activation(fg: ForwardGraph, t: int) -> bool:
    """Whether tensor ``t`` is an activation: produced by a recomputable op
    of the forward graph and differentiable.

    The one definition of "activation" in memsave: what a strategy may
    choose to keep, and what checkpointing may free and rebuild.
    """
    node = fg.tensors[t]
    return node.kind == "internal" and node.trainable and fg.ops[node.producer].recomputable


def _resolve_bytes(node, batch_size: int | None) -> tuple[int, str]:
    """Bytes of ``node`` and "" / "batch" / "other" for which guess was made."""
    if node.held_bytes is not None:
        return node.held_bytes, ""
    if node.shape is None or node.size_known:
        return node.size_bytes, ("" if node.size_known else "rank")
    n = node.itemsize
    guess = ""
    for k, d in enumerate(node.shape):
        if d is None:
            if k == 0 and batch_size is not None:
                n *= batch_size
                guess = guess or "batch"
            else:
                guess = "other"
        else:
            n *= d
    return n, guess


def estimate_costs(fg: ForwardGraph, *, batch_size: int | None = None,
                   early_gradient_values: bool = False) -> Costs:
    """Bytes, compute and gradient reads of every tensor and op of ``fg``.

    Parameters
    ----------
    fg : ForwardGraph
    batch_size : int, optional
        Size of an unknown first dimension. Without it such dimensions
        count as 1 and ``assumptions`` says so.
    early_gradient_values : bool
        Keep ``GradientUse.early_bytes`` (see
        :attr:`memsave.memory_model.MemoryModel.early_gradient_values`);
        otherwise what they are computed from counts as read by the gradient.

    Returns
    -------
    Costs

    Notes
    -----
    One pass over tensors and ops: linear in the graph size.
    """
    check_batch_size(batch_size)
    batch_size = None if batch_size is None else int(batch_size)  # a numpy integer is one
    tensor_bytes = []
    guessed: dict[str, list[str]] = {"batch": [], "other": [], "rank": []}
    for node in fg.tensors:
        b, guess = _resolve_bytes(node, batch_size)
        tensor_bytes.append(b)
        if guess:
            guessed[guess].append(node.name)
    assumptions = []
    if guessed["batch"]:
        assumptions.append(
            f"{len(guessed['batch'])} tensors have an unknown first dimension; took "
            f"batch_size={batch_size} (e.g. {guessed['batch'][0]!r})"
        )
    if guessed["other"]:
        hint = "" if batch_size is not None else "; pass batch_size= to plan for a real batch"
        assumptions.append(
            f"{len(guessed['other'])} tensors have unknown dimensions, counted as 1 "
            f"(e.g. {guessed['other'][0]!r}){hint}"
        )
    if guessed["rank"]:
        assumptions.append(
            f"{len(guessed['rank'])} tensors have an unknown rank, counted as one element "
            f"(e.g. {guessed['rank'][0]!r})"
        )
    held_unknown = [
        n.name for n in fg.tensors if n.kind != "internal" and n.dtype == "resource" and n.held_bytes is None
    ]
    if held_unknown:
        assumptions.append(
            f"{len(held_unknown)} resource handles with no recorded variable shape, counted as "
            f"0 bytes (e.g. {held_unknown[0]!r})"
        )

    alias_of: list[int | None] = [None] * len(fg.tensors)
    inplace = []
    gradient = []
    op_flops = []
    unlearned: dict[str, int] = {}
    for op in fg.ops:
        if op.type in ALIAS_OP_TYPES and op.inputs:
            for j, t in enumerate(op.outputs):
                src = op.inputs[j] if op.type == "IdentityN" and j < len(op.inputs) else op.inputs[0]
                alias_of[t] = src
        if op.views_input is not None:
            for t in op.outputs:
                alias_of[t] = op.inputs[op.views_input]
        if op.body is not None and op.body.loop:
            # A loop passes its invariants through: the output is the input.
            for j in op.body.invariant:
                if j < len(op.outputs) and j < len(op.inputs):
                    alias_of[op.outputs[j]] = op.inputs[j]
        inplace.append(op.type in INPLACE_OP_TYPES)
        if op.gradient is None:
            unlearned[op.type] = unlearned.get(op.type, 0) + 1
            gradient.append(GradientUse(
                reads_inputs=tuple(range(len(op.inputs))),
                reads_outputs=tuple(range(len(op.outputs))),
                aliases=(None,) * len(op.inputs),
            ))
        else:
            # Inputs from outside (data, constants) need no gradient: theirs is pruned.
            use = op.gradient.needed([fg.receives_gradient(t) for t in op.inputs])
            if not early_gradient_values and use.early_bytes:
                use = _without_early(use)
            # (counted either way: what the pushed-down product is computed
            # from is kept for the gradient too)
            gradient.append(_pushed_down(fg, op, use))
        if op.body is not None:
            op_flops.append(op.body.trips * body_costs(op.body).forward_flops)
        elif op.flops is not None:
            op_flops.append(op.flops)
        elif op.flops_linear is not None:
            # At the leading dimension the byte counts take batch_size for.
            a, b = op.flops_linear
            op_flops.append(max(0, a + b * (batch_size or 1)))
        else:
            op_flops.append(sum(
                tensor_bytes[t] // fg.tensors[t].itemsize if fg.tensors[t].itemsize else 0
                for t in op.outputs
            ))
    if unlearned:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(unlearned.items()))
        assumptions.append(
            f"what the gradient reads was not learned for {kinds}; assumed it reads every "
            "input and output"
        )
    loops = [op for op in fg.ops if op.body is not None and not op.body.trips_known]
    if loops:
        assumptions.append(
            f"{len(loops)} while loops with a trip count not known statically (no constant "
            f"maximum_iterations or counter bound), assumed to run {loops[0].body.trips} time(s) "
            f"(e.g. {loops[0].name!r})"
        )
    for op in fg.ops:
        if op.body is not None:
            assumptions.extend(f"in {op.name!r}: {a}" for a in body_costs(op.body).assumptions)
    resident = 0
    for node in fg.tensors:
        if node.kind != "internal":
            resident += tensor_bytes[node.id]
    gradient_reads = tuple(
        (tuple(op.inputs[j] for j in use.reads_inputs if j < len(op.inputs)),
         tuple(op.outputs[k] for k in use.reads_outputs if k < len(op.outputs)))
        for op, use in zip(fg.ops, gradient))
    gradient_targets = tuple(
        tuple((j, t) for j, t in enumerate(op.inputs)
              if fg.receives_gradient(t) and (use.gives is None or j in use.gives))
        for op, use in zip(fg.ops, gradient))
    return Costs(
        tensor_bytes=tuple(tensor_bytes),
        op_flops=tuple(op_flops),
        alias_of=tuple(alias_of),
        inplace=tuple(inplace),
        gradient=tuple(gradient),
        resident_bytes=resident,
        assumptions=tuple(assumptions),
        batch_size=batch_size,
        scratch=tuple(_kernel_scratch(op, tensor_bytes) for op in fg.ops),
        gradient_scratch=tuple(gradient_scratch_bytes(fg, op, tensor_bytes, gradient_targets[i])
                               for i, op in enumerate(fg.ops)),
        gradient_reads=gradient_reads,
        gradient_targets=gradient_targets,
    )


def _kernel_scratch(op: OpNode, tensor_bytes: Sequence[int]) -> tuple[int, ...]:
    """Bytes of the temporaries ``op``'s kernel allocates while it runs."""
    if op.type not in SCRATCH_OP_TYPES:
        return ()
    if op.temporaries is None:
        return tuple([tensor_bytes[t] for t in op.inputs])
    return tuple(tensor_bytes[(op.inputs if kind == "i" else op.outputs)[k]]
                 for kind, k in op.temporaries)


def gradient_scratch_bytes(fg: ForwardGraph, op, tensor_bytes: Sequence[int],
                           targets: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Bytes of the temporaries ``op``'s gradient allocates while it runs.

    :data:`SCRATCH_OP_TYPES`: one the size of its largest output (the
    incoming gradient's) and one of its largest input, whatever the
    equation: on a chain of ``tbd,de->tbe`` layers, whose gradient products
    need no transpose, the allocator's peak moved between 40, 48 and 56 MiB
    from one step to the next (TF 2.21, oneDNN), the largest with two such
    buffers in flight beside the buffers the allocator's records list. A
    batched matrix product (:data:`BATCH_MATMUL_OP_TYPES`): per operand that receives a
    gradient (``targets``: its position and tensor) and is broadcast over
    the other's batch dimensions, its gradient for every batch element of
    the output before the sum (not under XLA, which may contract the batch
    in the product). Unknown shapes: none.
    """
    if op.type in SCRATCH_OP_TYPES:
        return (max([tensor_bytes[t] for t in op.outputs]),
                max([tensor_bytes[t] for t in op.inputs], default=0))
    if op.type not in BATCH_MATMUL_OP_TYPES or fg.xla or len(op.inputs) < 2 or not op.outputs:
        return ()
    out = fg.tensors[op.outputs[0]]
    if out.shape is None or len(out.shape) < 3 or None in out.shape[-2:] \
            or out.shape[-2] * out.shape[-1] * out.itemsize == 0:
        return ()
    batch = tensor_bytes[out.id] // (out.shape[-2] * out.shape[-1] * out.itemsize)
    scratch = []
    for position, t in targets:
        shape = fg.tensors[t].shape
        if position > 1 or shape is None or None in shape or len(shape) < 2:
            continue
        own_batch = math.prod(shape[:-2])
        if own_batch < batch:  # broadcast: summed over the output's batch after the product
            scratch.append(batch * shape[-2] * shape[-1] * out.itemsize)
    return tuple(scratch)


_body_costs: "weakref.WeakKeyDictionary[Body, Costs]" = weakref.WeakKeyDictionary()


def check_batch_size(batch_size, api: str = "memsave") -> None:
    """Raise ArgumentError unless ``batch_size`` is None or a positive int."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, numbers.Integral) or batch_size < 1):
        raise ArgumentError(f"{api}: batch_size must be a positive int, got {batch_size!r}")


def body_costs(body: Body) -> Costs:
    """:func:`estimate_costs` of a call's or loop's body (cached per body), at
    the body's ``batch_size``."""
    found = _body_costs.get(body)
    if found is None:
        found = _body_costs[body] = estimate_costs(body.fg, batch_size=body.batch_size)
    return found
