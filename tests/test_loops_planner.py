"""The planner chooses each loop's gradient (memsave.planners.loops).

``'memory'`` and ``memory_budget=`` weigh, per While op of the
differentiated graph, while_v2's gradient, per-step and chunked ones
(forecast by memsave.loopmodel); the Plan says what it chose and
memsave.gradients applies it (memsave.loops.apply, before the rewrite).
Gradients are compared with tf.gradients'; the tests check that the loop's
gradient was changed (the forward While pushes the state only), not only
that the numbers agree. Keras ``fit`` through memsave.keras.checkpointed:
loss histories equal plain fit's.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import _tf_while, loopmodel, loops, planners
from memsave.errors import MemoryBudgetError
from memsave.loopmodel import LoopChoice
from memsave.memory_model import CPU_ONEDNN

keras = pytest.importorskip("keras")

#: Quick, yet each [B, H] float32 is 256 KiB, which the CPU allocator
#: counts (it reports no smaller buffer): the device's forecast sees the loop.
T, B, F, H = 24, 1024, 16, 64


def _values(steps=T):
    rng = np.random.RandomState(0)
    return (rng.randn(steps, B, F).astype(np.float32), rng.randn(F, 4 * H).astype(np.float32) * 0.2,
            rng.randn(H, 4 * H).astype(np.float32) * 0.2)


def _lstm_cell(x_t, h, c, W, U):
    i, f, o, g = tf.split(tf.matmul(x_t, W) + tf.matmul(h, U), 4, axis=1)
    c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
    return tf.sigmoid(o) * tf.tanh(c), c


def _while_lstm(x, W, U):
    steps = x.shape[0]

    def body(t, h, c):
        h, c = _lstm_cell(x[t], h, c, W, U)
        return t + 1, h, c

    zeros = tf.zeros([B, H])
    return tf.while_loop(lambda t, h, c: t < steps, body, [0, zeros, zeros],
                         maximum_iterations=steps)[1]


def _scan_lstm(x, W, U):
    zeros = tf.zeros([B, H])
    hs, _ = tf.scan(lambda hc, x_t: _lstm_cell(x_t, *hc, W, U), x, initializer=(zeros, zeros))
    return hs[-1]


def _loss(build, x, W, U):
    h = build(x, W, U)
    return tf.reduce_mean(tf.square(h))


def _step(evaluate, mode, build, **kwargs):
    """(plain gradients, memsave's, the Plan, the While ops after the gradients)."""
    xv, Wv, Uv = _values()
    setup = lambda: (tf.constant(xv), tf.Variable(Wv), tf.Variable(Uv))  # noqa: E731
    plans, whiles = [], []

    def plain(s):
        x, W, U = s
        return tf.gradients(_loss(build, x, W, U), [W, U])

    def ours(s):
        x, W, U = s
        loss = _loss(build, x, W, U)
        plans.append(memsave.plan(loss, [W, U], **kwargs))
        grads = memsave.gradients(loss, [W, U], **kwargs)
        whiles.extend(loops.find_loops([loss]))
        return grads

    return evaluate(mode, setup, plain), evaluate(mode, setup, ours), plans[-1], whiles


def assert_grads_equal(got, ref):
    for g, r in zip(got, ref, strict=True):
        scale = float(np.max(np.abs(r))) or 1.0
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("mode", ["session", "function"])
@pytest.mark.parametrize("build", [_while_lstm, _scan_lstm], ids=["while", "scan"])
def test_memory_chooses_a_loop_gradient_and_applies_it(evaluate, mode, build):
    ref, got, plan, whiles = _step(evaluate, mode, build, checkpoints="memory")
    assert_grads_equal(got, ref)
    (decision,) = plan.loops
    assert decision.trips == T and decision.trips_known
    assert decision.choice.kind != "plain"
    # The lowest forecast peak of the choices weighed (every byte counted)
    # that run the loop's trips again at most once (as per step does): a
    # chunk that runs each trip twice keeps less, but only budgets take it.
    once = next(f for f in decision.forecasts if f.choice.kind == "per_step").recompute_flops
    assert decision.chosen.recompute_flops <= once
    assert decision.chosen.kept_bytes == min(
        f.kept_bytes for f in decision.forecasts if f.recompute_flops <= once)
    assert any(f.recompute_flops > once and f.kept_bytes < decision.chosen.kept_bytes
               for f in decision.forecasts)
    assert plan.predicted_peak_bytes < plan.baseline_peak_bytes
    assert plan.recompute_cost >= decision.chosen.recompute_flops > 0
    # The rewrite ran: the differentiated While has memsave's gradient and
    # pushes the loop state only (a chunked loop: the state once per chunk).
    (op,) = [w for w in whiles if w.name == decision.name]
    assert _tf_while.marked(op) is not None
    body_inputs = {t.ref() for t in _tf_while.function_graphs(op)[1].inputs}
    pushed = [t for t, _ in loops.accumulators(op)]
    assert pushed and all(t.ref() in body_inputs for t in pushed), [t.name for t in pushed]


def test_plan_summary_and_dict_show_each_loop(graph):
    x, W, U = (tf.constant(v) for v in _values())
    loss = _loss(_while_lstm, x, tf.Variable(W), tf.Variable(U))
    plan = memsave.plan(loss, [v for v in graph.get_collection("variables")], checkpoints="memory")
    (d,) = plan.loops
    text = plan.summary()
    assert "loops (gradient chosen per While op)" in text
    assert d.name in text and str(d.choice) in text
    assert d.state_bytes == 2 * B * H * 4  # h and c, float32
    as_dict = plan.to_dict()["loops"][0]
    assert as_dict["name"] == d.name and as_dict["trips"] == T
    assert as_dict["choice"] == str(d.choice)
    assert {f["choice"] for f in as_dict["forecasts"]} >= {"plain", "per-step"}


def test_the_step_time_forecast_counts_the_trips_run_again(graph):
    """A loop gradient that runs the loop's trips again costs time: the
    plan's forecast step counts them (one trip: the loop's forward seconds
    over T), twice for a chunk that recomputes each trip twice."""
    x, W, U = (tf.constant(v) for v in _values())
    loss = _loss(_while_lstm, x, tf.Variable(W), tf.Variable(U))
    plan = memsave.plan(loss, [v for v in graph.get_collection("variables")], checkpoints="memory")
    (d,) = plan.loops
    assert d.choice.kind != "plain"
    base = plan.problem.base
    loop_forward_s = base.seconds.recompute[d.op]
    per_step = base.with_loops({d.op: LoopChoice.per_step()}).step_time(None)
    chunk = base.with_loops({d.op: LoopChoice.chunk(4)}).step_time(None)
    assert base.step_time(None).loop_recompute_s == 0
    assert per_step.loop_recompute_s == pytest.approx(loop_forward_s) and loop_forward_s > 0
    assert chunk.loop_recompute_s == pytest.approx(2 * loop_forward_s)
    assert plan.recompute_seconds >= plan.problem.loop_recompute_seconds() > 0
    assert plan.step_time_ratio == pytest.approx(plan.step_seconds / base.step_time(None).total_s)
    assert plan.step_time_ratio > 1


def test_a_list_item_the_gradient_reads_counts_under_a_recomputing_gradient(graph):
    """tf.map_fn writes each trip's tanh into its output list, and the tanh's
    gradient reads it: while_v2's gradient keeps that buffer once, with its
    accumulators; a per-step gradient recomputes the tanh while the list
    still holds every trip's (measured: a map_fn of three Dense+tanh
    layers, T=64, batch 1024: 112 MiB above resident, forecast 64 without
    the list)."""
    from memsave.extract import extract
    from memsave.memory_model import BFC, MemoryModel

    xv, Wv, _ = _values()
    W = tf.Variable(Wv)
    loss = tf.reduce_mean(tf.map_fn(lambda x_t: tf.tanh(x_t @ W), tf.constant(xv)) ** 2)
    fg = extract([loss], [W.handle]).fg
    (node,) = [n for n in fg.ops if n.body is not None and n.body.loop]
    model = MemoryModel(allocator=BFC)
    plain = loopmodel.figures(node.body, LoopChoice.plain(), model)
    per_step = loopmodel.figures(node.body, LoopChoice.per_step(), model)
    item = B * 4 * H * 4  # a [B, 4 H] float32 tanh per trip
    assert plain.stored_bytes == 0 and plain.saved_bytes >= T * item
    assert per_step.stored_bytes == T * item


@pytest.mark.parametrize("chained", [False, True])
def test_loops_that_do_not_read_each_other_are_forecast_side_by_side(graph, chained):
    """Two loops neither of which reads the other's results (the halves of a
    Bidirectional RNN) run side by side, forward and backward: the forecast
    holds both gradients' transients at once. One chunk each (all T trips'
    values recomputed at once, the transient): the peak holds both. A loop
    that starts from the other's state waits for it, and its gradient too:
    one transient at a time."""
    from memsave import simulate
    from memsave.extract import extract
    from memsave.memory_model import MemoryModel
    from memsave.problem import Problem

    xv, Wv, Uv = _values()
    x = tf.constant(xv)
    weights = [tf.Variable(Wv), tf.Variable(Uv), tf.Variable(Wv), tf.Variable(Uv)]
    h = _while_lstm(x, *weights[:2])
    if chained:
        def body(t, h, c):
            h, c = _lstm_cell(x[t], h, c, *weights[2:])
            return t + 1, h, c
        h = tf.while_loop(lambda t, h, c: t < T, body, [0, h, h], maximum_iterations=T)[1]
    else:
        h = h + _while_lstm(tf.reverse(x, [0]), *weights[2:])
    loss = tf.reduce_mean(tf.square(h))
    fg = extract([loss], [w.handle for w in weights]).fg
    first, second = [n.index for n in fg.ops if n.body is not None and n.body.loop]
    side = simulate.side_by_side_loops(fg)
    assert side == ({} if chained else {first: (second,), second: (first,)})
    choices = {i: LoopChoice.chunk(T) for i in (first, second)}
    trace = Problem(fg, model=MemoryModel()).with_loops(choices).forecast(None)
    both = sum(loopmodel.figures(fg.ops[i].body, choices[i], MemoryModel()).backward_bytes
               for i in (first, second))
    assert (trace.peak_bytes - trace.resident_bytes < both) == chained


@pytest.mark.parametrize("mode", ["session", "function"])
def test_speed_takes_the_least_recompute_within_its_budget(evaluate, mode):
    """'speed' chooses the loop's gradient too: the least recompute whose
    forecast peak is within its budget (0.75 of the loop-free problem's
    working memory): per step here (one forward of the loop again), not a
    chunk (up to two) nor plain (over the budget). Applied: the While has
    memsave's gradient, and the gradients are tf.gradients'."""
    from memsave.planners.strategies import speed_budget_bytes

    ref, got, plan, whiles = _step(evaluate, mode, _while_lstm, checkpoints="speed")
    assert_grads_equal(got, ref)
    (d,) = plan.loops
    assert d.choice == LoopChoice.per_step(), plan.summary()
    base = plan.problem.base
    within = speed_budget_bytes(base)
    assert base.peak(None, model=base.judge) > within  # plain does not fit
    assert plan.problem.peak(plan.schedule, model=base.judge) <= within
    for f in d.forecasts:
        if f.choice.kind == "chunk":
            variant = base.with_loops({d.op: f.choice})
            assert variant.loop_recompute_flops() >= plan.problem.loop_recompute_flops()
    (op,) = [w for w in whiles if w.name == d.name]
    assert _tf_while.marked(op) is not None


def test_speed_by_rule_and_lists_keep_while_v2s_gradient(graph):
    x, W, U = (tf.constant(v) for v in _values())
    Wv, Uv = tf.Variable(W), tf.Variable(U)
    loss = _loss(_while_lstm, x, Wv, Uv)
    rule = {"op_types": frozenset({"MatMul"})}
    assert memsave.plan(loss, [Wv, Uv], checkpoints="speed", strategy_options=rule).loops == ()
    memsave.gradients(loss, [Wv, Uv], checkpoints="speed", strategy_options=rule)
    assert all(_tf_while.marked(op) is None for op in loops.find_loops([loss]))


def test_a_loop_gathering_from_a_sequence_that_needs_a_gradient(graph):
    """An 8-trip RNN reading by index a captured sequence that needs a
    gradient, tanh(x W_in) (batch 512, width 256: the sequence 4 MiB, the
    state 512 KiB). Measured in a tf.function ('memory' with the loop's
    choice forced), peak with resident: plain loop 28.2 MiB, per step 29.8,
    chunk(k=2, inner=store) 36.8, chunk(k=2) 33.0-36.5. A gradient that runs
    trips again reads the sequence, so it lives until the loop's gradient;
    a chunk's own loop sums the sequence's gradient beside the outer loop's
    sum, from zeros of its own held as a constant. The forecast counts them,
    so 'memory' takes no chunk here (before: chunk(k=2, inner=store),
    forecast 24.0 MiB)."""
    steps, batch, width = 8, 512, 256
    sequence_bytes = steps * batch * width * 4
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(steps, batch, width).astype(np.float32))
    w_in, w, u = (tf.Variable(rng.randn(width, width).astype(np.float32) * 0.05)
                  for _ in range(3))
    sequence = tf.tanh(tf.einsum("tbd,de->tbe", x, w_in))

    def body(i, h):
        return i + 1, tf.tanh(tf.matmul(h, w) + tf.matmul(tf.gather(sequence, i), u))

    _, h = tf.while_loop(lambda i, h: i < steps, body, [tf.constant(0), tf.zeros([batch, width])],
                         maximum_iterations=steps)
    plan = memsave.plan(tf.reduce_mean(tf.square(h)), [w_in, w, u], checkpoints="memory")
    (d,) = plan.loops
    problem = plan.problem.base
    loop = problem.fg.ops[d.op]
    (seq,) = [t for t in loop.inputs if problem.costs.tensor_bytes[t] == sequence_bytes]
    # while_v2's gradient reads the sequence's shape only; a per-step one reads it.
    assert seq not in problem.costs.gradient_reads[d.op][0]
    per_step = problem.with_loops({d.op: LoopChoice.per_step()})
    assert seq in per_step.costs.gradient_reads[d.op][0]
    chunk = LoopChoice.chunk(2, inner="store")
    assert loopmodel.figures(loop.body, chunk, problem.model).invariant_sums == 2
    assert problem.with_loops({d.op: chunk}).peak(None) > per_step.peak(None) + sequence_bytes
    assert d.choice.kind != "chunk", plan.summary()


