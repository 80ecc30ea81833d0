"""Minimal reproductions of memsave bugs found while writing other tests.

Each test is the smallest graph that shows the bug, compared with
tf.gradients. A test marked ``xfail(strict=True)`` documents a bug that is
not fixed yet: once memsave is fixed it passes, the strict xfail turns that
into a failure, and the marker should be removed.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import memsave


def test_gradient_wrt_an_x_whose_sibling_output_is_recomputed(graph, session):
    rs = np.random.RandomState(0)
    data = tf.constant(rs.randn(4, 6).astype(np.float32))
    w = tf.Variable(rs.randn(6, 6).astype(np.float32))
    h = tf.tanh(tf.tanh(tf.matmul(data, w)))
    a, b = tf.split(h * 2.0, 2, axis=1)
    y = tf.reduce_sum(tf.tanh(a) * tf.tanh(b))

    ref = tf.gradients(y, [w, b])
    ours = memsave.gradients(y, [w, b], checkpoints=[h])
    assert ours[1] is not None, "memsave.gradients returned None for dy/db"
    session.run(tf.compat.v1.global_variables_initializer())
    ref_v, ours_v = session.run([ref, ours])
    assert np.abs(ref_v[1]).max() > 0.1  # the gradient is not small
    np.testing.assert_allclose(ours_v[0], ref_v[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours_v[1], ref_v[1], rtol=1e-5, atol=1e-6)
