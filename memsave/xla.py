"""What XLA does to a compiled training step, as memsave plans for it (no TensorFlow).

A ``tf.function(jit_compile=True)`` step (and Keras ``jit_compile=True``) is
one XLA cluster: forward, gradients and the optimizer's update. XLA then
decides what is alive when, and does it differently from TensorFlow's
executor. Read from XLA's own dumps (``XLA_FLAGS='--xla_dump_to=DIR
--xla_dump_hlo_as_text'``: ``*buffer-assignment.txt`` lists every buffer,
its live range in the schedule and what is live at the peak) of a
keras.applications ResNet50 step (64x64, batch 32, SGD in the step), TF
2.21 on CPU:

* Control dependencies are ignored: only data dependencies order anything
  (memsave's gates are data dependencies, see :mod:`memsave.rewrite`).
* Schedule: XLA:CPU runs its instructions in breadth-first order
  (``xla_cpu_enable_concurrency_optimized_scheduler``, on by default):
  each as soon as all its operands exist, whenever its result is needed.
  What depends only on the weights (a convolution's reversed filter for
  its input gradient, a transposed kernel) is computed at the start of the
  step and held until the backward pass reads it; so are constants XLA
  makes itself (the index iotas of a max-pool gradient).
* Variables updated in the step are updated in place (their buffers are
  aliased to the step's outputs). Where XLA cannot prove, from data
  dependencies alone, that every read of a variable's old value comes
  before its new value is written, it copies the variable at the start of
  the step and keeps the copy until its last read: with tf.gradients every
  kernel, gamma and beta of ResNet50 was copied (89.8 MiB beside 94 MiB of
  weights). See :func:`ordered_boundary`.
* Elementwise ops are fused into their consumers, duplicating cheap
  producers: a kept tensor computed elementwise (a block's batch norm, sum
  and ReLU) may be recomputed inside a reader in the backward pass from
  what it was computed from, which then stays alive instead.

This module holds the facts memsave acts on: which boundary gradients the
rewrite orders (:func:`ordered_boundary`) and which ops it differentiates
in place rather than recomputes under XLA (:func:`in_place_ops`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from memsave.graph import ForwardGraph

__all__ = ["MAX_POOL_TYPES", "CHEAP_ELEMENTWISE_TYPES", "XlaModel", "breadth_first_order",
           "copy_gradient_reads", "xla_costs", "feeds_x", "fused_sources", "in_place_ops",
           "not_duplicated", "ordered_boundary"]

#: Max-pool op types. XLA lowers the stock gradient into a search for each
#: window's maximum (a reduce-window over the input and four ``s32`` iotas
#: of the padded input's shape) and a scatter of the incoming gradient into
#: zeros of the padded input's shape. Neither depends on the incoming
#: gradient: XLA's breadth-first schedule makes the iotas at the start of
#: the step, and for the original op runs the search in the forward pass,
#: holding the indices found and the zeros to the end of the step (measured
#: on ResNet50 64x64 batch 32: 8.4 and 9.5 MB). A recomputed ``MaxPool``
#: gets :func:`memsave.xla_gradients.max_pool_gradient` instead, which
#: makes neither; a recomputed copy with the stock gradient would wait for
#: its recomputation while the iotas stay alive for the whole step (4 x 9
#: MiB), so the others are differentiated in place (:func:`in_place_ops`).
MAX_POOL_TYPES = frozenset({"MaxPool", "MaxPoolV2", "MaxPool3D"})


def in_place_ops(fg: ForwardGraph) -> frozenset[int]:
    """Ops of ``fg`` to differentiate in place under XLA: the max-pools
    (:data:`MAX_POOL_TYPES`) that memsave's own gradient does not cover
    (``MaxPoolV2``, ``MaxPool3D``, and a ``MaxPool`` of unknown shape; see
    :func:`memsave.xla_gradients.xla_gradient_for`); none outside XLA."""
    if not fg.xla:
        return frozenset()
    return frozenset(op.index for op in fg.ops if op.type in MAX_POOL_TYPES and not (
        op.type == "MaxPool" and all(fg.tensors[t].size_known for t in (*op.inputs, *op.outputs))))


#: Bytes of one ``s32`` index (a max-pool gradient's window maxima, see
#: :data:`MAX_POOL_TYPES`).
_INDEX_BYTES = 4


def feeds_x(fg: ForwardGraph, t: int) -> bool:
    """Whether tensor ``t`` is an x or the read of one (the output of an op
    whose inputs are all xs, e.g. ``ReadVariableOp``): its gradient is the
    x's, passed through."""
    if t in fg.xs:
        return True
    producer = fg.tensors[t].producer
    if producer is None:
        return False
    inputs = fg.ops[producer].inputs
    return bool(inputs) and all(u in fg.xs for u in inputs)


