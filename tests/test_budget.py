"""``memory_budget=`` end to end: the plan fits, the gradients are tf.gradients'.

A dense tanh chain in a tf.function (activations of 2 MiB, above the CPU
allocator's 256 KiB floor), differentiated with memsave under budgets
between its smallest forecast peak and the plain one.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import MemoryBudgetError

LAYERS = 12
WIDTH = 256
BATCH = 2048


def _model():
    rs = np.random.RandomState(0)
    ws = [tf.Variable((rs.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype("float32"))
          for _ in range(LAYERS)]
    x = tf.constant(rs.randn(BATCH, WIDTH).astype("float32"))

    def loss_fn():
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        return tf.reduce_sum(h * h)

    return ws, loss_fn


def _plan(memory_budget, **kw):
    ws, loss_fn = _model()
    out = {}

    @tf.function(autograph=False)  # errors raised as they are, not as StagingError
    def f():
        out["plan"] = memsave.plan(loss_fn(), ws, memory_budget=memory_budget, **kw)
        return tf.constant(0.0)

    f.get_concrete_function()
    return out["plan"]


@pytest.mark.parametrize("fraction", [0.7, 0.85, 1.0])
def test_plan_fits_the_budget_and_names_its_solver(fraction):
    plan = _plan(fraction)
    assert plan.budget_bytes == int(fraction * plan.baseline_peak_bytes)
    assert plan.feasible and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.solver in memsave.solvers.available()
    assert plan.solve_time_s >= 0 and plan.optimal in (True, False)
    assert plan.strategy == "budget"
    if fraction == 1.0:
        assert plan.recompute_cost == 0  # tf.gradients fits: nothing recomputed
    else:
        assert plan.checkpoints or plan.recompute_cost < plan.forward_cost


def test_a_larger_budget_never_costs_more_recomputation():
    costs = [_plan(f).recompute_cost for f in (0.7, 0.8, 0.9, 1.0)]
    assert costs == sorted(costs, reverse=True)
    assert costs[0] > costs[-1]


def test_bytes_budget_and_infeasible_budget():
    plan = _plan(0.75)
    again = _plan(int(plan.budget_bytes))
    assert again.budget_bytes == plan.budget_bytes
    with pytest.raises(MemoryBudgetError, match="smallest forecast peak") as e:
        _plan(0.01)
    assert e.value.min_peak_bytes > 0.01 * plan.baseline_peak_bytes
    # The smallest peak it reports is a budget that works.
    assert _plan(int(e.value.min_peak_bytes)).feasible


@pytest.mark.parametrize("bad", [0, -5, 1.5, 0.0, "half", True])
def test_invalid_budget_says_what_is_allowed(bad):
    with pytest.raises(MemoryBudgetError, match="memory_budget"):
        _plan(bad)


def test_gradients_under_a_budget_equal_tf_gradients():
    ws, loss_fn = _model()

    @tf.function
    def step():
        loss = loss_fn()
        return (memsave.gradients(loss, ws, memory_budget=0.7),
                tf.gradients(loss, ws))

    ours, ref = step()
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-5, atol=2e-5)


def test_patch_passes_the_budget():
    ws, loss_fn = _model()

    @tf.function
    def step():
        loss = loss_fn()
        ref = tf.gradients(loss, ws)
        with memsave.patch(memory_budget=0.7):
            ours = tf.gradients(loss, ws)
        return ours, ref

    ours, ref = step()
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-5, atol=2e-5)