@pytest.mark.parametrize("name", ["memory", "speed"])
def test_each_combination_of_loop_choices_takes_a_share_of_the_search(graph, name):
    """A preset plans every combination of loop choices (here 2 loops):
    each with a share of its bounded search for time, the chosen one again
    with all of it, so that the call costs about two plannings, not one per
    combination; the Plan is what planning the chosen choices alone gives."""
    x = tf.constant(_values()[0])
    weights = [tf.Variable(v) for v in (*_values()[1:], *_values()[1:])]
    loss = _loss(_while_lstm, x, *weights[:2]) + _loss(_while_lstm, x * 2.0, *weights[2:])
    plan = memsave.plan(loss, weights, checkpoints=name)
    assert len(plan.loops) == 2
    chosen = plan.problem
    assert chosen.search_share == 1.0
    base = chosen.base
    per_step = base.with_loops({d.op: LoopChoice.per_step() for d in plan.loops})
    others = [v for v in (base, per_step) if v is not chosen]  # planned by every preset
    assert others and all(0.0 < v.search_share < 1.0 for v in others)
    alone = planners.get(name)(chosen)
    assert alone.checkpoint_ids == plan.checkpoint_ids
    assert alone.recompute_seconds == plan.recompute_seconds


def test_a_budget_plans_each_combination_of_loop_choices_with_a_share(graph, monkeypatch):
    """A budget weighs every combination of loop choices (here 2 loops, 25
    combinations): each with the greedy bounded by its share of the search,
    the chosen one again with the whole (``'auto'``: dp or milp on a graph
    this small). With the whole search for each, milp ran to its 30 s time
    limit on every combination of a Keras Embedding -> LSTM -> GRU fit step,
    and planning did not end within 5 minutes."""
    from memsave.planners import budget as budget_module

    shares = {name: [] for name in budget_module.CORES}
    for name, core in list(budget_module.CORES.items()):
        def counted(space, *a, name=name, core=core, **k):
            shares[name].append(space.problem.search_share)
            return core(space, *a, **k)
        monkeypatch.setitem(budget_module.CORES, name, counted)
    x = tf.constant(_values()[0])
    weights = [tf.Variable(v) for v in (*_values()[1:], *_values()[1:])]
    loss = _loss(_while_lstm, x, *weights[:2]) + _loss(_while_lstm, x * 2.0, *weights[2:])
    plan = memsave.plan(loss, weights, memory_budget=0.5)
    assert len(plan.loops) == 2 and plan.feasible
    assert plan.problem.search_share == 1.0
    exact = shares["dp"] + shares["milp"]
    assert exact and all(s == 1.0 for s in exact), shares  # the chosen combination only
    assert len(exact) <= 2  # the articulation points, and the wider cuts
    assert sum(s < 1.0 for s in shares["greedy"]) >= 20, shares