def ordered_boundary(fg: ForwardGraph, boundary: tuple[int, ...],
                     ops: Sequence[int]) -> tuple[int, ...]:
    """The weights of a step's boundary whose gradients wait for the whole step.

    Under XLA (``fg.xla``) only. A weight's gradient does not depend on
    every read of the weight: a convolution's or matmul's gradient with
    respect to its input reads the weight (in a recomputed segment, the
    gated ``w + gate``, which XLA fuses into its readers) but feeds only
    the gradients of earlier layers, so XLA copies the weight to keep its
    old value for that read (see the module docstring). The rewrite adds to
    each of these weights' gradients a zero computed from all the step's
    gradients (``g + gate``, :mod:`memsave.rewrite`): every read of a
    weight in the step then comes before its update (the forward pass's
    reads precede every gradient), and XLA copies nothing; the weights'
    gradients live to the end of their step. Measured on ResNet50 (SGD in
    the step): no kernel copied, the step's XLA temporaries 173 MiB instead
    of 180 MiB. Empty outside XLA, and for a step with one boundary tensor
    (whose gradient depends on every op of the step already). Only weights
    that an op of the step (``ops``) reads other than as a variable read:
    an x read by ReadVariableOps alone gets their gradients passed through,
    and ordering it would make every weight's update wait for every
    gradient of that step.
    """
    if not fg.xla or len(boundary) < 2:
        return ()
    weights = {t for t in boundary if feeds_x(fg, t)}
    read = set()
    for o in ops:
        op = fg.ops[o]
        if any(not feeds_x(fg, u) for u in op.outputs):
            read.update(u for u in op.inputs if u in weights)
    return tuple(t for t in boundary if t in read)


# -- the memory model: what XLA holds besides what the executor would -----------

#: Convolutions whose gradients XLA:CPU lowers to convolutions over
#: re-laid-out operands: the input gradient reads the kernel reversed (3x3)
#: or transposed (1x1, emitted as a dot), the kernel gradient reads the
#: input transposed. Both are new buffers, computed as soon as what they
#: read exists (breadth-first schedule): the kernel's at the start of the
#: step (or of the recompute step whose gate it reads), the input's right
#: after the input; each is held until the gradient reads it. Measured at
#: the peak of tf.gradients' ResNet50 step: 95 MiB of kernel-shaped
#: buffers (94 MiB of weights) and 82 MiB of transposed activations.
TRANSFORMED_OPERAND_TYPES = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative"})

#: Depthwise convolutions, whose stock kernel gradient XLA:CPU expands into
#: a dense convolution over every pair of channels and its masked diagonal:
#: two float32 buffers of ``kh * kw * C * C * multiplier`` elements while the
#: gradient runs (31.6 MiB each for MobileNetV2's 960 channels). memsave's
#: copies get another gradient (:mod:`memsave.xla_gradients`); the
#: originals (tf.gradients, and ops differentiated in place) keep it.
DENSE_DEPTHWISE_GRADIENT_TYPES = frozenset({"DepthwiseConv2dNative"})

