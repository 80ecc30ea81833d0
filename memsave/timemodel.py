"""The time model: estimated seconds of each op, of its gradient, and of a step.

Data flow: :func:`op_seconds` takes a :class:`~memsave.graph.ForwardGraph`,
its :class:`~memsave.costs.Costs` (bytes per tensor, FLOPs per op, what each
gradient reads) and a :class:`DeviceProfile`, and returns an
:class:`OpSeconds`: per op, the forecast seconds of its forward kernel and
of its gradient. :func:`step_time` adds them up into a :class:`StepTime` for
plain backprop or for a checkpointed :class:`~memsave.schedule.Schedule`
(plain step + the recomputed ops' forward seconds + the rewrite's gates), so
a plan can report its forecast step time as a ratio to plain's. Nothing here
touches TensorFlow: :mod:`memsave.calibrate` measures a profile on the
current device (TensorFlow microbenchmarks), :data:`CPU_DEFAULT` is what it
measured on the reference machine. One module, though long: the op
classes, the per-op roofline, the step sum and the default profile are one
model, each constant beside the reason for it.

Why seconds and not FLOPs
-------------------------
On a CPU the batch-norm, ReLU and add ops of a conv net do few FLOPs but
stream their tensors through memory: in ResNet-110's forward pass (batch
32) they are 1/300 of the FLOPs and about a fifth of the time. A planner
that counts FLOPs calls them free to recompute; one that counts seconds
does not.

The model of one op
-------------------
A roofline with a launch cost (Williams et al., "Roofline: an insightful
visual performance model", CACM 2009)::

    seconds = overhead_s + fixed_s
              + max(flops / (peak_flops_per_s * compute * gemm(k)),
                    bytes / (bytes_per_s * memory))

* ``flops``: ``Costs.op_flops`` (TensorFlow's registered count, else the
  elements produced); ``bytes``: what the kernel reads and writes, each
  distinct input once plus every output (resource handles and variants
  count 0; ops of the ``"movement"`` class read at most what they write,
  so a Slice of a large tensor reads the slice).
* ``compute``, ``memory`` and ``fixed_s``: the op class's
  :class:`Efficiency` (classes in :data:`OP_CLASSES`: products,
  convolutions, elementwise, transcendental, normalization, reductions,
  data movement, softmax, pooling). ``peak_flops_per_s`` is a large
  matrix product's rate, ``bytes_per_s`` an add and a ReLU's; a class's
  factors say how far its kernels fall from them, ``fixed_s`` what each
  of its kernels costs whatever its size.
* ``gemm(k) = k / (k + gemm_half_k)``: products and convolutions with a
  short reduction (``k = flops / (2 * output elements)``: the inner
  dimension of a MatMul, ``kh * kw * c_in`` of a Conv2D) reach a smaller
  fraction of peak (a 3-channel stem convolution runs at a third of the
  rate of a 64-channel one).
* Views (:data:`memsave.costs.ALIAS_OP_TYPES`: Identity, Reshape,
  ReadVariableOp, ...) cost nothing. So do, in the forward pass,
  activations Grappler's remapper fuses into their producer's kernel
  (:func:`fused_into_producer`: a Relu after a FusedBatchNorm, a BiasAdd
  after a MatMul or Conv2D): their work is in the producer's time. Their
  copies in a recompute step are counted as kernels of their own
  (:attr:`OpSeconds.recompute`).

The model of a gradient
-----------------------
What the gradient kernels read and write, as :mod:`memsave.costs` learned
it from TensorFlow (``GradientUse``): the incoming gradients, the inputs and
outputs the gradient reads, and one gradient per input that needs one
(inputs from outside the graph need none; a pass-through such as AddV2's
writes nothing). Products and convolutions compute one product of the
forward's size per operand that needs a gradient. That roofline, on the
efficiency of the class's gradient kernels (:data:`GRADIENT_CLASSES`: the
gradient of ``tanh`` is algebraic, not transcendental), times the class's
``Efficiency.gradient`` correction, plus a launch and the class's fixed
cost per kernel. Where an op's output feeds several ops, the backward pass
sums their gradients (an AddN): :attr:`OpSeconds.accumulate`.

A step
------
Plain: every op's forward, gradient and sums. Checkpointed: the same plus,
per recompute step, the copies that run (those its gradients read, as
:mod:`memsave.simulate` decides) and the rewrite's gates
(:func:`step_time`). The gradients themselves are the same either way.

Accuracy
--------
``experiments/time_model.py`` compares these forecasts with the kernel
times TensorFlow measures (step stats) on the study's models, per op
type, and the forecast step ratios of checkpointed plans with measured
ones; its docstring has the tables. On ResNet-110 the forecast ratios of
'memory', 'speed' and budgets 0.2-0.75 are within 6% of the median
measured kernel-sum ratios (single runs on a loaded machine scatter by
10-15%); on U-Net-64 they are 3-20% high. Known limits: caches (a tensor
recomputed just before its gradient reads it is still in cache, so a
checkpointed step's gradients can run faster than plain's: 0.84-0.98x on
U-Net-64); the executor's overlap of independent kernels and its
dispatch cost under load (a step is the sum of its kernels); kernels
whose speed varies between processes (oneDNN ran the same convolutions
at about 180 or about 290 GFLOP/s), averaged into one factor per class.
"""