def test_budget_takes_the_least_recompute_that_fits(graph):
    x, W, U = (tf.constant(v) for v in _values())
    Wv, Uv = tf.Variable(W), tf.Variable(U)
    loss = _loss(_while_lstm, x, Wv, Uv)
    plans = {}
    for fraction in (0.9, 0.5, 0.25):
        p = plans[fraction] = memsave.plan(loss, [Wv, Uv], memory_budget=fraction)
        assert p.predicted_peak_bytes <= p.budget_bytes
        assert p.budget_bytes == int(fraction * p.baseline_peak_bytes)
        (d,) = p.loops
        # Every other choice of the loop, with the budget solver's plan of
        # the rest of the graph, recomputes more or does not fit.
        for f in d.forecasts:
            if f.choice == d.choice:
                continue
            variant = p.problem.base.with_loops({d.op: f.choice})
            try:
                other = planners.get("auto")(variant, budget=p.budget_bytes)
            except MemoryBudgetError:
                continue
            assert other.recompute_cost >= p.recompute_cost, (f.choice, d.choice)
    costs = [plans[f].recompute_cost for f in (0.9, 0.5, 0.25)]
    assert costs == sorted(costs)
    assert plans[0.25].loops[0].choice.kind != "plain"


def test_budget_below_every_choice_says_the_smallest_peak(graph):
    x, W, U = (tf.constant(v) for v in _values())
    Wv, Uv = tf.Variable(W), tf.Variable(U)
    loss = _loss(_while_lstm, x, Wv, Uv)
    with pytest.raises(MemoryBudgetError, match="smallest forecast peak") as e:
        memsave.plan(loss, [Wv, Uv], memory_budget=1000)
    assert e.value.min_peak_bytes is not None and e.value.min_peak_bytes > 1000
    assert memsave.plan(loss, [Wv, Uv], memory_budget=e.value.min_peak_bytes).feasible
    fraction = float(re.search(r"or >= ([0-9.]+) as a fraction", str(e.value)).group(1))
    assert memsave.plan(loss, [Wv, Uv], memory_budget=fraction).feasible