#: Elementwise op types XLA fuses into their readers, recomputing them there
#: rather than keeping their outputs (``InstructionFusion`` duplicates a
#: producer into its consumers unless it is expensive: exponentials,
#: logarithms, divisions, square roots and the like are, and their outputs
#: are kept). A gradient that reads such an op's output reads, in XLA, what
#: the op was computed from (:func:`fused_sources`): measured on ResNet50,
#: each block output's ReLU, sum and batch norms were recomputed inside the
#: backward pass's readers from the two convolution outputs, which stayed
#: alive instead of the block output. Keras' batch norm is such a chain
#: (``moments`` reductions, then ``Sub``, ``Mul``, ``AddV2``). ``Pad`` is
#: not one: XLA materialises a padded tensor that a gradient reads
#: (MobileNetV2's ``block_*_pad``, kept from the forward pass to the
#: depthwise gradient; measured: with ``Pad`` counted as fused, 'memory''s
#: forecast was 36% under the measured peak, without, 25%, and the plan
#: it chose 0.33x plain's bytes above the resident ones instead of 0.38x).
CHEAP_ELEMENTWISE_TYPES = frozenset({
    "Relu", "Relu6", "LeakyRelu", "Elu", "Add", "AddV2", "Sub", "Mul", "Neg", "Abs", "Maximum",
    "Minimum", "BiasAdd", "Cast", "Square", "SquaredDifference", "Select", "SelectV2",
    "Identity", "Reshape", "ExpandDims", "Squeeze", "ClipByValue", "OnesLike", "ZerosLike",
})

#: Largest number of tensors one read expands to (:func:`fused_sources`); a
#: wider fan-in is kept as it is (XLA also stops fusing very wide inputs).
MAX_FUSED_SOURCES = 8

#: Bytes XLA:CPU computes a float16 or bfloat16 convolution in (float32).
_CONV_ACCUMULATOR_BYTES = 4

#: Half-precision dtypes (``TensorNode.dtype``) XLA:CPU widens in convolutions.
HALF_DTYPES = frozenset({"float16", "bfloat16"})

#: Op types whose float16/bfloat16 outputs XLA:CPU computes and keeps in
#: float32: it converts the operands of a half-precision convolution or dot
#: to float32, and the conversion of the result back is fused into each of
#: its readers, so the buffer that lives is the float32 result; so is the
#: gradient that reaches it (Keras' mixed-precision batch norm, which
#: normalises in float32, differentiates it in float32). Read from XLA's
#: buffer assignment of keras.applications MobileNetV2 (64x64, batch 32,
#: ``mixed_float16``, 'memory', SGD in the step): at the peak, the
#: expand convolution's output ``f32[32,32,32,96]`` (12 MiB, 6 MiB in
#: float16), its gradient as ``f32``, and the dilated gradient of the strided
#: depthwise convolution after it ``f32[32,33,33,96]`` (13 MiB).
UPCAST_OP_TYPES = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul",
                             "BatchMatMulV2", "BatchMatMulV3"})


