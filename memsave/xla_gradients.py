"""Gradients memsave gives the ops it recomputes when the step is compiled by XLA.

The rewrite differentiates its copies of a segment's ops with the stock
gradient code, except where XLA lowers the stock gradient into something
that costs more memory than the checkpointing saves. Each function here has
the signature of a registered gradient (``(op, grad) -> input gradients``)
and is set on a copy as ``op._gradient_function`` (see
:func:`memsave._tf_private.set_gradient_function`, and
:func:`xla_gradient_for` for which ops); the registry and the user's own
ops are not touched.

Depthwise convolutions
----------------------
XLA:CPU lowers ``DepthwiseConv2dNativeBackpropFilter`` (a convolution with
``batch_group_count`` = channels) by expanding the batch groups into one
dense convolution over all channel pairs and selecting its diagonal: for a
3x3 depthwise convolution over C channels, two float32 buffers of
``3 * 3 * C * C`` elements, 31.6 MiB each at C = 960 (MobileNetV2's last
blocks), however small the batch. :func:`depthwise_conv2d_gradient` computes
the filter gradient as a sum, over the kernel's offsets, of the input
window at that offset times the incoming gradient, reduced over batch and
positions: ``kh * kw`` reductions XLA fuses with their slices and products,
no buffer larger than the input. The input gradient is the stock one.
Dilated depthwise convolutions (which Keras builds with space-to-batch
around an undilated one) keep the stock gradient.

Max-pools
---------
XLA lowers ``MaxPoolGrad`` to a select-and-scatter, which XLA:CPU expands
into a search for each window's maximum (a reduce-window over the input and
four ``s32`` iotas of the padded input's shape) and a scatter of the
incoming gradient into a zero buffer of the padded input's shape. Nothing
in the search or the zero buffer depends on the incoming gradient, so XLA's
breadth-first schedule makes them early: for the original op, in the
forward pass, holding the indices found (16 bytes per output element) and
the zero buffer to the end of the step (ResNet50 at 64x64, batch 32: 8.4 and
9.5 MB); for a recomputed copy, the iotas from the start of the step (4 x 9
MiB). :func:`max_pool_gradient` computes the same gradient without them:
for each offset of the window, in the order the select-and-scatter scans
it, the positions holding the window's maximum that no earlier offset
holds (the first maximum takes the gradient, as in the stock kernels)
receive the incoming gradient; summed back onto the input per residue of
the stride and interleaved. Elementwise ops, slices, pads and one
interleave, which XLA fuses into the one buffer of the input gradient,
read only once the incoming gradient exists. (Spreading each offset's
share over the input by padding, then summing, left XLA:CPU a buffer of
the input's size per offset: 9 for a 3x3 window.) On a CNN with a ResNet
stem (64x64, batch 8, tests/test_xla.py) ``'memory'``'s XLA step held 13.9
MiB above the resident bytes, against 31.9 MiB with the max-pool
differentiated in place and 36.0 MiB for tf.gradients.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["depthwise_conv2d_gradient", "max_pool_gradient", "xla_gradient_for"]


def depthwise_conv2d_gradient(op: tf.Operation, grad: tf.Tensor) -> list:
    """Gradient of ``DepthwiseConv2dNative`` without XLA's dense channel-by-channel filter gradient."""
    x, w = op.inputs[0], op.inputs[1]
    strides = list(op.get_attr("strides"))
    dilations = list(op.get_attr("dilations"))
    padding = _text(op.get_attr("padding"))
    explicit = list(op.get_attr("explicit_paddings"))
    data_format = _text(op.get_attr("data_format"))
    dx = tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
        input_sizes=tf.shape(x), filter=w, out_backprop=grad, strides=strides, padding=padding,
        explicit_paddings=explicit, data_format=data_format, dilations=dilations)
    nchw = data_format == "NCHW"
    if nchw:  # work in NHWC
        x = tf.transpose(x, [0, 2, 3, 1])
        grad = tf.transpose(grad, [0, 2, 3, 1])
        strides = [strides[0], strides[2], strides[3], strides[1]]
        dilations = [dilations[0], dilations[2], dilations[3], dilations[1]]
        if explicit:
            explicit = explicit[0:2] + explicit[4:8] + explicit[2:4]
    kh, kw, channels, multiplier = w.shape.as_list()
    sh, sw = strides[1], strides[2]
    dh, dw = dilations[1], dilations[2]
    # Python ints where the shapes are known (always, under jit_compile), so
    # that the offsets below are constants rather than scalar ops per tap.
    x_shape = _shape(x)
    g_shape = _shape(grad)
    out_h, out_w = g_shape[1], g_shape[2]
    if padding == "VALID":
        top = left = 0
    elif padding == "EXPLICIT":
        top, left = explicit[2], explicit[4]
    else:  # SAME
        pad_h = _max0((out_h - 1) * sh + (kh - 1) * dh + 1 - x_shape[1])
        pad_w = _max0((out_w - 1) * sw + (kw - 1) * dw + 1 - x_shape[2])
        top, left = pad_h // 2, pad_w // 2
    # Pad enough on every side for every offset's window to stay inside.
    bottom = (out_h - 1) * sh + (kh - 1) * dh + 1 - x_shape[1] - top
    right = (out_w - 1) * sw + (kw - 1) * dw + 1 - x_shape[2] - left
    x_pad = tf.pad(x, [[0, 0], [top, _max0(bottom)], [left, _max0(right)], [0, 0]])
    grad = tf.reshape(grad, [*g_shape[:3], channels, multiplier])
    if x.dtype in (tf.float16, tf.bfloat16):  # accumulate in float32, as the kernels do
        x_pad, grad = tf.cast(x_pad, tf.float32), tf.cast(grad, tf.float32)
    rows = []
    for i in range(kh):
        cols = []
        for j in range(kw):
            window = x_pad[:, i * dh:i * dh + (out_h - 1) * sh + 1:sh,
                           j * dw:j * dw + (out_w - 1) * sw + 1:sw, :]
            cols.append(tf.reduce_sum(window[..., None] * grad, axis=[0, 1, 2]))
        rows.append(tf.stack(cols))
    return [dx, tf.cast(tf.stack(rows), w.dtype)]