def test_a_fraction_of_a_plain_peak_of_0_bytes_keeps_every_loop_plain(graph):
    """Every buffer of a small loop is under what the CPU allocator counts:
    the plain forecast peak is 0 bytes, and so is ``memory_budget=0.5`` of
    it. tf.gradients' own forecast fits that budget, as in a graph without
    loops, so nothing is recomputed (it raised MemoryBudgetError: each loop
    choice's planner refused "0 bytes")."""
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(6, 4, 8).astype(np.float32))
    W, U = (tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.3) for _ in range(2))
    _, h = tf.while_loop(lambda t, h: t < 6, lambda t, h: (t + 1, tf.tanh(x[t] @ W + h @ U)),
                         [0, tf.zeros([4, 8])], maximum_iterations=6)
    loss = tf.reduce_sum(h * h)
    plan = memsave.plan(loss, [W, U], memory_budget=0.5, allocator=CPU_ONEDNN)
    assert plan.baseline_peak_bytes == 0 and plan.feasible
    assert [d.choice for d in plan.loops] == [LoopChoice.plain()]
    assert plan.checkpoint_ids == () and "budget fits" in plan.note
    assert "+0.0% vs tf.gradients" in plan.summary()
    # The user's bytes are still checked.
    with pytest.raises(MemoryBudgetError, match="must be > 0"):
        memsave.plan(loss, [W, U], memory_budget=0, allocator=CPU_ONEDNN)