class XlaModel:
    """Per op, the buffers an XLA-compiled step holds besides the executor's.

    Built once per graph and costs (TF-free); read by
    :mod:`memsave.simulate` when ``fg.xla``. Every buffer is one the
    gradient of its op reads:

    * :meth:`early`: written when the op runs (in the forward pass, or
      recomputed in a step), as the simulator's early gradient values are:
      the transposed input of a convolution
      (:data:`TRANSFORMED_OPERAND_TYPES`) whose kernel gets a gradient; for
      an original max-pool (:data:`MAX_POOL_TYPES`), the zeros its stock
      gradient scatters into (the size of the input) and the indices of
      each window's maximum (an ``s32`` per dimension of the input per
      output element); nothing for a recomputed one (memsave's own
      gradient);
    * :meth:`kernel`: the reversed or transposed kernel of a convolution
      whose input gets a gradient, made as soon as the kernel can be read:
      at the start of the step for the original op, when its recompute
      step's gate opens for a copy (the gated kernel ``w + gate`` and its
      transform are then both alive, measured: 118 MiB of kernel-shaped
      buffers at the start of ResNet50's last stage's recompute step, its
      weights being 60 MiB);
    * :meth:`gradient_scratch`: what a convolution's gradient holds while
      it runs: the re-laid-out incoming gradient, the incoming gradient
      spread over the input's positions for a strided convolution, and the
      dense depthwise kernel gradient's buffers
      (:data:`DENSE_DEPTHWISE_GRADIENT_TYPES`, stock gradients only).

    Each is counted at float32's width for a float16 or bfloat16
    convolution, which XLA:CPU computes in float32 (:data:`UPCAST_OP_TYPES`).

    Not modelled: the weight copies XLA makes for plain tf.gradients with
    the update in the step (measured on ResNet50: 89.8 MiB of copies, 53
    MiB of them placed in the buffers of parameters already copied, so
    about 40 MiB more at the peak), the breadth-first order itself beyond
    these buffers, and fusions other than :func:`fused_sources`. On
    MobileNetV2 (64x64, batch 32, 'memory', SGD in the step) XLA's peak is
    at the first blocks' gradients: the strided depthwise gradient's padded
    input and dilated gradient (13.4 MB each) beside a kept 12.6 MB
    convolution output and its ReLU6 gradient; the forecast is 8% under
    (custom loop; 17% in ``fit``). In mixed_float16 with a loss scale,
    XLA's temporaries at its peak (60.4 MiB, one allocation: the step's
    measured bytes above the resident ones) were four float32 buffers of
    block 1 (its kept expand output, the dilated gradient of the strided
    depthwise convolution after it and two more of its gradient: 48.8
    MiB), 7 MiB of weight gradients held for the loss scale's
    finite check (:attr:`memsave.MemoryModel.xla_update_in_step`) and 2.6
    MiB of buffers under 256 KiB; the forecast is 9% under.
    """

    def __init__(self, fg: ForwardGraph, costs) -> None:
        self._fg = fg
        self._memo: dict = {}
        self._early: dict[int, tuple[int, ...]] = {}
        self._early_copy: dict[int, tuple[int, ...]] = {}
        self._copy_reads = copy_gradient_reads(fg, costs, self._memo)
        self._kernel: dict[int, tuple[int, int]] = {}
        self._scratch: dict[int, int] = {}
        self._scratch_copy: dict[int, int] = {}
        # XLA:CPU computes a float16/bfloat16 convolution in float32: every
        # buffer it makes for one (re-laid-out operands, dilated gradients)
        # is float32 (UPCAST_OP_TYPES).
        tensor_bytes = _AccumulatorBytes(fg, costs.tensor_bytes)
        for op in fg.ops:
            i = op.index
            if not costs.gradient[i].has_gradient:
                continue
            targets = {t for _, t in costs.gradient_targets[i]}
            if op.type in TRANSFORMED_OPERAND_TYPES and len(op.inputs) >= 2 and op.outputs:
                x, w, y = op.inputs[0], op.inputs[1], op.outputs[0]
                dense = op.type in DENSE_DEPTHWISE_GRADIENT_TYPES
                # While the gradient runs: the incoming gradient re-laid out
                # for the kernel's gradient, and for a strided convolution
                # the incoming gradient spread over the input's positions
                # (XLA's "base-dilated" convolution) for the input's.
                transient = copy_transient = 0
                if x in targets:
                    self._kernel[i] = (w, tensor_bytes[w])
                    if _strided(fg, x, y):
                        transient = copy_transient = tensor_bytes[x]
                if w in targets:
                    self._early[i] = (tensor_bytes[x],)
                    transient += tensor_bytes[y]
                    # A recomputed depthwise convolution is differentiated by
                    # memsave.xla_gradients, which reads no transposed input
                    # or gradient (but the input itself: copy_gradient_reads);
                    # the stock one expands to a dense kernel gradient over
                    # all channel pairs.
                    if not dense:
                        self._early_copy[i] = (tensor_bytes[x],)
                        copy_transient += tensor_bytes[y]
                    else:
                        shape = fg.tensors[w].shape
                        if shape and len(shape) == 4 and all(isinstance(d, int) for d in shape):
                            kh, kw, c, m = shape
                            transient += 2 * kh * kw * c * c * m * _CONV_ACCUMULATOR_BYTES
                if transient:
                    self._scratch[i] = transient
                if copy_transient:
                    self._scratch_copy[i] = copy_transient
            elif op.type in MAX_POOL_TYPES and op.inputs and op.outputs:
                y = fg.tensors[op.outputs[0]]
                rank = len(y.shape) if y.shape is not None else 4
                indices = y.size_bytes // (y.itemsize or 4) * rank * _INDEX_BYTES
                self._early[i] = (costs.tensor_bytes[op.inputs[0]], indices)

    def early(self, i: int, *, recomputed: bool) -> tuple[int, ...]:
        """Bytes of the buffers op ``i`` makes, when it runs, for its gradient."""
        return (self._early_copy if recomputed else self._early).get(i, ())

    def copy_gradient_reads(self, i: int) -> tuple[int, ...]:
        """:func:`copy_gradient_reads` of op ``i``."""
        return self._copy_reads.get(i, ())

    def kernel(self, i: int) -> tuple[int, int] | None:
        """``(kernel tensor id, bytes)`` of op ``i``'s transformed kernel, or None."""
        return self._kernel.get(i)

    def fused_sources(self, t: int) -> tuple[int, ...]:
        """:func:`fused_sources` of tensor ``t``."""
        return fused_sources(self._fg, t, self._memo)

    def gradient_scratch(self, i: int, *, recomputed: bool) -> int:
        """Bytes of the temporaries op ``i``'s gradient makes under XLA."""
        return (self._scratch_copy if recomputed else self._scratch).get(i, 0)


