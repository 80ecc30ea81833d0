"""``memory_budget=`` end to end: the plan fits, the gradients are tf.gradients'.

A dense tanh chain in a tf.function (activations of 2 MiB, above the CPU
allocator's 256 KiB floor), differentiated with memsave under budgets
between its smallest forecast peak and the plain one.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import tensorflow as tf

import memsave
import memsave.keras
from memsave import MemoryBudgetError
from memsave.planners.budget import least_fraction, resolve_budget

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
    assert plan.solver in memsave.planners.budget.CORES
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
    # The fraction it quotes is of the plain peak the budget is a fraction
    # of (under memsave.keras plain fit's step, not tf.gradients').
    assert (f"{e.value.min_peak_bytes / plan.baseline_peak_bytes:.1%} of the forecast plain "
            f"peak, {plan.baseline_peak_bytes:,}") in str(e.value)
    # The smallest peak it reports is a budget that works, and so is the
    # fraction it names.
    assert _plan(int(e.value.min_peak_bytes)).feasible
    assert _plan(_named_fraction(e.value)).feasible


def _named_fraction(error: MemoryBudgetError) -> float:
    return float(re.search(r"or >= ([0-9.]+) as a fraction", str(error)).group(1))


def test_the_fraction_a_refusal_names_is_rounded_up():
    # 33.34% of the plain peak, rounded to nearest, is 0.333: a budget below
    # the peak, refused again.
    assert least_fraction(3334, 10000) == " (or >= 0.334 as a fraction)"
    assert least_fraction(3330, 10000) == " (or >= 0.333 as a fraction)"
    assert least_fraction(10001, 10000) == ""  # no fraction in (0, 1] reaches it
    rng = random.Random(0)
    for _ in range(2000):
        base = rng.randrange(1, 10**10)
        low = rng.randrange(1, base + 1)
        f = float(least_fraction(low, base).split(">= ")[1].split()[0])
        assert resolve_budget(f, base, api="t") >= low, (low, base, f)
        assert f == 0.001 or resolve_budget(round(f - 0.001, 3), base, api="t") < low


def test_an_infeasible_budget_raises_through_autograph_and_keras_fit():
    # A user's step is an autograph tf.function (Keras fit's is too): the
    # error must arrive as MemoryBudgetError with its smallest peak, not as
    # autograph's StagingError.
    ws, loss_fn = _model()

    @tf.function
    def step():
        return memsave.gradients(loss_fn(), ws, memory_budget=0.01)

    with pytest.raises(MemoryBudgetError, match="smallest forecast peak") as e:
        step.get_concrete_function()
    assert e.value.min_peak_bytes > 0

    import keras

    inputs = keras.Input((KERAS_WIDTH,))  # 1 MiB activations: above the allocator's floor
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(KERAS_WIDTH, activation="tanh")(h)
    model = memsave.keras.checkpointed(keras.Model(inputs, h), memory_budget=0.01)
    model.compile(optimizer="sgd", loss="mse")
    data = np.ones((KERAS_BATCH, KERAS_WIDTH), "float32")
    with pytest.raises(MemoryBudgetError, match="smallest forecast peak") as e:
        model.fit(data, data, batch_size=KERAS_BATCH, verbose=0)
    assert e.value.min_peak_bytes > 0


@pytest.mark.slow
def test_fit_refuses_a_budget_with_the_figures_keras_plan_gives():
    """fit traced its step before the optimizer had built its slots (Adam:
    two per weight), so the budget was resolved against a plain peak
    without them and the error advised a budget that the next trace, with
    the slots, refused again. checkpointed's step builds the slots first:
    its refusal names the same smallest peak as memsave.keras.plan's."""
    import keras

    def model():  # 1 MiB weights: their slots count on CPU (256 KiB and more)
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((128,))]
                                + [keras.layers.Dense(512, activation="tanh") for _ in range(4)]
                                + [keras.layers.Dense(1)])

    rs = np.random.RandomState(0)
    x, y = rs.rand(1024, 128).astype("float32"), rs.rand(1024, 1).astype("float32")
    planned = model()
    planned.compile(optimizer="adam", loss="mse")
    with pytest.raises(MemoryBudgetError) as from_plan:
        memsave.keras.plan(planned, x, y, batch_size=1024, memory_budget=0.05)
    ours = memsave.keras.checkpointed(model(), memory_budget=0.05)
    ours.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(MemoryBudgetError) as from_fit:
        ours.fit(x, y, batch_size=1024, verbose=0)
    assert from_fit.value.min_peak_bytes == from_plan.value.min_peak_bytes > 0