def _nested(x, W, U):
    """A loop whose body runs a loop of 2 trips."""
    def outer(j, h, c):
        _, h, c = tf.while_loop(lambda i, h, c: i < j + 2,
                                lambda i, h, c: (i + 1, *_lstm_cell(x[i], h, c, W, U)),
                                [j, h, c], maximum_iterations=2)
        return j + 2, h, c

    zeros = tf.zeros([B, H])
    return tf.while_loop(lambda j, h, c: j < T, outer, [0, zeros, zeros],
                         maximum_iterations=T // 2)[1]


def test_a_loop_in_a_loop_body_is_named_in_a_warning(evaluate, caplog):
    with caplog.at_level(logging.WARNING, logger="memsave.loops"):
        ref, got, plan, _ = _step(evaluate, "function", _nested, checkpoints="memory")
    assert_grads_equal(got, ref)
    (d,) = plan.loops  # the outer loop only
    warned = [r.getMessage() for r in caplog.records if "keeps while_v2's gradient" in r.getMessage()]
    assert warned and all(f"the body of loop {d.name}" in m for m in warned)


def test_a_loop_in_a_called_function_is_named_in_a_warning(evaluate, caplog):
    def build(x, W, U):
        return tf.function(_while_lstm)(x, W, U)

    with caplog.at_level(logging.WARNING, logger="memsave.loops"):
        ref, got, plan, _ = _step(evaluate, "function", build, checkpoints="memory")
    assert_grads_equal(got, ref)
    assert plan.loops == ()
    assert any("in function call" in r.getMessage() and "keeps while_v2's gradient" in r.getMessage()
               for r in caplog.records)


# -- Keras fit through memsave.keras.checkpointed ---------------------------------

KT, KB, KF, KH = 12, 16, 6, 16
SAMPLES, EPOCHS = 64, 2


def _keras_layers(name):
    L = keras.layers
    return {
        "LSTM": lambda: [L.LSTM(KH)],
        "stacked": lambda: [L.LSTM(KH, return_sequences=True), L.GRU(KH, return_sequences=True),
                            L.Flatten()],
        "Bidirectional": lambda: [L.Bidirectional(L.LSTM(KH))],
        "recurrent_dropout": lambda: [L.LSTM(KH, recurrent_dropout=0.2, seed=3)],
        "GRU": lambda: [L.GRU(KH)],
        "SimpleRNN": lambda: [L.SimpleRNN(KH)],
        "masking": lambda: [L.Masking(0.0), L.LSTM(KH)],
    }[name]()


def _fit(name, checkpoints, caplog, **kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((KT, KF)), *_keras_layers(name), keras.layers.Dense(3)])
    if checkpoints is not None:
        memsave.keras.checkpointed(model, checkpoints, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.RandomState(1)
    x = rng.randn(SAMPLES, KT, KF).astype(np.float32)
    x[::2, -4:, :] = 0.0  # masked steps (for "masking")
    y = rng.randn(SAMPLES, 3).astype(np.float32)
    keras.utils.set_random_seed(2)
    with caplog.at_level(logging.INFO, logger="memsave.loops"):
        history = model.fit(x, y, batch_size=KB, epochs=EPOCHS, shuffle=False, verbose=0)
    return history.history["loss"]


LOOPS_IN = {"LSTM": 1, "stacked": 2, "Bidirectional": 2, "recurrent_dropout": 1, "GRU": 1,
            "SimpleRNN": 1, "masking": 1}


@pytest.mark.parametrize("name", [n if n == "LSTM" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LOOPS_IN])
def test_keras_fit_history_equals_plain_fit(name, caplog):
    plain = _fit(name, None, caplog)
    caplog.clear()
    got = _fit(name, "memory", caplog)
    np.testing.assert_allclose(got, plain, rtol=1e-5)
    prepared = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memsave: loop")
                and "gradient" in r.getMessage() and "keeps" not in r.getMessage()]
    # Each loop of the train step got a gradient of memsave's (traced once
    # for fit's step).
    assert len(prepared) >= LOOPS_IN[name], prepared
    assert not any("plain gradient" in m for m in prepared)