def copy_gradient_reads(fg: ForwardGraph, costs, memo: dict | None = None
                        ) -> dict[int, tuple[int, ...]]:
    """Per op, what the gradient of its recomputed copy reads under XLA
    besides :func:`xla_costs`' reads (which stand for the stock gradient's).

    A depthwise convolution whose kernel gets a gradient
    (:data:`DENSE_DEPTHWISE_GRADIENT_TYPES`): :func:`xla_costs` drops its
    input from the gradient's reads, as the stock kernel gradient reads the
    re-laid-out copy :class:`XlaModel` makes early; memsave's kernel gradient
    (:mod:`memsave.xla_gradients`) reads windows of the input itself (through
    its fused sources), so the input lives until that gradient runs.
    Measured on keras.applications MobileNetV2 (64x64, batch 32, 'memory',
    SGD in the step): at XLA's peak, a strided depthwise gradient held its
    padded input (12.8 MiB) that the forecast had freed after the
    recomputation; with it counted, the forecast went from 17% to 8% under
    the measured peak, and 'memory' chose a plan that measured 62.5 MiB
    instead of 66.5. Empty outside XLA.
    """
    if not fg.xla:
        return {}
    memo = {} if memo is None else memo
    out = {}
    for op in fg.ops:
        if op.type not in DENSE_DEPTHWISE_GRADIENT_TYPES or len(op.inputs) < 2 \
                or not costs.gradient[op.index].has_gradient:
            continue
        if any(t == op.inputs[1] for _, t in costs.gradient_targets[op.index]):
            out[op.index] = fused_sources(fg, op.inputs[0], memo)
    return out


class _AccumulatorBytes:
    """Bytes of a tensor as XLA:CPU holds it in a convolution: at least the
    float32 accumulator's width (a tensor already widened by :func:`xla_costs`
    is not widened again)."""

    def __init__(self, fg: ForwardGraph, tensor_bytes) -> None:
        self._fg, self._bytes = fg, tensor_bytes

    def __getitem__(self, t: int) -> int:
        node = self._fg.tensors[t]
        n = self._bytes[t]
        if node.dtype in HALF_DTYPES and 0 < node.itemsize < _CONV_ACCUMULATOR_BYTES \
                and not _widened(self._fg, t):
            return n * _CONV_ACCUMULATOR_BYTES // node.itemsize
        return n


def _widened(fg: ForwardGraph, t: int) -> bool:
    """Whether :func:`xla_costs` counts tensor ``t`` at float32 width."""
    node = fg.tensors[t]
    return (node.dtype in HALF_DTYPES and node.producer is not None
            and fg.ops[node.producer].type in UPCAST_OP_TYPES)


def _strided(fg: ForwardGraph, x: int, y: int) -> bool:
    """Whether a convolution from ``x`` to ``y`` (NHWC or NCHW) has fewer output positions."""
    xs, ys = fg.tensors[x].shape, fg.tensors[y].shape
    if not xs or not ys or len(xs) != len(ys) or len(xs) < 3:
        return False
    inner = [(a, b) for a, b in zip(xs[1:], ys[1:]) if a is not None and b is not None]
    return sum(1 for a, b in inner if b < a) >= len(xs) - 3