@pytest.mark.parametrize("bad", [0, -5, 1.5, 0.0, "half", True])
def test_invalid_budget_says_what_is_allowed(bad):
    with pytest.raises(MemoryBudgetError, match="memory_budget"):
        _plan(bad)


@pytest.mark.parametrize("checkpoints", ["speed", "list"])
def test_a_budget_with_other_checkpoints_is_refused(checkpoints):
    # The budget chooses the checkpoints: another choice must not be dropped silently.
    ws, loss_fn = _model()

    @tf.function(autograph=False)
    def f():
        loss = loss_fn()
        chosen = [loss.op.inputs[0]] if checkpoints == "list" else checkpoints
        return memsave.gradients(loss, ws, checkpoints=chosen, memory_budget=0.7)

    with pytest.raises(memsave.CheckpointError, match="memory_budget"):
        f.get_concrete_function()


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
    # The budget reaches memsave: one below every plan's peak raises.
    with pytest.raises(MemoryBudgetError, match="smallest forecast peak"):
        tf.function(lambda: _patched_gradients(0.01), autograph=False).get_concrete_function()


def _patched_gradients(memory_budget):
    ws, loss_fn = _model()
    loss = loss_fn()
    with memsave.patch(memory_budget=memory_budget):
        return tf.gradients(loss, ws)


# -- Keras fit under a budget -------------------------------------------------------
#
# A functional Dense(KERAS_WIDTH, tanh) stack on batches of KERAS_BATCH rows:
# each float32 activation is 1 MiB, above the CPU allocator's 256 KiB floor,
# and the weights (16 KiB a layer) are negligible. Plain SGD: no slots.

KERAS_WIDTH, KERAS_BATCH = 64, 4096
MiB = 1 << 20

#: Allowed overshoot of the measured peak over the budget (issue 9).
BUDGET_TOLERANCE = 0.10


def _keras_model(depth):
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((KERAS_WIDTH,))
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(KERAS_WIDTH, activation="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def _keras_data(batches):
    rs = np.random.RandomState(0)
    return (rs.randn(batches * KERAS_BATCH, KERAS_WIDTH).astype(np.float32),
            rs.randn(batches * KERAS_BATCH, 1).astype(np.float32))


def _fit(model, x, y, **kw):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    return model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0, **kw)


def test_keras_fit_under_a_budget_trains_like_plain_fit(monkeypatch):
    # Plain fit takes its gradients with GradientTape: the same losses and
    # weights after two steps mean the same gradients, to float32 rounding.
    import memsave.keras

    x, y = _keras_data(2)
    plain = _keras_model(12)
    w0 = plain.get_weights()
    ref = _fit(plain, x, y).history["loss"]
    ours = _keras_model(12)
    ours.set_weights(w0)
    memsave.keras.checkpointed(ours, memory_budget=0.6)
    calls = []
    real = memsave.planners.budget.solve

    def spy(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    monkeypatch.setattr(memsave.planners.budget, "solve", spy)
    got = _fit(ours, x, y).history["loss"]
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    change = max(float(np.abs(w - v).max()) for w, v in zip(plain.get_weights(), w0))
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * change)
    # The budget planned the step: its plan fits and recomputes something.
    assert calls and all(p.feasible and p.recompute_cost > 0 for p in calls)

    # A budget below every plan's peak stops fit with the smallest peak.
    low = _keras_model(12)
    memsave.keras.checkpointed(low, memory_budget=0.01)
    with pytest.raises(MemoryBudgetError, match="smallest forecast peak"):
        _fit(low, x, y)


def _fit_peaks(model, w0, x, y, fits: int) -> list[int]:
    """Measured peaks of ``fits`` fits from weights ``w0``, after one that
    compiles and traces (the others run that traced step, as a user's
    epochs do: a compile per fit would trace and plan again each time)."""
    model.set_weights(w0)
    _fit(model, x, y)  # compiles, traces
    peaks = []
    for _ in range(fits):
        model.set_weights(w0)
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    return peaks


def measure_keras_budget(depth=48, fractions=(0.4, 0.6)) -> dict:
    """Measured fit peaks: plain, then checkpointed at ``fraction`` of plain's peak (bytes)."""
    import memsave.keras

    x, y = _keras_data(2)
    model = _keras_model(depth)
    w0 = model.get_weights()

    def peak():
        # The median of seven fits. Plain fit's peak varies from fit to fit
        # (51-59 MiB side by side with other processes): the executor leaves
        # weight gradients queued while the gradient chain runs on.
        # memsave's chain waits for them (memsave.rewrite._no_run_ahead);
        # before it did, checkpointed fits varied too (at budget 0.6, 32-44
        # MiB for a 31 MiB forecast, three processes side by side).
        return int(np.median(_fit_peaks(model, w0, x, y, 7)))

    out = {"plain_bytes": peak()}
    for f in fractions:
        budget = int(f * out["plain_bytes"])
        memsave.keras.checkpointed(model, memory_budget=budget)
        out[str(f)] = {"budget_bytes": budget, "peak_bytes": peak()}
    return out