def test_keras_plan_of_a_fit_step_shows_the_loop():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((KT, KF)), keras.layers.LSTM(KH), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((KB, KT, KF), np.float32)
    y = np.zeros((KB, 3), np.float32)
    plan = memsave.keras.plan(model, x, y, checkpoints="memory")
    (d,) = plan.loops
    assert d.trips == KT and d.choice.kind != "plain"
    assert plan.predicted_peak_bytes <= plan.baseline_peak_bytes


def test_memory_under_xla_equals_tf_gradients():
    xv, Wv, Uv = _values()
    x, W, U = tf.constant(xv), tf.Variable(Wv), tf.Variable(Uv)
    plans = []

    @tf.function(jit_compile=True)
    def plain(x):
        return tf.gradients(_loss(_while_lstm, x, W, U), [W, U])

    @tf.function(jit_compile=True)
    def ours(x):
        loss = _loss(_while_lstm, x, W, U)
        plans.append(memsave.plan(loss, [W, U], checkpoints="memory"))
        grads = memsave.gradients(loss, [W, U], checkpoints="memory")
        (op,) = loops.find_loops([loss])
        assert _tf_while.marked(op) is not None
        return grads

    assert_grads_equal([g.numpy() for g in ours(x)], [g.numpy() for g in plain(x)])
    assert plans[0].loops[0].choice.kind != "plain"