def _elements(node) -> int:
    """Elements of a tensor (its bytes when it has no itemsize, as hand-built ones)."""
    return node.size_bytes // node.itemsize if node.itemsize else node.size_bytes


def not_duplicated(fg: ForwardGraph, i: int) -> bool:
    """Whether XLA materialises the output of cheap elementwise op ``i``
    rather than duplicate it into its readers.

    XLA's ``InstructionFusion::ComputeGloballyUnfusible``: a producer with
    more than one operand as large as its output (an ``AddV2`` of two
    activations; a bias or a broadcast scalar does not count), whose operands
    hold more elements than its output, is duplicated only if it can be fused
    into every consumer; a convolution or a matmul cannot take it.
    Counted here: such an op with a forward reader that is not itself a
    cheap elementwise op (any other reader is taken as one that cannot).
    Measured on a residual CNN (``h = h + relu(conv(h))`` x 8,
    64x32x32x16, Keras ``fit``, Adam, ``memory_budget=0.7``): XLA kept
    every sum, which the next convolution reads, at the peak (6 x 4 MiB);
    with them taken as fused into their readers the forecast was 30% under
    XLA's temporaries (53.5 MiB against 76.8). A sum read only by
    elementwise ops (ResNet50's block sum, read by its ReLU) stays fused.
    """
    op = fg.ops[i]
    if not op.outputs:
        return False
    out = _elements(fg.tensors[op.outputs[0]])
    inputs = [fg.tensors[u] for u in dict.fromkeys(op.inputs)]
    if sum(1 for n in inputs if _elements(n) >= out) < 2 or sum(map(_elements, inputs)) <= out:
        return False
    consumers = fg.consumers()
    return any(fg.ops[c].type not in CHEAP_ELEMENTWISE_TYPES
               for t in op.outputs for c in consumers[t])


def fused_sources(fg: ForwardGraph, t: int, memo: dict | None = None) -> tuple[int, ...]:
    """What a read of tensor ``t`` reads in XLA: ``t`` itself, or, when its
    producer is a cheap elementwise op (:data:`CHEAP_ELEMENTWISE_TYPES`)
    that XLA duplicates into its readers (not :func:`not_duplicated`),
    the fused sources of that op's inputs (its non-elementwise ancestors, at
    most :data:`MAX_FUSED_SOURCES`). Constants and external inputs are
    dropped (resident anyway). ``memo`` caches answers across calls.
    """
    if memo is None:
        memo = {}
    stack = [t]
    while stack:
        u = stack[-1]
        if u in memo:
            stack.pop()
            continue
        node = fg.tensors[u]
        if node.producer is None or fg.ops[node.producer].type not in CHEAP_ELEMENTWISE_TYPES \
                or not_duplicated(fg, node.producer):
            memo[u] = (u,)
            stack.pop()
            continue
        inputs = [v for v in fg.ops[node.producer].inputs if fg.tensors[v].kind == "internal"]
        pending = [v for v in inputs if v not in memo]
        if pending:
            stack.extend(pending)
            continue
        found = tuple(dict.fromkeys(w for v in inputs for w in memo[v]))
        memo[u] = found if 0 < len(found) <= MAX_FUSED_SOURCES else (u,)
        stack.pop()
    return memo[t]


