"""memsave.plan forecasts the allocator peak a step really reaches.

A tanh chain (``LAYERS`` layers on a [1024, 256] float32 batch, 1 MiB
activations) and a small conv net are run in a fresh process each
(tests/fresh.py): a tf.function returning the gradients is called once to
warm up, then ``reset_memory_stats('CPU:0')``, one call,
``get_memory_info('CPU:0')['peak']`` (median of REPEATS), for tf.gradients
and memsave 'memory'; the forecast is ``memsave.plan(...)`` on the same
graph (``baseline_peak_bytes`` for tf.gradients). Issue 8's bound: within
MAX_ERROR of the measured peak.
"""

from __future__ import annotations

import numpy as np
import pytest

from fresh import step_peaks

LAYERS = 12
#: Steps measured per method; the median is compared. A step's peak depends
#: on which ready kernels the executor runs side by side: on 2 loaded cores
#: the conv net's plain step measured 10-14 MiB from one step to the next
#: (27 steps, three processes at once; forecast 11 MiB), so the median of
#: 3 could land on an outlier (14.0 MiB in one CI run).
REPEATS = 9
MiB = 1 << 20

#: Issue 8's acceptance bound on |predicted - measured| / measured.
MAX_ERROR = 0.20


def _chain(ws, x):
    import tensorflow as tf

    h = x
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


def _convnet(ws, x):
    import tensorflow as tf

    h = x
    for w in ws:
        h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
    return tf.reduce_mean(tf.square(h))


def _model(model: str):
    """(weights, input, loss function) of the chain or the conv net."""
    import tensorflow as tf

    rs = np.random.RandomState(0)
    if model == "chain":
        ws = [tf.Variable(rs.randn(256, 256).astype(np.float32) / 16) for _ in range(LAYERS)]
        x = tf.constant(rs.randn(1024, 256).astype(np.float32))
        return ws, x, _chain
    ws = [tf.Variable(rs.randn(3, 3, 16, 16).astype(np.float32) / 12) for _ in range(8)]
    x = tf.constant(rs.randn(16, 32, 32, 16).astype(np.float32))
    return ws, x, _convnet


def measure(model: str) -> dict:
    ws, x, loss_fn = _model(model)
    return measure_step(ws, lambda: loss_fn(ws, x), repeats=REPEATS)


def measure_step(ws, loss_fn, *, repeats: int) -> dict:
    """Per method (tf.gradients, memsave 'memory'): the median measured peak
    of ``repeats`` steps returning the gradients of ``loss_fn()`` with respect
    to ``ws``, the forecast of ``memsave.plan`` and its checkpoints."""
    import tensorflow as tf

    import memsave

    out = {}
    for method in ("plain", "memory"):
        plans = []

        @tf.function
        def step():
            loss = loss_fn()
            plans.append(memsave.plan(loss, ws, checkpoints="memory"))
            if method == "plain":
                return tf.gradients(loss, ws)
            return memsave.gradients(loss, ws, checkpoints="memory")

        step()
        peaks = step_peaks(step, repeats)
        p = plans[0]
        out[method] = {
            "measured_bytes": int(np.median(peaks)),
            "predicted_bytes": p.baseline_peak_bytes if method == "plain" else p.predicted_peak_bytes,
            "checkpoints": len(p.checkpoints),
        }
    return out


@pytest.mark.parametrize("model", ["chain", "convnet"])
def test_memory_keeps_checkpoints_and_forecasts_a_lower_peak(model):
    # The plan the measured 'memory' step runs (no measurement): a real
    # plan, so that the comparison below is not of the fallback.
    import tensorflow as tf

    import memsave

    ws, x, loss_fn = _model(model)
    plans = []

    @tf.function
    def step():
        plans.append(memsave.plan(loss_fn(ws, x), ws, checkpoints="memory"))
        return tf.constant(0.0)

    step.get_concrete_function()
    assert plans[0].checkpoints, plans[0].summary()
    assert plans[0].predicted_peak_bytes < plans[0].baseline_peak_bytes, plans[0].summary()


def assert_within_bound(res: dict, label: str, max_error: float = MAX_ERROR) -> None:
    """Each method's forecast of :func:`measure_step`'s result within
    ``max_error`` of its measured peak, and 'memory' a real plan."""
    assert res["memory"]["checkpoints"] > 0, res  # the forecast of a real plan
    for method, r in res.items():
        err = (r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
        assert abs(err) <= max_error, (
            f"{label} {method}: forecast {r['predicted_bytes'] / MiB:.1f} MiB, measured "
            f"{r['measured_bytes'] / MiB:.1f} MiB ({err:+.1%})"
        )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["chain", "convnet"])
def test_forecast_is_within_issue_8s_bound(fresh, model):
    assert_within_bound(fresh.call(measure, model), model)
