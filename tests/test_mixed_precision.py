"""The forecast of a float16 convolution step on a CPU: TensorFlow's im2col buffers.

On a CPU where oneDNN does not take float16 (no AVX512-FP16), the gradients
of a float16 ``Conv2D`` run TensorFlow's own kernels, each of which holds an
im2col buffer sized to a 30 MiB working set whatever the batch
(:func:`memsave.memory_model.half_conv2d_gradient_scratch`); the two kernels
of one convolution run side by side. A small float16 conv net (1 MiB
activations, two 15 MiB buffers per gradient) runs in a fresh process
(tests/fresh.py), measured as tests/test_forecast_chain.py measures its
models (``measure_step``: tf.gradients and 'memory', median of REPEATS
steps, against ``memsave.plan``'s forecast). Without the buffers in the
model the forecasts were 68% (tf.gradients) and 79% ('memory') under the
measured peaks. On a CPU where oneDNN takes float16 (AVX512-FP16) the
same measured test checks the other side: no buffer is held there, and
counting them forecast tf.gradients' step at 3.3x its measured peak.

A float16 ``MatMul`` on such a CPU computes in float32 copies of its
operands and result (:func:`memsave.memory_model.half_matmul_scratch`),
which the simulator holds while the kernel runs.
"""

from __future__ import annotations

import numpy as np
import pytest

LAYERS = 6
REPEATS = 5
MiB = 1 << 20

#: Issue 8's bound on |predicted - measured| / measured (as tests/test_forecast_chain.py).
MAX_ERROR = 0.20


def _model():
    import tensorflow as tf

    rs = np.random.RandomState(0)
    ws = [tf.Variable(rs.randn(1, 1, 64, 64).astype(np.float32) / 8) for _ in range(LAYERS)]
    x = tf.constant(rs.randn(8, 32, 32, 64).astype(np.float16))

    def loss_fn():
        h = x
        for w in ws:  # float32 weights cast to float16, as Keras' mixed_float16 does
            h = tf.nn.relu(tf.nn.conv2d(h, tf.cast(w, tf.float16), 1, "SAME"))
        return tf.reduce_mean(tf.cast(h, tf.float32) ** 2)

    return ws, loss_fn


def measure() -> dict:
    from test_forecast_chain import measure_step

    ws, loss_fn = _model()
    return measure_step(ws, loss_fn, repeats=REPEATS)


def test_scratch_matches_tensorflows_kernel_arithmetic():
    from memsave.memory_model import CONV_GRADIENT_L3_BYTES, half_conv2d_gradient_scratch

    # block_2_project of MobileNetV2 64x64 batch 32: 1x1, 144 -> 24 channels
    # on 16x16; allocator records showed two buffers of 24,993,792 bytes.
    assert half_conv2d_gradient_scratch(
        (32, 16, 16, 144), (1, 1, 144, 24), (32, 16, 16, 24),
        input_gradient=True, filter_gradient=True, threads=2) == (24_993_792, 24_993_792)
    # One kernel per gradient that runs; the input's shards images only when
    # a thread's share of one image's work is under 256 KiB.
    assert len(half_conv2d_gradient_scratch(
        (32, 16, 16, 144), (1, 1, 144, 24), (32, 16, 16, 24),
        input_gradient=False, filter_gradient=True, threads=2)) == 1
    big = half_conv2d_gradient_scratch(
        (2, 224, 224, 64), (3, 3, 64, 64), (2, 224, 224, 64),
        input_gradient=True, filter_gradient=True, threads=2)
    assert big[0] == 224 * 224 * 9 * 64 * 2  # one image's im2col
    assert big[1] >= CONV_GRADIENT_L3_BYTES // 2