def xla_costs(fg: ForwardGraph, costs):
    """``costs`` with what each gradient reads as XLA reads it.

    A read of a cheap elementwise op's output becomes reads of its fused
    sources (:func:`fused_sources`); a float16/bfloat16 output of
    :data:`UPCAST_OP_TYPES` counts float32's bytes; a convolution's gradient
    (:data:`TRANSFORMED_OPERAND_TYPES`) reads the re-laid-out input and
    kernel that :class:`XlaModel` makes in their place, not the input and
    kernel themselves. Returns ``costs`` unchanged outside XLA.
    """
    if not fg.xla:
        return costs
    memo: dict = {}
    reads = []
    for op, (read_ins, read_outs) in zip(fg.ops, costs.gradient_reads):
        targets = {t for _, t in costs.gradient_targets[op.index]}
        if op.type in TRANSFORMED_OPERAND_TYPES and len(op.inputs) >= 2:
            x, w = op.inputs[0], op.inputs[1]
            read_ins = tuple(t for t in read_ins
                             if not (t == x and w in targets) and not (t == w and x in targets))
        ins = tuple(dict.fromkeys(u for t in read_ins for u in fused_sources(fg, t, memo)))
        outs = tuple(dict.fromkeys(u for t in read_outs for u in fused_sources(fg, t, memo)))
        reads.append((ins, outs))
    tensor_bytes = list(costs.tensor_bytes)
    for node in fg.tensors:
        if _widened(fg, node.id) and 0 < node.itemsize < _CONV_ACCUMULATOR_BYTES:
            tensor_bytes[node.id] = tensor_bytes[node.id] * _CONV_ACCUMULATOR_BYTES // node.itemsize
    return dataclasses.replace(costs, gradient_reads=tuple(reads), tensor_bytes=tuple(tensor_bytes))


def breadth_first_order(reads: Sequence[Sequence[int]],
                        writes: Sequence[Sequence[tuple[int, tuple]]], n_values: int) -> list[int]:
    """The order XLA:CPU runs a program's instructions in: breadth-first.

    ``reads[k]`` and ``writes[k]`` are the values instruction ``k`` reads and
    writes (``(value, candidates)`` pairs, as :mod:`memsave.simulate` builds
    them). An instruction is ready once every value it reads is written;
    ready instructions run first come, first served, those ready from the
    start in program order, then each one's readers in program order as
    they become ready (XLA's ``BFSMemoryScheduler``, the default of
    ``xla_cpu_enable_concurrency_optimized_scheduler``). Returns the
    instruction indices in that order. Linear in instructions plus reads.
    """
    n = len(reads)
    writer = [-1] * n_values
    for k, ws in enumerate(writes):
        for v, _ in ws:
            writer[v] = k
    waiting = [0] * n
    readers: list[list[int]] = [[] for _ in range(n)]
    for k, rs in enumerate(reads):
        deps = {writer[r] for r in rs}
        deps.discard(-1)
        deps.discard(k)
        waiting[k] = len(deps)
        for d in deps:
            readers[d].append(k)
    ready = collections.deque(k for k in range(n) if not waiting[k])
    order = []
    while ready:
        k = ready.popleft()
        order.append(k)
        for u in sorted(readers[k]):
            waiting[u] -= 1
            if not waiting[u]:
                ready.append(u)
    if len(order) != n:
        raise AssertionError("this is a bug in memsave: the simulated program has a cycle")
    return order


#: Under XLA, a plan forecast to save less than this fraction of plain
#: tf.gradients' peak makes memsave.gradients warn (with the forecast and
#: where its peak is) rather than build it silently.
MIN_XLA_SAVING_FRACTION = 0.1


def saving_warning(problem, schedule, *, min_saving_fraction: float = MIN_XLA_SAVING_FRACTION) -> str:
    """Under XLA, why ``schedule`` is forecast to save little, or ``""``.

    Reads the problem's XLA forecasts (every byte counted, as planners
    compare) of the plan and of plain tf.gradients; a plan that saves at
    least ``min_saving_fraction`` of the plain peak, or a graph not compiled
    by XLA, gets ``""``.
    """
    if not problem.fg.xla or schedule is None:
        return ""
    judge = problem.judge
    ours = problem.forecast(schedule, model=judge)
    plain = problem.peak(None, model=judge)
    if ours.peak_bytes <= (1.0 - min_saving_fraction) * plain:
        return ""
    return (
        f"under XLA (jit_compile=True) this plan is forecast to peak at {ours.peak_bytes:,} "
        f"bytes against tf.gradients' {plain:,} ({ours.peak_bytes / max(plain, 1):.2f}x): "
        f"XLA's own buffers (re-laid-out kernels and inputs of convolutions, the kernels a "
        f"recompute step gates, gradient temporaries) set the peak at {ours.peak_event!r}. "
        "See memsave.plan(...).summary(); fewer checkpoints or memory_budget= may do better")