from __future__ import annotations

import dataclasses
import math
import types
import weakref
from collections.abc import Iterable, Mapping, Sequence

from memsave.costs import ALIAS_OP_TYPES, Costs, body_costs
from memsave.errors import DeviceProfileError
from memsave.graph import Body, ForwardGraph, OpNode
from memsave.schedule import Schedule
from memsave.simulate import copies_that_run  # the one rule for which copies run
from memsave.simulate import paused_gc

__all__ = [
    "Efficiency",
    "DeviceProfile",
    "CPU_DEFAULT",
    "OP_CLASSES",
    "GRADIENT_CLASSES",
    "PER_OPERAND_CLASSES",
    "FUSED_ACTIVATIONS",
    "GATE_OPS",
    "op_class",
    "fused_into_producer",
    "OpSeconds",
    "op_seconds",
    "StepTime",
    "step_time",
    "StepSeconds",
    "step_seconds",
    "head_gate_seconds",
]


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """How far the kernels of one op class fall from the device's peaks.

    Attributes
    ----------
    compute : float
        Fraction of ``peak_flops_per_s`` the class's kernels reach (per
        FLOP as :mod:`memsave.costs` counts them: one per element for
        elementwise ops, so a transcendental function, which takes tens of
        instructions per element, has a compute factor well under 1).
    memory : float
        Fraction of ``bytes_per_s`` the class's kernels stream at.
    gradient : float
        Correction applied to the gradient's roofline (measured gradient
        kernel seconds over the roofline's, on the reference machine).
    fixed_s : float
        Seconds each kernel of the class costs besides its roofline and
        the launch overhead: a oneDNN batch norm takes about 60 us even on
        a 256 KiB tensor (its per-channel statistics, thread
        synchronisation), the intercept of its time against its bytes.
    """

    compute: float = 1.0
    memory: float = 1.0
    gradient: float = 1.0
    fixed_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("compute", "memory", "gradient"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise DeviceProfileError(
                    f"memsave.timemodel.Efficiency: {f}={v!r}; it must be a positive "
                    "finite number (a fraction of the device's peak, or a correction factor)")
        if not isinstance(self.fixed_s, (int, float)) or not math.isfinite(self.fixed_s) \
                or self.fixed_s < 0:
            raise DeviceProfileError(
                f"memsave.timemodel.Efficiency: fixed_s={self.fixed_s!r}; it must be a finite "
                "number of seconds >= 0")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one device does per second, as :func:`op_seconds` needs it.

    Attributes
    ----------
    name : str
        Where the figures come from, for messages.
    peak_flops_per_s : float
        FLOP/s of a large float32 matrix product (the roofline's roof).
    bytes_per_s : float
        Bytes/s read plus written by elementwise ops on MiB-sized tensors:
        an add of two operands read from memory and the in-place ReLU of
        its result, together (the roofline's slope).
    overhead_s : float
        Seconds every kernel costs besides its work: the executor's
        dispatch (measured on a chain of small ops).
    gemm_half_k : float
        Reduction length at which a product or convolution reaches half of
        its class's compute efficiency (see module docstring).
    efficiency : mapping of str to Efficiency
        Per op class (:data:`OP_CLASSES`); a class not listed gets
        ``Efficiency()``.
    step_s : float
        Seconds each recompute step adds beyond its kernels, as measured;
        the cause is not known (making a step's copies wait only for the
        gradients later steps take further, not the weights', did not
        remove it). Not calibrated (see :data:`CPU_DEFAULT`).
    """

    name: str
    peak_flops_per_s: float
    bytes_per_s: float
    overhead_s: float
    gemm_half_k: float
    efficiency: Mapping[str, Efficiency] = dataclasses.field(default_factory=dict, hash=False)
    step_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("peak_flops_per_s", "bytes_per_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise DeviceProfileError(
                    f"memsave.timemodel.DeviceProfile: {f}={v!r}; it must be a positive finite "
                    "number (measure it with memsave.calibrate.calibrate())")
        for f in ("overhead_s", "gemm_half_k", "step_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise DeviceProfileError(
                    f"memsave.timemodel.DeviceProfile: {f}={v!r}; it must be a finite number >= 0")
        unknown = sorted(set(self.efficiency) - set(CLASSES))
        if unknown:
            raise DeviceProfileError(
                f"memsave.timemodel.DeviceProfile: efficiency for unknown op classes {unknown}; "
                f"the classes are {list(CLASSES)}")
        for k, v in self.efficiency.items():
            if not isinstance(v, Efficiency):
                raise DeviceProfileError(
                    f"memsave.timemodel.DeviceProfile: efficiency[{k!r}] is {v!r}; pass an "
                    "Efficiency(compute=..., memory=..., gradient=...)")
        object.__setattr__(self, "efficiency", types.MappingProxyType(dict(self.efficiency)))

    def of(self, cls: str) -> Efficiency:
        """The efficiency of op class ``cls`` (``Efficiency()`` when not listed)."""
        return self.efficiency.get(cls, _NEUTRAL)

    def replace(self, **changes) -> "DeviceProfile":
        """A copy with some fields changed; ``efficiency=`` entries are merged
        into this profile's (``{"conv": Efficiency(compute=0.9)}`` changes
        the conv class only)."""
        if "efficiency" in changes:
            changes["efficiency"] = {**self.efficiency, **changes["efficiency"]}
        return dataclasses.replace(self, **changes)


_NEUTRAL = Efficiency()

#: The op classes, and what each holds (the keys of ``DeviceProfile.efficiency``).
CLASSES = {
    "view": "output is a view of an input: no kernel work (ALIAS_OP_TYPES)",
    "metadata": "reads shapes only (Shape, Size, Rank)",
    "matmul": "matrix products (MatMul, BatchMatMul, Einsum)",
    "conv": "convolutions (Conv2D, DepthwiseConv2dNative, Conv3D, transposed)",
    "normalization": "batch normalization (FusedBatchNorm*)",
    "elementwise": "arithmetic per element, and any op type not listed",
    "transcendental": "per-element functions of many instructions (tanh, exp, erf)",
    "reduction": "reductions over axes (Sum, Mean, Max, ArgMax)",
    "movement": "data movement (Transpose, Pad, Concat, Slice, Tile, Gather)",
    "softmax": "softmax and cross-entropy",
    "pooling": "max and average pooling",
}

_TYPES_BY_CLASS = {
    "metadata": ("Shape", "ShapeN", "Size", "Rank", "BroadcastArgs", "BroadcastGradientArgs",
                 "NoOp"),
    "matmul": ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
               "SparseMatMul", "_FusedMatMul"),
    "conv": ("Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
             "Conv3DBackpropInputV2", "_FusedConv2D", "Conv"),
    "normalization": ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
                      "_FusedBatchNormEx", "LRN"),
    "transcendental": ("Tanh", "Sigmoid", "Exp", "Expm1", "Log", "Log1p", "Erf", "Erfc",
                       "Erfinv", "Gelu", "Softplus", "Pow", "Sin", "Cos", "Tan", "Asin",
                       "Acos", "Atan", "Atan2", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
                       "Lgamma", "Digamma", "Elu", "Selu", "Swish"),
    "reduction": ("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin",
                  "L2Loss", "EuclideanNorm", "BiasAddGrad", "Cumsum", "Cumprod"),
    "movement": ("Transpose", "ConjugateTranspose", "Pad", "PadV2", "MirrorPad", "Concat",
                 "ConcatV2", "Slice", "StridedSlice", "Tile", "Gather", "GatherV2",
                 "GatherNd", "ResourceGather", "Split", "SplitV", "Pack", "Unpack",
                 "ReverseV2", "BroadcastTo", "ResizeNearestNeighbor", "ResizeBilinear",
                 "SpaceToDepth", "DepthToSpace", "SpaceToBatchND", "BatchToSpaceND",
                 "OneHot", "ScatterNd", "TensorScatterUpdate", "MatrixBandPart", "Roll",
                 "Fill", "ZerosLike", "OnesLike"),
    "softmax": ("Softmax", "LogSoftmax", "SparseSoftmaxCrossEntropyWithLogits",
                "SoftmaxCrossEntropyWithLogits"),
    "pooling": ("MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D"),
}

#: Op type -> op class. Types not listed are ``"elementwise"`` (the
#: roofline of an op that reads its inputs and writes its outputs once).
OP_CLASSES: Mapping[str, str] = types.MappingProxyType({
    **{t: "view" for t in ALIAS_OP_TYPES},
    **{t: cls for cls, ts in _TYPES_BY_CLASS.items() for t in ts},
})

#: The class whose efficiency a class's gradient kernels have, where it
#: differs: the gradients of tanh, sigmoid, exp and log are algebraic in
#: the op's output (``dy * (1 - y * y)``), elementwise arithmetic; the
#: gradient of a pooling or a softmax is as memory-bound as the op.
GRADIENT_CLASSES: Mapping[str, str] = types.MappingProxyType({"transcendental": "elementwise"})

#: Classes whose gradient computes one kernel of the forward's size per
#: input that needs a gradient: a product's gradient is one product per
#: operand (``dx = dy @ w.T``, ``dw = x.T @ dy``), a convolution's one
#: backprop-input and one backprop-filter. The others' gradient is one
#: kernel (FusedBatchNormGrad gives x, scale and offset their gradients at
#: once).
PER_OPERAND_CLASSES = frozenset({"matmul", "conv"})

#: Activation op types that Grappler's remapper fuses into the kernel of
#: the op that produces their input (``remapper.cc``: Conv2D + BiasAdd +
#: activation -> _FusedConv2D, MatMul + BiasAdd + activation ->
#: _FusedMatMul, FusedBatchNorm + activation -> _FusedBatchNormEx, on CPU
#: with oneDNN too). Measured on ResNet-110's step (kernels named after the
#: FusedBatchNorm): the 55 Relus after a batch norm take no kernel of their
#: own, and the fused batch norms take no longer than the others.
FUSED_ACTIVATIONS = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu"})

#: What an activation of :data:`FUSED_ACTIVATIONS` (or a bias add) fuses into.
_FUSES_ACTIVATION = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
_FUSES_BIAS = frozenset({"Conv2D", "MatMul", "DepthwiseConv2dNative", "Conv3D"})
_BIAS_ADDS = frozenset({"BiasAdd", "BiasAddV1", "Add", "AddV2"})

#: A batch norm's copy that normalises with the forward pass's statistics
#: (``OpNode.reuses_statistics``: inference mode, one pass over x): its
#: kernel's seconds as a fraction of the training-mode kernel's. Measured
#: with oneDNN on the reference machine (FusedBatchNormV3, twenty in one
#: tf.function): 0.6-0.65 on 32x32x32x16 and 32x8x8x64, 0.75-0.8 on
#: 32x64x64x64; followed by a ReLU, which fuses into either, 0.58 on
#: 32x32x32x16. (ResNet-110's 'memory' step, 97 batch norms recomputed so:
#: forecast 1.316x -> 1.293x the plain step, measured 1.293x -> 1.268x in
#: interleaved runs, other runs 0.7% to 4% faster: the noise is as large.)
STATISTICS_REUSED = 0.6

#: Ops the rewrite adds per recomputed step to make its gate (a reshape,
#: slice, sum, cast, is_finite and where of the first element of each head's
#: gradient, then equal, and under XLA a where): tiny kernels, counted at
#: one launch each (memsave.gates.ready and gate).
GATE_OPS = 8

#: Dtypes whose tensors a kernel does not stream: a resource handle's bytes
#: (``Costs.tensor_bytes`` counts the variable behind it) are read by the
#: ReadVariableOp, a view; variants and strings have no fixed size.
_SKIPPED_DTYPES = frozenset({"resource", "variant", "string"})


def op_class(op_type: str) -> str:
    """The class of ``op_type`` in :data:`OP_CLASSES` (``"elementwise"`` when not listed)."""
    return OP_CLASSES.get(op_type, "elementwise")


def fused_into_producer(fg: ForwardGraph, op: OpNode, *, consumers=None) -> bool:
    """Whether Grappler's remapper folds ``op`` into its producer's kernel.

    A bias add (BiasAdd, or Add/AddV2 of a 1-D operand) of the output of a
    Conv2D or MatMul, and an activation of :data:`FUSED_ACTIVATIONS` of the
    output of a FusedBatchNorm or of such a fused bias add, when that output
    has no other reader in the graph (the remapper's own condition).
    """
    if not op.inputs:
        return False
    consumers = fg.consumers() if consumers is None else consumers
    src = fg.tensors[op.inputs[0]]
    if src.producer is None or len(consumers[src.id]) != 1 or src.id in fg.ys:
        return False
    producer = fg.ops[src.producer]
    if op.type in _BIAS_ADDS:
        return producer.type in _FUSES_BIAS and _is_bias(fg, op)
    if op.type in FUSED_ACTIVATIONS:
        if producer.type in _FUSES_ACTIVATION:
            return src.id == producer.outputs[0]
        return (producer.type in _BIAS_ADDS
                and fused_into_producer(fg, producer, consumers=consumers))
    return False


def _is_bias(fg: ForwardGraph, op: OpNode) -> bool:
    if op.type in ("BiasAdd", "BiasAddV1"):
        return True
    if len(op.inputs) != 2:
        return False
    shape = fg.tensors[op.inputs[1]].shape
    return shape is not None and len(shape) == 1


@dataclasses.dataclass(frozen=True)
class OpSeconds:
    """Forecast seconds per op of one ForwardGraph.

    Attributes
    ----------
    forward : tuple of float
        Per op: its forward kernel (0 for views and fused ops; for a call
        or loop, its body's forward times its trips).
    recompute : tuple of float
        Per op: its copy's kernel in a recompute step, fused or not. The
        remapper fuses copies as it fuses the forward pass where the
        producer is copied in the same step (memsave.rewrite gives them no
        control input), but not where the producer's output is kept and
        the copy reads its proxy; counting the kernel keeps a plan that
        keeps the activation's input from looking free (an upper bound
        where both are recomputed: measured on ResNet-110, a recomputed
        batch norm's ReLU is a kernel of its own no more).
    gradient : tuple of float
        Per op: its gradient kernels (0 where no input takes a gradient).
    accumulate : tuple of float
        Per tensor: summing the gradients its readers send it (an AddN
        when more than one does), 0 otherwise.
    profile : DeviceProfile
        The profile the figures were computed with.
    """

    forward: tuple[float, ...]
    recompute: tuple[float, ...]
    gradient: tuple[float, ...]
    accumulate: tuple[float, ...]
    profile: DeviceProfile

    @property
    def forward_s(self) -> float:
        """One forward pass."""
        return math.fsum(self.forward)

    @property
    def backward_s(self) -> float:
        """One plain backward pass: every gradient and every sum."""
        return math.fsum(self.gradient) + math.fsum(self.accumulate)

    def recompute_s(self, ops: Iterable[int]) -> float:
        """Seconds of running copies of ``ops`` (op indices, repeats counted).

        All of them: a recompute step runs only the copies its gradients
        read (:func:`step_time` picks those); a planner costing a segment
        before it has a schedule may pass the whole segment.
        """
        r = self.recompute
        return math.fsum(r[i] for i in ops)


def op_seconds(fg: ForwardGraph, costs: Costs, profile: DeviceProfile | None = None) -> OpSeconds:
    """Forecast seconds of every op's forward kernel and gradient.

    Parameters
    ----------
    fg : ForwardGraph
    costs : Costs
        ``memsave.costs.estimate_costs(fg)``.
    profile : DeviceProfile, optional
        :data:`CPU_DEFAULT` when not given; ``memsave.calibrate.device_profile()``
        measures the current device.

    Returns
    -------
    OpSeconds

    Notes
    -----
    One pass over the ops and their tensors: linear in the graph size
    (a call's or loop's body is computed once per body).

    Examples
    --------
    >>> s = op_seconds(fg, estimate_costs(fg))          # doctest: +SKIP
    >>> s.recompute_s(schedule.steps[0].ops) / (s.forward_s + s.backward_s)  # doctest: +SKIP
    """
    profile = CPU_DEFAULT if profile is None else profile
    with paused_gc():
        return _op_seconds(fg, costs, profile)


def _op_seconds(fg: ForwardGraph, costs: Costs, profile: DeviceProfile) -> OpSeconds:
    consumers = fg.consumers()
    ys = set(fg.ys)
    forward = []
    recompute = []
    gradient = []
    needs = [_takes_gradient(fg, t) for t in range(len(fg.tensors))]
    for op in fg.ops:
        if op.body is not None:
            inner = _body_seconds(op.body, profile)
            forward.append(op.body.trips * inner.forward_s)
            recompute.append(forward[-1])
            gradient.append(op.body.trips * inner.backward_s if any(needs[t] for t in op.inputs)
                            else 0.0)
            continue
        cls = op_class(op.type)
        kernel = _forward_kernel_s(fg, costs, op, cls, profile)
        recompute.append(kernel * STATISTICS_REUSED if op.reuses_statistics else kernel)
        forward.append(0.0 if fused_into_producer(fg, op, consumers=consumers) else kernel)
        gradient.append(_gradient_s(fg, costs, op, cls, profile, needs, consumers, ys))
    accumulate = []
    for t, readers in enumerate(consumers):
        n = sum(1 for o in readers if _sends_gradient(fg, costs, fg.ops[o], t, needs))
        accumulate.append(_elementwise_s(profile, (n + 1) * costs.tensor_bytes[t])
                          if n > 1 and needs[t] else 0.0)
    return OpSeconds(tuple(forward), tuple(recompute), tuple(gradient), tuple(accumulate), profile)


def _takes_gradient(fg: ForwardGraph, t: int) -> bool:
    node = fg.tensors[t]
    return node.kind != "external" and node.trainable


def _sends_gradient(fg, costs, op: OpNode, t: int, needs) -> bool:
    """Whether ``op``'s gradient sends one to its input ``t``."""
    use = costs.gradient[op.index]
    if not use.has_gradient or not needs[t]:
        return False
    gives = use.gives
    return any(x == t and (gives is None or j in gives) for j, x in enumerate(op.inputs))


def _input_bytes(fg: ForwardGraph, costs: Costs, ids: Iterable[int]) -> int:
    return sum(costs.tensor_bytes[t] for t in dict.fromkeys(ids)
               if fg.tensors[t].dtype not in _SKIPPED_DTYPES)


def _elements(fg: ForwardGraph, costs: Costs, t: int) -> int:
    itemsize = fg.tensors[t].itemsize
    return costs.tensor_bytes[t] // itemsize if itemsize else 0


def _gemm(fg, costs, op: OpNode, flops: int, profile: DeviceProfile) -> float:
    """``k / (k + gemm_half_k)`` with k the reduction length (1 when unknown)."""
    out = _elements(fg, costs, op.outputs[0]) if op.outputs else 0
    if not out or not flops or not profile.gemm_half_k:
        return 1.0
    k = flops / (2.0 * out)
    return k / (k + profile.gemm_half_k)


def _roofline(flops: float, bytes_: float, eff: Efficiency, gemm: float,
              profile: DeviceProfile) -> float:
    return max(flops / (profile.peak_flops_per_s * eff.compute * gemm),
               bytes_ / (profile.bytes_per_s * eff.memory))


def _elementwise_s(profile: DeviceProfile, bytes_: float) -> float:
    """One elementwise kernel moving ``bytes_`` (a sum of gradients, a gate)."""
    eff = profile.of("elementwise")
    return profile.overhead_s + eff.fixed_s + bytes_ / (profile.bytes_per_s * eff.memory)


def _forward_kernel_s(fg, costs, op: OpNode, cls: str, profile: DeviceProfile) -> float:
    """The forward kernel's seconds, launch included (0 for views)."""
    if cls == "view":
        return 0.0
    if cls == "metadata":
        return profile.overhead_s
    flops = costs.op_flops[op.index]
    out_bytes = _input_bytes(fg, costs, op.outputs)
    in_bytes = _input_bytes(fg, costs, op.inputs)
    if cls == "movement":
        in_bytes = min(in_bytes, out_bytes)
    gemm = _gemm(fg, costs, op, flops, profile) if cls in ("matmul", "conv") else 1.0
    eff = profile.of(cls)
    return profile.overhead_s + eff.fixed_s + _roofline(flops, in_bytes + out_bytes, eff, gemm, profile)


def _gradient_s(fg, costs, op: OpNode, cls: str, profile: DeviceProfile, needs,
                consumers, ys) -> float:
    """The gradient kernels' seconds (see module docstring), 0 when none runs."""
    use = costs.gradient[op.index]
    if cls == "view" or not use.has_gradient:
        return 0.0
    gives = use.gives
    computed = [j for j, t in enumerate(op.inputs)
                if needs[t] and (gives is None or j in gives)
                and not (j < len(use.aliases) and use.aliases[j] is not None)]
    if not computed:
        return 0.0
    incoming_bytes = _input_bytes(fg, costs, (
        t for t in op.outputs if fg.tensors[t].trainable and (consumers[t] or t in ys)))
    read_bytes = _input_bytes(fg, costs, [op.inputs[j] for j in use.reads_inputs]
                          + [op.outputs[j] for j in use.reads_outputs])
    written_bytes = _input_bytes(fg, costs, (op.inputs[j] for j in computed))
    flops = costs.op_flops[op.index]
    gemm = 1.0
    kernels = 1
    if cls in PER_OPERAND_CLASSES:
        gemm = _gemm(fg, costs, op, flops, profile)
        kernels = max(1, sum(1 for j in computed if j < 2))
        flops *= kernels
    eff = profile.of(cls)
    roof = _roofline(flops, incoming_bytes + read_bytes + written_bytes,
                     profile.of(GRADIENT_CLASSES.get(cls, cls)), gemm, profile)
    return kernels * (profile.overhead_s + eff.fixed_s) + eff.gradient * roof


_body_seconds_cache: "weakref.WeakKeyDictionary[Body, dict]" = weakref.WeakKeyDictionary()


def _body_seconds(body: Body, profile: DeviceProfile) -> OpSeconds:
    """:func:`op_seconds` of a call's or loop's body (cached per body and profile)."""
    per_profile = _body_seconds_cache.setdefault(body, {})
    found = per_profile.get(profile)
    if found is None:
        found = per_profile[profile] = op_seconds(body.fg, body_costs(body), profile)
    return found


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Forecast seconds of one training step (forward and gradients).

    Attributes
    ----------
    forward_s, backward_s : float
        Plain backprop's forward pass, and its backward pass (gradients and
        the sums of gradients of tensors read more than once).
    recompute_s : float
        The recomputed ops' forward seconds (0 for plain backprop).
    rewrite_s : float
        What the rewrite adds per recomputed step: its gate, and a gated
        read of each gated boundary tensor and each head's incoming
        gradient (:func:`head_gate_seconds`, :mod:`memsave.rewrite`).
    recomputed_ops : int
        Op copies that run (of those the schedule makes).
    loop_recompute_s : float
        The loop trips memsave's loop gradients run again
        (:func:`memsave.loopmodel.recomputed_trips` times one trip's forward
        seconds; 0 when every loop keeps while_v2's gradient).
    """

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    rewrite_s: float = 0.0
    recomputed_ops: int = 0
    loop_recompute_s: float = 0.0

    @property
    def plain_s(self) -> float:
        """The same step with plain backprop."""
        return self.forward_s + self.backward_s

    @property
    def total_s(self) -> float:
        """The step: plain + recomputation (loops' included) + the rewrite's gates."""
        return self.plain_s + self.recompute_s + self.loop_recompute_s + self.rewrite_s

    @property
    def ratio(self) -> float:
        """``total_s / plain_s``: the forecast step time as a ratio to plain's."""
        return self.total_s / self.plain_s if self.plain_s > 0 else 1.0


def step_time(fg: ForwardGraph, costs: Costs, schedule: Schedule | None = None, *,
              profile: DeviceProfile | None = None, seconds: OpSeconds | None = None) -> StepTime:
    """Forecast seconds of one step, plain (``schedule=None``) or checkpointed.

    The checkpointed step is the plain step plus, for every ``recompute``
    step of ``schedule``, the seconds of the copies that run (those whose
    values its gradients read, directly or through other copies: TensorFlow
    prunes the rest, e.g. the copy of a kept convolution whose gradient
    reads only its inputs; ``memsave.simulate``'s rule) and the rewrite's
    gates (:attr:`StepTime.rewrite_s`). The ops' gradients are the same in
    both, computed on copies or on the originals.

    Parameters
    ----------
    fg, costs
        The graph and its ``memsave.costs.estimate_costs``.
    schedule : Schedule, optional
        ``memsave.schedule.build_schedule`` of the plan.
    profile : DeviceProfile, optional
        :data:`CPU_DEFAULT` when not given.
    seconds : OpSeconds, optional
        ``op_seconds(fg, costs, profile)`` if already computed (planners
        evaluating many schedules pass it once).
    """
    if seconds is None:
        seconds = op_seconds(fg, costs, profile)
    base = StepTime(forward_s=seconds.forward_s, backward_s=seconds.backward_s)
    if schedule is None:
        return base
    recompute = 0.0
    rewrite = 0.0
    copies = 0
    needed_copies = copies_that_run(fg, costs)
    for step in schedule.steps:
        cost = step_seconds(fg, costs, step, seconds, needed_copies=needed_copies)
        recompute += cost.recompute_s
        rewrite += cost.rewrite_s
        copies += cost.copies
    return dataclasses.replace(base, recompute_s=recompute, rewrite_s=rewrite,
                               recomputed_ops=copies)


@dataclasses.dataclass(frozen=True)
class StepSeconds:
    """What one backward step adds to plain backprop (:func:`step_seconds`).

    Attributes
    ----------
    recompute_s : float
        The copies that run.
    rewrite_s : float
        The step's gate and gated reads.
    copies : int
        How many copies run.
    """

    recompute_s: float = 0.0
    rewrite_s: float = 0.0
    copies: int = 0

    @property
    def total_s(self) -> float:
        return self.recompute_s + self.rewrite_s


_NO_SECONDS = StepSeconds()


def step_seconds(fg: ForwardGraph, costs: Costs, step, seconds: OpSeconds, *,
                 needed_copies=None) -> StepSeconds:
    """Seconds one step of a schedule adds to plain backprop: for a
    ``recompute`` step, the copies that run and the rewrite's gates (see
    :func:`step_time`, the sum of these over the steps); 0 for a
    ``backprop`` step (its gradients are plain backprop's).
    ``needed_copies``: :func:`memsave.simulate.copies_that_run` of the graph,
    if already built (callers timing many steps pass it once)."""
    if step.kind != "recompute":
        return _NO_SECONDS
    if needed_copies is None:
        needed_copies = copies_that_run(fg, costs)
    run = needed_copies(step.ops)
    recompute = seconds.recompute_s(run)
    rewrite = 0.0
    heads = [h for h in step.heads if _floating(fg.tensors[h])]
    if heads:
        profile = seconds.profile
        rewrite = step_gate_seconds(profile)
        for t in list(step.gated) + heads:
            rewrite += head_gate_seconds(fg, costs, t, profile)
    return StepSeconds(recompute, rewrite, len(run))


def step_gate_seconds(profile: DeviceProfile) -> float:
    """The fixed part of a recompute step's cost (:data:`GATE_OPS` kernel
    launches and :attr:`DeviceProfile.step_s`), paid once per step with a
    floating head: a part of :func:`step_seconds`' ``rewrite_s``, for
    planners bounding it without a schedule."""
    return GATE_OPS * profile.overhead_s + profile.step_s


def head_gate_seconds(fg: ForwardGraph, costs: Costs, t: int, profile: DeviceProfile) -> float:
    """Seconds the rewrite's gated read of ``t`` costs, a head or a gated
    boundary tensor of a recompute step (0 for a tensor that is not
    floating): a part of :func:`step_seconds`' ``rewrite_s``, for planners
    bounding it without a schedule. Outside XLA one kernel launch (a CPU's
    ``Select`` passes ``t``'s buffer on, :func:`memsave.gates.select`; the
    profiles are CPUs'); under XLA a pass that reads ``t`` and writes
    ``t + gate``."""
    if not _floating(fg.tensors[t]):
        return 0.0
    if not fg.xla:
        return profile.overhead_s
    return _elementwise_s(profile, 2 * costs.tensor_bytes[t])


def _floating(node) -> bool:
    """Floating (hand-built graphs record no dtype: trainable counts as floating)."""
    if node.dtype:
        return node.dtype.startswith(("float", "bfloat", "half", "complex"))
    return node.trainable


#: The profile :func:`op_seconds` uses when given none: the median of
#: :func:`memsave.calibrate.calibrate` runs on the reference machine (2
#: cores of an AMD EPYC, Zen 5 with AVX-512, 32 MiB L3; TensorFlow 2.21 with
#: oneDNN; default threads), rounded. Measure your device with
#: ``memsave.calibrate.device_profile()``. Not calibrated: transcendental
#: ``memory`` (their kernels are compute-bound), and ``gemm_half_k``,
#: fitted by hand to the convolutions measured in the study's models (3
#: input channels, k = 27: about 100 GFLOP/s; 16 channels, k = 144: 140-230;
#: 64 channels, k = 576: about 240): a fit of two benchmark convolutions
#: per calibration ranged from 0 to 370 on this shared machine. ``step_s``
#: is set by hand from steps measured beyond their forecast without it, over
#: the number of recompute steps (the study's models, batch 32, budget plans
#: timed interleaved, /plain tf.gradients): ResNet-110, 46-60 steps, about
#: 0.25 ms a step (budget 0.75: 60 steps forecast 1.065, measured 1.121,
#: while 3 steps forecast 1.067 measured 1.074); U-Net-64, 53-66 steps,
#: 0.02-0.1 ms. With 0.15 ms the budgets of both choose the plans that
#: measured faster or as fast (ResNet-110 0.5: 9 steps 1.162 instead of 46
#: at 1.181; U-Net-64 0.75: 22 steps 1.060 instead of 53 at 1.079; its 0.5
#: keeps 66 steps, 1.095).
CPU_DEFAULT = DeviceProfile(
    name="CPU default (2-core AMD EPYC, TF 2.21 oneDNN)",
    peak_flops_per_s=250e9,
    bytes_per_s=50e9,
    overhead_s=0.7e-6,
    gemm_half_k=48.0,
    step_s=0.15e-3,
    efficiency={
        "matmul": Efficiency(gradient=1.15),
        "conv": Efficiency(compute=0.93, gradient=1.06),
        "elementwise": Efficiency(gradient=0.73),
        "transcendental": Efficiency(compute=0.013, memory=0.6, gradient=0.85),
        "normalization": Efficiency(memory=0.5, gradient=0.75, fixed_s=80e-6),
        "reduction": Efficiency(memory=0.3, gradient=0.6),
        "movement": Efficiency(memory=0.22, gradient=0.86, fixed_s=26e-6),
        "softmax": Efficiency(memory=0.3, gradient=0.76, fixed_s=33e-6),
        "pooling": Efficiency(memory=0.4, gradient=0.27, fixed_s=50e-6),
    },
)
