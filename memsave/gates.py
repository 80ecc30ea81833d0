"""Gates: values that order the rewrite's ops by data, and the reads through them.

:func:`ready` makes a boolean that cannot be computed before some gradients
are (what a recompute step waits for); :func:`select` reads a tensor
through it (``Select(ready, t, t)``), which costs nothing on a CPU. Under
XLA, :func:`gate` makes a float32 zero from it and :func:`proxy` reads a
tensor through that (``t + gate``) or through an Identity. Data
dependencies, which neither Grappler nor XLA removes (XLA ignores control
dependencies); :mod:`memsave.rewrite` says where each is used and why.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import tensorflow as tf

from memsave import _tf_private

__all__ = ["gate", "gateable", "proxy", "ready", "select"]


def gateable(dtype: tf.DType) -> bool:
    """The TensorFlow side of :func:`memsave.schedule.is_floating`: whether a
    gradient of this dtype can make the gate."""
    return dtype.is_floating or dtype.is_complex


def ready(grads: Sequence) -> tf.Tensor | None:
    """A boolean scalar that cannot be computed before ``grads`` are (None
    when none of them is floating).

    ``b == b`` with ``b`` the sum of each gradient's first element in
    float32, each replaced by 0 where it is not finite (a NaN in a gradient,
    or infinities of both signs summed, must not spread to every tensor the
    gate touches): always true, but no compiler can prove it without the
    gradients' values. Built from raw ops (``_tf_private.raw_op``).
    """
    op = _tf_private.raw_op
    bits = []
    for g in grads:
        v = g.values if isinstance(g, tf.IndexedSlices) else g
        if not gateable(v.dtype):
            continue
        dt = v.dtype
        with v.graph.colocate_with(v.op, ignore_existing=True):
            c = _constants(v.graph, v.op.device)
            flat = op("Reshape", [v, c(tf.int32, [-1])], [dt], {"T": dt, "Tshape": tf.int32},
                      "flat").outputs[0]
            # flat[0:1]: empty for an empty gradient (a batch of 0, a mask
            # that selects nothing), whose sum below is 0.
            first = op("StridedSlice", [flat, c(tf.int32, [0]), c(tf.int32, [1]),
                                        c(tf.int32, [1])], [dt],
                       {"T": dt, "Index": tf.int32, "begin_mask": 0, "end_mask": 0,
                        "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0},
                       "first").outputs[0]
            if dt.is_complex:
                dt = dt.real_dtype
                first = op("Real", [first], [dt], {"T": v.dtype, "Tout": dt}, "real").outputs[0]
            b = op("Sum", [first, c(tf.int32, 0)], [dt], {"T": dt, "Tidx": tf.int32,
                                                          "keep_dims": False}, "b").outputs[0]
            if dt != tf.float32:
                b = op("Cast", [b], [tf.float32], {"SrcT": dt, "DstT": tf.float32,
                                                    "Truncate": False}, "cast").outputs[0]
            # Finite, or 0: a NaN or an infinity (or a float64 beyond float32's
            # range) must not make the sum below NaN (inf + -inf).
            finite = op("IsFinite", [b], [tf.bool], {"T": tf.float32}, "is_finite").outputs[0]
            b = op("SelectV2", [finite, b, c(tf.float32, 0)], [tf.float32], {"T": tf.float32},
                   "finite").outputs[0]
            bits.append(b)
    if not bits:
        return None
    with bits[0].graph.colocate_with(bits[0].op, ignore_existing=True):
        b = bits[0] if len(bits) == 1 else op(
            "AddN", bits, [tf.float32], {"N": len(bits), "T": tf.float32}, "bits").outputs[0]
        return op("Equal", [b, b], [tf.bool], {"T": tf.float32,
                                               "incompatible_shape_error": True}, "same").outputs[0]


def gate(grads: Sequence, *, once: bool = False) -> tf.Tensor | None:
    """A float32 zero that cannot be computed before ``grads`` are, for XLA.

    ``where(ready(grads), -0.0, nan)`` (:func:`ready`): always -0.0
    (``_tf_private.GATE_ZERO`` says why negative), but no compiler can
    prove it without the gradients' values.

    ``once`` (a recompute step's gate under XLA): the zero goes through
    ``sqrt`` (``sqrt(0) = 0``, ``sqrt(nan) = nan``), an op XLA counts as
    expensive and so computes once. Otherwise XLA duplicates the whole
    elementwise chain into every reader of the gate (each gated proxy of the
    step), and each of those fusions reads the heads' gradients, and what
    they are fused from, until it runs. Measured on keras.applications
    MobileNetV2 (64x64, batch 32, 'memory', SGD in the step): a 12 MiB
    gradient of the first block and the forward tensor it is computed from
    were held through the recomputation of the segment before it, with
    every earlier step's gate chained into the same fusions; with ``sqrt``,
    the step's peak was 69.8 MB instead of 79.7 MB. (XLA's optimization
    barrier does not do it: XLA:CPU removes it before fusion.) The weights'
    ordered gates are computed once only in float16 steps
    (:func:`memsave.rewrite._ordered_after_step` says why).
    """
    same = ready(grads)
    if same is None:
        return None
    op = _tf_private.raw_op
    with same.graph.colocate_with(same.op, ignore_existing=True):
        c = _constants(same.graph, same.op.device)
        gate = op("SelectV2", [same, c(tf.float32, _tf_private.GATE_ZERO),
                               c(tf.float32, float("nan"))],
                  [tf.float32], {"T": tf.float32}, "gate").outputs[0]
        if once:  # sqrt(-0.0) is -0.0
            gate = op("Sqrt", [gate], [tf.float32], {"T": tf.float32}, "gate_once").outputs[0]
        return gate


def _constants(graph: tf.Graph, device: str):
    """``c(dtype, value)``: a Const of ``graph`` on ``device``, made once per
    graph, device and value (the gates of every step share them)."""
    per_graph = _CONSTANTS.setdefault(graph, {})

    def c(dtype: tf.DType, value) -> tf.Tensor:
        key = (dtype, repr(value), device)
        found = per_graph.get(key)
        if found is None:
            with graph.colocate_with(None, ignore_existing=True), graph.device(device), \
                    graph.control_dependencies(None):
                found = per_graph[key] = tf.constant(value, dtype=dtype, name="gate_constant")
        return found

    return c


#: Per graph, the constants the gates share (see _constants).
_CONSTANTS: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()


def select(t: tf.Tensor, ready: tf.Tensor) -> tf.Tensor:
    """``t`` read through :func:`ready`'s boolean: ``Select(ready, t, t)``.

    ``t`` whatever the boolean, but computed only once it is. With a scalar
    condition the CPU kernel passes ``t``'s buffer on: no pass over ``t`` and
    no new buffer (TensorFlow's ``SelectScalarHandler<CPUDevice>``). On a GPU
    it copies ``t``; :mod:`memsave.simulate` counts that copy on every
    device.
    Measured on the study's U-Net-64 (batch 32, ``memory_budget=0.5``, 66
    recompute steps, kernels one at a time): the 131 gated reads took 0.33 ms
    of kernel time as selects and 10.1 ms as ``t + gate``, 6% of the plain
    step. Not under XLA, whose simplifier may fold a select of two equal
    operands to the operand: there the read is ``t + gate`` (:func:`proxy`).
    """
    with t.graph.colocate_with(t.op, ignore_existing=True):
        return _tf_private.raw_op("Select", [ready, t, t], [t.dtype], {"T": t.dtype},
                                  "gated").outputs[0]


def proxy(t: tf.Tensor, gate: tf.Tensor | None, gates: dict | None = None) -> tf.Tensor:
    """``t`` read through the gate (``t + gate``, XLA's gated read), or
    through an identity without one.

    ``gates`` caches the gate cast to each dtype, for one step. A complex
    gate is ``complex(gate, gate)``: -0.0 in both parts, so that ``t + gate``
    is ``t`` in both (a cast would make the imaginary part +0.0).
    """
    with t.graph.colocate_with(t.op, ignore_existing=True):
        if gate is None:
            return _tf_private.identity(t, name="proxy")
        dt = t.dtype
        cast = gate if dt == tf.float32 else None
        if cast is None and gates is not None:
            cast = gates.get(dt)
        if cast is None:
            part = dt.real_dtype if dt.is_complex else dt
            cast = gate if part == tf.float32 else _tf_private.raw_op(
                "Cast", [gate], [part], {"SrcT": tf.float32, "DstT": part, "Truncate": False},
                "gate").outputs[0]
            if dt.is_complex:
                cast = _tf_private.raw_op("Complex", [cast, cast], [dt], {"T": part, "Tout": dt},
                                          "gate").outputs[0]
            if gates is not None:
                gates[dt] = cast
        return _tf_private.raw_op("AddV2", [t, cast], [dt], {"T": dt}, "gated").outputs[0]