def test_unknown_trip_count_is_planned_per_step_at_most():
    """``maximum_iterations`` unknown at trace time (an argument of the
    tf.function): T is not known (forecast as one trip), so no chunk size is
    weighed; the gradients are tf.gradients'."""
    xv, Wv, Uv = _values()
    x, W, U = tf.constant(xv), tf.Variable(Wv), tf.Variable(Uv)
    plans = []

    def loss_of(n):
        def body(t, h, c):
            h, c = _lstm_cell(x[t], h, c, W, U)
            return t + 1, h, c

        zeros = tf.zeros([B, H])
        h = tf.while_loop(lambda t, h, c: t < n, body, [0, zeros, zeros], maximum_iterations=n)[1]
        return tf.reduce_mean(tf.square(h))

    spec = [tf.TensorSpec([], tf.int32)]

    @tf.function(input_signature=spec)
    def plain(n):
        return tf.gradients(loss_of(n), [W, U])

    @tf.function(input_signature=spec)
    def ours(n):
        loss = loss_of(n)
        plans.append(memsave.plan(loss, [W, U], checkpoints="memory"))
        return memsave.gradients(loss, [W, U], checkpoints="memory")

    n = tf.constant(T - 1)
    assert_grads_equal([g.numpy() for g in ours(n)], [g.numpy() for g in plain(n)])
    (d,) = plans[-1].loops
    assert not d.trips_known
    assert {f.choice.kind for f in d.forecasts} == {"plain", "per_step"}


def _while_lstm_dropout(x, W, U):
    """The LSTM with ``tf.nn.dropout`` on h in the body: a draw each trip,
    which the gradient reads only through the mask made from it."""
    steps = x.shape[0]

    def body(t, h, c):
        h, c = _lstm_cell(x[t], h, c, W, U)
        return t + 1, tf.nn.dropout(h, 0.2, seed=1), c

    zeros = tf.zeros([B, H])
    return tf.while_loop(lambda t, h, c: t < steps, body, [0, zeros, zeros],
                         maximum_iterations=steps)[1]