def measure_keras_budget_one_thread(depth=48, fractions=(0.4, 0.6)) -> dict:
    """Measured fit peaks with one inter-op thread, budgets a fraction of plain's forecast."""
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave.keras

    x, y = _keras_data(2)
    model = _keras_model(depth)
    w0 = model.get_weights()
    model.compile(optimizer="sgd", loss="mse")  # plan() needs it; _fit compiles SGD again
    plain = memsave.keras.plan(model, x[:KERAS_BATCH], y[:KERAS_BATCH]).baseline_peak_bytes
    res = {"plain_forecast_bytes": plain}
    for f in fractions:
        memsave.keras.checkpointed(model, memory_budget=f)
        res[str(f)] = {"budget_bytes": int(f * plain), "peaks": _fit_peaks(model, w0, x, y, 5)}
    return res


@pytest.mark.slow
def test_keras_fit_meets_the_budget_with_one_inter_op_thread(fresh):
    # One inter-op thread starves TensorFlow's executor as a busy second core
    # does: the ops it queues beside the one it runs inline (a layer's weight
    # gradient beside the gradient chain) wait, holding their buffers, while
    # the chain runs on. Plain fit then reads 60-94 MiB for a 51 MiB forecast
    # (measured by hand, five fits). memsave's gradient chain waits for its
    # weight gradients (memsave.rewrite._no_run_ahead), so every fit meets
    # the budget; without those waits, fits at budget 0.6 (30.6 MiB) read
    # 28-50 MiB. The budget is a fraction of plain's forecast
    # (memory_budget=0.6), not of plain's measured peak, which the starved
    # executor inflates; each fit must meet it, not only the median.
    res = fresh.call(measure_keras_budget_one_thread, timeout_s=900)
    for f, r in res.items():
        if not f[0].isdigit():
            continue
        worst = max(r["peaks"])
        assert worst <= (1 + BUDGET_TOLERANCE) * r["budget_bytes"], (
            f"budget {f} of plain fit's {res['plain_forecast_bytes'] / MiB:.1f} MiB forecast, one "
            f"inter-op thread: fits measured {[p / MiB for p in r['peaks']]} MiB, over "
            f"{r['budget_bytes'] / MiB:.1f} MiB + 10%")


@pytest.mark.slow
def test_keras_fit_measured_peak_meets_the_budget(fresh):
    # In a fresh process (tests/fresh.py): budgets in bytes, a fraction of
    # plain fit's measured peak.
    res = fresh.call(measure_keras_budget, timeout_s=900)
    for f, r in res.items():
        if f == "plain_bytes":
            continue
        assert r["peak_bytes"] <= (1 + BUDGET_TOLERANCE) * r["budget_bytes"], (
            f"budget {f} of plain fit's {res['plain_bytes'] / MiB:.1f} MiB: measured "
            f"{r['peak_bytes'] / MiB:.1f} MiB over {r['budget_bytes'] / MiB:.1f} MiB + 10%")


def measure_keras_partial_batch(depth=24) -> dict:
    """Measured fit peaks on 2.98 batches of data (the last one partial): plain, 'memory'."""
    import memsave.keras

    rs = np.random.RandomState(0)
    rows = 2 * KERAS_BATCH + 4000
    x = rs.randn(rows, KERAS_WIDTH).astype(np.float32)
    y = rs.randn(rows, 1).astype(np.float32)
    model = _keras_model(depth)
    w0 = model.get_weights()
    out = {"plain": int(np.median(_fit_peaks(model, w0, x, y, 5)))}
    memsave.keras.checkpointed(model)
    out["memory"] = int(np.median(_fit_peaks(model, w0, x, y, 5)))
    return out


@pytest.mark.slow
def test_keras_fit_with_a_partial_last_batch_saves_memory(fresh):
    # fit traces its step on batches of unknown size when the last batch is
    # partial; memsave plans for fit's batch size (memsave.keras), where it
    # planned for a batch of 1 and ran plain gradients: measured by hand,
    # 'memory' at 28-29 MiB like plain fit, against 16 MiB since.
    res = fresh.call(measure_keras_partial_batch, timeout_s=600)
    assert res["memory"] <= 0.75 * res["plain"], (
        f"'memory' fit peak {res['memory'] / MiB:.1f} MiB, plain {res['plain'] / MiB:.1f} MiB")