def test_simulator_holds_both_buffers_while_the_gradient_runs():
    import dataclasses

    from handgraphs import Builder
    from memsave.memory_model import (BFC, MemoryModel, cpu_threads, half_conv2d_gradient_scratch,
                                      onednn_takes_float16)
    from memsave.problem import Problem

    # x (float16, [8, 32, 32, 64]) -> conv(w) -> y: the input and the kernel get gradients.
    b = Builder()
    x = b.source("x", size_bytes=8 * 32 * 32 * 64 * 2)
    w = b.source("w", size_bytes=64 * 64 * 2)
    y = b.op("conv", "Conv2D", [x, w], size_bytes=8 * 32 * 32 * 64 * 2)
    loss = b.op("loss", "Sum", [y], size_bytes=4)
    fg = b.build([x, w], [loss])
    shapes = {"x": (8, 32, 32, 64), "w": (1, 1, 64, 64), "conv:0": (8, 32, 32, 64)}
    fg = dataclasses.replace(fg, tensors=tuple(
        dataclasses.replace(t, dtype="float16", itemsize=2, shape=shapes.get(t.name))
        for t in fg.tensors))
    with_buffers = Problem(fg, model=MemoryModel(float16_without_onednn=True)).peak(None)
    without = Problem(fg, model=MemoryModel(float16_without_onednn=False)).peak(None)
    expected = half_conv2d_gradient_scratch(
        shapes["x"], shapes["w"], shapes["conv:0"], input_gradient=True, filter_gradient=True,
        threads=cpu_threads())
    assert len(expected) == 2 and min(expected) > 10 * MiB
    assert with_buffers - without == sum(expected)
    # The default: on with the CPU allocator of a CPU oneDNN runs no float16
    # on, off with the BFC allocator of a GPU.
    assert MemoryModel().runs_float16_without_onednn == (not onednn_takes_float16())
    assert not MemoryModel(allocator=BFC).runs_float16_without_onednn


@pytest.mark.parametrize("flags,takes", [
    ({"avx2", "fma", "f16c"}, False),
    ({"avx512f", "avx512bw", "avx512_bf16"}, False),  # bfloat16 only
    ({"avx512f", "avx512bw", "avx512_fp16"}, True),
    ({"avx512f", "avx512bw", "amx_fp16"}, True),
    ({"avx512f", "avx512_fp16"}, False),  # TensorFlow also asks for AVX512BW
    ({"avx2", "avx_ne_convert"}, True),
    (set(), False),
])
def test_onednn_takes_float16_as_tensorflow_decides(flags, takes):
    from memsave.memory_model import onednn_takes_float16

    assert onednn_takes_float16(flags) is takes


def test_simulator_holds_a_float16_matmuls_float32_temporaries():
    import dataclasses

    from handgraphs import Builder
    from memsave.memory_model import MemoryModel
    from memsave.problem import Problem

    # x [2048, 256] @ w [256, 256] -> y, all float16: TensorFlow's CPU kernel
    # computes each product (y; dy w^T and x^T dy side by side) in float32.
    a, b = 2048 * 256 * 2, 256 * 256 * 2
    bld = Builder()
    x = bld.source("x", size_bytes=a)
    w = bld.source("w", size_bytes=b)
    y = bld.op("matmul", "MatMul", [x, w], size_bytes=a)
    loss = bld.op("loss", "Sum", [y], size_bytes=4)
    fg = bld.build([x, w], [loss])
    fg = dataclasses.replace(fg, tensors=tuple(
        dataclasses.replace(t, dtype="float16", itemsize=2) for t in fg.tensors))
    with_copies = Problem(fg, model=MemoryModel(float16_without_onednn=True)).peak(None)
    without = Problem(fg, model=MemoryModel(float16_without_onednn=False)).peak(None)
    # The gradient's: 2 (y, w, dx) + 2 (x, dy, dw); the forward's 2 (x, w, y) is less.
    assert with_copies - without == 4 * (a + b + a)


@pytest.mark.slow
def test_float16_conv_forecast_is_within_issue_8s_bound(fresh):
    from test_forecast_chain import assert_within_bound

    assert_within_bound(fresh.call(measure), "float16 conv net", MAX_ERROR)