def max_pool_gradient(op: tf.Operation, grad: tf.Tensor) -> list:
    """Gradient of ``MaxPool`` without XLA's select-and-scatter (see the module docstring).

    Equal to TensorFlow's ``MaxPoolGrad`` kernels: each window's incoming
    gradient goes to the first position, in row-major order over the window,
    holding the window's maximum; positions in several windows sum what
    they receive. (XLA's own lowering may give a window's gradient to
    another of several equal maxima: a subgradient too.) Static shapes,
    ``VALID`` or ``SAME`` padding (:func:`xla_gradient_for`).
    """
    x, y = op.inputs[0], op.outputs[0]
    padding = _text(op.get_attr("padding"))
    ksize, strides = list(op.get_attr("ksize")), list(op.get_attr("strides"))
    nchw = _text(op.get_attr("data_format")) == "NCHW"
    if nchw:  # work in NHWC
        x, y, grad = (tf.transpose(t, [0, 2, 3, 1]) for t in (x, y, grad))
        ksize = [ksize[0], ksize[2], ksize[3], ksize[1]]
        strides = [strides[0], strides[2], strides[3], strides[1]]
    _, kh, kw, _ = ksize
    _, sh, sw, _ = strides
    n, in_h, in_w, c = x.shape.as_list()
    out_h, out_w = grad.shape.as_list()[1:3]
    if padding == "VALID":
        top = left = 0
    else:  # SAME (XLA compiles no max-pool with explicit padding)
        top = _max0((out_h - 1) * sh + kh - in_h) // 2
        left = _max0((out_w - 1) * sw + kw - in_w) // 2
    # The padded input every window lies in: (out - 1) * stride + k rows.
    span_h, span_w = (out_h - 1) * sh + kh, (out_w - 1) * sw + kw
    bottom, right = span_h - in_h - top, span_w - in_w - left
    x_pad = tf.pad(x, [[0, 0], [top, _max0(bottom)], [left, _max0(right)], [0, 0]],
                   constant_values=tf.constant(-np.inf, x.dtype))
    # Each window offset's share of the incoming gradient, on the output grid:
    # where it holds the window's maximum and no earlier offset does.
    zero = tf.zeros([], grad.dtype)
    shares, taken = {}, None
    for i in range(kh):
        for j in range(kw):
            at = x_pad[:, i:i + (out_h - 1) * sh + 1:sh, j:j + (out_w - 1) * sw + 1:sw, :]
            hit = tf.equal(at, y)
            first = hit if taken is None else tf.logical_and(hit, tf.logical_not(taken))
            taken = hit if taken is None else tf.logical_or(taken, hit)
            shares[i, j] = tf.where(first, grad, zero)
    # Row a * sh + r of the padded input is row r + dp * sh of window a - dp
    # (columns alike): per residue (r, t), the shares of those offsets
    # shifted by (dp, dq), summed; then the residues interleaved. Pads and
    # sums on the output grid and one interleave, which XLA fuses into one
    # loop writing the input gradient (each offset's share spread over the
    # input and then summed left a buffer per offset).
    taps_h, taps_w = -(-kh // sh), -(-kw // sw)
    rows, cols = out_h - 1 + taps_h, out_w - 1 + taps_w
    by_row = []
    for r in range(sh):
        by_col = []
        for t in range(sw):
            total = None
            # Earlier windows first, as the stock kernels add them up.
            for dp in reversed(range(taps_h)):
                for dq in reversed(range(taps_w)):
                    i, j = r + dp * sh, t + dq * sw
                    if i >= kh or j >= kw:
                        continue
                    part = tf.pad(shares[i, j], [[0, 0], [dp, rows - out_h - dp],
                                                 [dq, cols - out_w - dq], [0, 0]])
                    total = part if total is None else total + part
            by_col.append(tf.zeros([n, rows, cols, c], grad.dtype) if total is None else total)
        by_row.append(tf.stack(by_col, axis=3))  # [n, rows, cols, sw, c]
    dx_pad = tf.reshape(tf.stack(by_row, axis=2), [n, rows * sh, cols * sw, c])
    # Back to the input's rows and columns (rows no window reaches get zero).
    dx_pad = tf.pad(dx_pad, [[0, 0], [0, _max0(top + in_h - rows * sh)],
                             [0, _max0(left + in_w - cols * sw)], [0, 0]])
    dx = dx_pad[:, top:top + in_h, left:left + in_w, :]
    if nchw:
        dx = tf.transpose(dx, [0, 3, 1, 2])
    return [dx]


def _max_pool_supported(op: tf.Operation) -> bool:
    x = op.inputs[0]
    return (x.dtype.is_floating and x.shape.is_fully_defined()
            and op.outputs[0].shape.is_fully_defined()
            and _text(op.get_attr("padding")) in ("VALID", "SAME")
            and _text(op.get_attr("data_format")) in ("NHWC", "NCHW"))


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _shape(t: tf.Tensor) -> list:
    """The shape of the 4-d ``t``: each known dimension an int, the others scalar tensors."""
    dims = t.shape.with_rank(4).as_list()
    if None in dims:
        dynamic = tf.shape(t)
        dims = [dynamic[i] if d is None else d for i, d in enumerate(dims)]
    return dims


def _max0(v):
    """``max(v, 0)`` of an int or a scalar tensor."""
    return max(v, 0) if isinstance(v, int) else tf.maximum(v, 0)


def xla_gradient_for(op: tf.Operation):
    """The gradient function a copy of ``op`` gets under XLA, or None for the stock one."""
    if op.type == "DepthwiseConv2dNative" and all(d == 1 for d in op.get_attr("dilations")):
        return depthwise_conv2d_gradient
    if op.type == "MaxPool" and _max_pool_supported(op):
        return max_pool_gradient
    return None