@pytest.mark.parametrize("budget", [None, 0.6])
def test_a_draw_in_the_body_is_planned_as_it_is_built(graph, caplog, budget):
    """memsave.loops.prepare stores a loop per step when its body has an op
    that must not run twice (chunks would draw again). The planner offered
    chunks all the same when the gradient read the draw only through a
    dropout mask: 'memory' chose chunk(k=3, inner=store), forecast 16.0 MiB,
    and the build, per step, measured 25.8 MiB (T=32, B=1024, H=64); a
    budget was exceeded the same way. Now only plain and per step are
    weighed, and per step's forecast stores the draws (one [B, H] float32
    each trip) beside the state."""
    x, W, U = (tf.constant(v) for v in _values())
    Wv, Uv = tf.Variable(W), tf.Variable(U)
    loss = _loss(_while_lstm_dropout, x, Wv, Uv)
    kwargs = {"checkpoints": "memory"} if budget is None else {"memory_budget": budget}
    plan = memsave.plan(loss, [Wv, Uv], **kwargs)
    (d,) = plan.loops
    assert {f.choice.kind for f in d.forecasts} == {"plain", "per_step"}
    assert d.choice.kind == "per_step"
    per_step = next(f for f in d.forecasts if f.choice.kind == "per_step")
    assert per_step.kept_bytes == T * (d.state_bytes + B * H * 4)
    with caplog.at_level(logging.WARNING, logger="memsave"):
        memsave.gradients(loss, [Wv, Uv], checkpoints=plan)
    assert "instead" not in caplog.text, caplog.text  # built as planned
    (op,) = loops.find_loops([loss])
    assert _tf_while.marked(op) is not None


def test_the_draws_behind_a_tensor_are_found_through_every_path(graph):
    """memsave.extract._Draws walks producers before consumers: ``add(b,
    a)`` reads ``b`` first and ``a`` second, and ``b`` is computed from
    ``a``. A walk that reached ``a`` first answered ``b`` before ``a`` and
    cached it with no draw behind it."""
    from memsave.extract import _Draws

    r = tf.random.uniform([4])
    a = tf.identity(r) * 2.0
    b = a + 1.0
    draws = _Draws()
    assert list(draws.behind(tf.add(b, a))) == [r.ref()]
    assert list(draws.behind(b)) == [r.ref()]  # answered on the way
    assert list(draws.behind(tf.add(a, b))) == [r.ref()]
    assert draws.behind(tf.constant(1.0) * 2.0) == {}


def test_an_unknown_batch_in_a_loop_body_takes_the_batch_size_hint():
    """A step traced with an unknown batch and planned with ``batch_size=``
    counted the loop body's [None, H] tensors at a batch of 1: 0 bytes a
    trip on the CPU, the loop left plain. The body takes the hint as the
    enclosing graph does, and the loop is planned as with that batch."""
    xv, Wv, Uv = _values()
    W, U = tf.Variable(Wv), tf.Variable(Uv)
    loops_of = {}
    for name, batch in (("static", B), ("hinted", None)):
        @tf.function(input_signature=[tf.TensorSpec([T, batch, F])])
        def f(x):
            def body(t, h, c):
                h, c = _lstm_cell(x[t], h, c, W, U)
                return t + 1, h, c

            zeros = tf.zeros_like(x[0] @ W[:, :H])
            h = tf.while_loop(lambda t, h, c: t < T, body, [0, zeros, zeros],
                              maximum_iterations=T)[1]
            loss = tf.reduce_mean(tf.square(h))
            loops_of[name] = memsave.plan(loss, [W, U], checkpoints="memory", batch_size=B,
                                          allocator=CPU_ONEDNN).loops
            return loss

        f.get_concrete_function()
    (static,), (hinted,) = loops_of["static"], loops_of["hinted"]
    assert hinted.state_bytes == static.state_bytes == 2 * B * H * 4
    assert hinted.choice == static.choice != LoopChoice.plain()
    assert [(f.choice, f.kept_bytes) for f in hinted.forecasts] == \
        [(f.choice, f.kept_bytes) for f in static.forecasts]
