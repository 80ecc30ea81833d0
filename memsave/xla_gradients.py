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
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["depthwise_conv2d_gradient", "xla_gradient_for"]


def depthwise_conv2d_gradient(op: tf.Operation, grad: tf.Tensor) -> list:
    """Gradient of ``DepthwiseConv2dNative`` without XLA's dense channel-by-channel filter gradient."""
    x, w = op.inputs[0], op.inputs[1]
    strides = list(op.get_attr("strides"))
    dilations = list(op.get_attr("dilations"))
    padding = op.get_attr("padding")
    padding = padding.decode() if isinstance(padding, bytes) else padding
    explicit = list(op.get_attr("explicit_paddings"))
    data_format = op.get_attr("data_format")
    data_format = data_format.decode() if isinstance(data_format, bytes) else data_format
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
    return None
