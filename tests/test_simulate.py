"""The memory simulator on hand-built graphs, with peaks worked out by hand.

Every tensor is 1 MiB unless a test says otherwise; the x is resident (an
input), so it counts from the start, and so is the seed gradient
``ones_like(y)`` (y's shape is static: Grappler folds it into a constant). Tanh's gradient reads its output,
MatMul's its inputs, AddV2's nothing (its input gradients are the incoming
gradient's buffer), as TensorFlow's registered gradients do
(tests/test_costs.py checks that against TensorFlow).
"""

from __future__ import annotations

import pytest

import handgraphs as H
from handgraphs import Builder, MiB
from memsave.costs import estimate_costs
from memsave.graph import GradientUse
from memsave.schedule import build_schedule
from memsave.memory_model import BFC, CPU_ONEDNN, Allocator, MemoryModel
from memsave.simulate import simulate


def _ids(fg, *names):
    return tuple(sorted(next(t.id for t in fg.tensors if t.name == n) for n in names))


def _peak(fg, checkpoints=None, *, allocator=CPU_ONEDNN, overlap=1, **kw):
    costs = estimate_costs(fg)
    sched = None if checkpoints is None else build_schedule(fg, _ids(fg, *checkpoints))
    model = MemoryModel(allocator=allocator, weight_gradient_overlap=overlap)
    return simulate(fg, sched, costs, model=model, **kw)


def test_plain_tanh_chain():
    # x and the seed, then op0..op3 alive after the forward (each tanh
    # output is read by its own gradient): 6 MiB. Each gradient writes into
    # a dying buffer (TanhGrad is elementwise): the backward adds nothing.
    trace = _peak(H.chain(4))
    assert trace.peak_bytes == 6 * MiB
    assert trace.resident_bytes == 2 * MiB
    assert trace.end_bytes == 3 * MiB  # x, the seed and x's gradient
    assert trace.peak_event == "run op3"


def test_plain_chain_grows_by_one_tensor_per_op():
    assert [_peak(H.chain(n)).peak_bytes // MiB for n in (2, 4, 8)] == [4, 6, 10]


def test_checkpointed_tanh_chain():
    # op1 kept; x and the seed resident (2 MiB). Forward: op0 is written
    # into op1 (in place), op2/op3 are not kept: 4 MiB at most. y's step
    # recomputes op2, op3 from op1's proxy (which takes op1's buffer, its
    # last use): 4 MiB. op1's step: a proxy of x (the gate lands on x: a new
    # buffer), op0' written into it, op1' and op1's gradient: 5 MiB.
    trace = _peak(H.chain(4), ["op1:0"])
    assert trace.peak_bytes == 5 * MiB
    assert trace.peak_event == "recompute op1"
    assert trace.end_bytes == 3 * MiB


def test_matmul_chain_keeps_inputs_for_the_gradient():
    # MatMul's gradient reads its inputs: op0..op2 stay alive, op3 (read by
    # no gradient) is freed at once. Backward: x, the seed, op0..op2 and
    # op3's gradient (a new buffer: MatMul is not elementwise) = 6 MiB, as
    # much as while op3 ran.
    fg = H.chain(4, type="MatMul")
    trace = _peak(fg)
    assert trace.peak_bytes == 6 * MiB
    assert max(b for b, _ in trace.timeline[trace.backward_start:]) == 6 * MiB


def test_views_allocate_nothing():
    b = Builder()
    x = b.source("x")
    h = b.op("a", "Tanh", [x])
    h = b.op("r", "Reshape", [h])
    h = b.op("s", "Identity", [h])
    y = b.op("b", "Tanh", [h])
    fg = b.build(["x"], [y])
    # x, the seed, a (r and s are views of it), b; the gradients of s and r
    # are views of b's.
    assert _peak(fg).peak_bytes == 4 * MiB
    costs = estimate_costs(fg)
    assert costs.alias_of[b.ids["r:0"]] == b.ids["a:0"]
    assert costs.alias_of[b.ids["s:0"]] == b.ids["r:0"]


def _fork(add_gradient=None):
    b = Builder()
    x = b.source("x")
    a = b.op("a", "Tanh", [x])
    p = b.op("p", "Tanh", [a])
    q = b.op("q", "Tanh", [a])
    y = b.op("add", "AddV2", [p, q], gradient=add_gradient)
    return b.build(["x"], [y])


def _backward_max(trace):
    return max(b for b, _ in trace.timeline[trace.backward_start:])


def test_add_gradient_is_the_incoming_buffer():
    # x -> a -> (p, q) -> add. After the forward x, the seed, a, p, q are
    # alive (add's output is read by no gradient): 5 MiB. AddV2's input
    # gradients are the seed itself (two views): nothing new. q's and p's
    # TanhGrads write into q and p (their last use).
    assert _backward_max(_peak(_fork())) == 5 * MiB
    # Were they new buffers computed from the (constant) seed alone, Grappler
    # would fold them into two more resident constants.
    no_pass_through = GradientUse((), (), (None, None))
    trace = _peak(_fork(no_pass_through))
    assert trace.resident_bytes == 4 * MiB
    assert _backward_max(trace) == 7 * MiB


def _small_chain(n, size_bytes):
    b = Builder()
    h = b.source("x", size_bytes=size_bytes)
    for i in range(n):
        h = b.op(f"op{i}", "Tanh", [h], size_bytes=size_bytes)
    return b.build(["x"], [h])


def test_cpu_allocator_does_not_count_small_buffers():
    fg = _small_chain(4, 128 * 1024)
    assert _peak(fg).peak_bytes == 0
    assert _peak(fg, allocator=BFC).peak_bytes == 6 * 128 * 1024
    # 256 KiB is counted, rounded to 256 bytes.
    fg = _small_chain(4, 256 * 1024 + 1)
    assert _peak(fg).peak_bytes == 6 * (256 * 1024 + 256)
    assert CPU_ONEDNN.counted(262143) == 0 and CPU_ONEDNN.counted(262144) == 262144
    assert Allocator("exact", 0, 1).counted(1001) == 1001


def test_stateful_ops_outputs_stay_alive():
    # A non-recomputable op's output is kept, and the plain and checkpointed
    # runs both hold it through the backward.
    b = Builder()
    x = b.source("x")
    h = x
    for i in range(3):
        h = b.op(f"op{i}", "Tanh", [h])
    h = b.op("noise", "RandomUniform", [h], recomputable=False)
    for i in range(3, 6):
        h = b.op(f"op{i}", "Tanh", [h])
    fg = b.build(["x"], [h])
    plain = _peak(fg)
    ck = _peak(fg, ["op1:0"])
    assert ck.peak_bytes < plain.peak_bytes


def test_timeline_is_optional_and_peak_does_not_change():
    fg = H.chain(30)
    sched = build_schedule(fg, _ids(fg, "op9:0", "op19:0"))
    costs = estimate_costs(fg)
    with_tl = simulate(fg, sched, costs)
    without = simulate(fg, sched, costs, timeline=False)
    assert without.timeline == () and with_tl.timeline
    assert with_tl.peak_bytes == without.peak_bytes == max(b for b, _ in with_tl.timeline)


@pytest.mark.parametrize("n", [8, 16])
def test_memory_strategy_beats_plain_on_chains(n):
    from memsave import planners
    from memsave.problem import Problem

    fg = H.chain(n)
    plan = planners.run("memory", Problem(fg))
    assert plan.checkpoint_ids
    assert _peak(fg, list(plan.checkpoints)).peak_bytes < _peak(fg).peak_bytes


def test_a_recompute_step_runs_only_the_copies_a_gradient_reads():
    # y = Mean(op2): Mean's gradient reads nothing, so the y step's copy of
    # the Mean (the loss itself) feeds nothing fetched and TensorFlow prunes
    # it; op2's copy is read by its own gradient (Tanh reads its output).
    b = Builder()
    h = b.source("x")
    for i in range(3):
        h = b.op(f"op{i}", "Tanh", [h])
    y = b.op("mean", "Mean", [h], size_bytes=4)
    fg = b.build(["x"], [y])
    events = [e for _, e in _peak(fg, ["op1:0"]).timeline]
    assert "recompute op2" in events
    assert "recompute mean" not in events
    assert "run mean" in events  # the forward computes the loss once


def test_gradient_flows_through_an_activation_given_as_x():
    # x -> a -> b -> c (MatMuls), with a also an x: tf.gradients returns
    # a's gradient and still differentiates a's producer for x's.
    b = Builder()
    x = b.source("x")
    a = b.op("a", "MatMul", [x])
    h = b.op("b", "MatMul", [a])
    y = b.op("c", "MatMul", [h])
    fg = b.build(["x", "a:0"], [y])
    trace = _peak(fg)
    events = [e for _, e in trace.timeline]
    assert "gradient of a" in events
    # x, the seed, and both gradients (x's and a's) are alive at the end.
    assert trace.end_bytes == 4 * MiB


def _weighted_chain(n, w_bytes=2 * MiB):
    """d -> t0 -> ... -> t{n-1}: t_i = Tanh(MatMul(t_{i-1}, read_i)), read_i
    the ReadVariableOp of the x w_i (2 MiB each)."""
    b = Builder()
    h = b.external("d")
    ws = []
    for i in range(n):
        ws.append(b.source(f"w{i}", size_bytes=w_bytes))
        r = b.op(f"read{i}", "ReadVariableOp", [ws[-1]], recomputable=False, size_bytes=w_bytes)
        h = b.op(f"t{i}", "Tanh", [b.op(f"mm{i}", "MatMul", [h, r])])
    return b.build(ws, [h])


def test_gradients_consumed_when_written_cost_nothing():
    # Resident: the four 2 MiB weights, d and the seed (10 MiB). Kept, the
    # weights' gradients (8 MiB) are alive at the end; consumed as written
    # (an optimizer update in the step), none is, and the working peak is lower.
    fg = _weighted_chain(4)
    kept = _peak(fg, ["t1:0"], allocator=BFC)
    consumed = _peak(fg, ["t1:0"], allocator=BFC, gradients_kept=False)
    assert kept.resident_bytes == consumed.resident_bytes == 10 * MiB
    assert kept.end_bytes == 18 * MiB
    assert consumed.end_bytes == 10 * MiB
    assert consumed.peak_bytes < kept.peak_bytes


def test_under_xla_recomputed_steps_copy_their_weight_reads():
    # Outside XLA a recompute step gates only its activations: the proxies
    # of the weight reads are views. Under XLA the rewrite gates every
    # floating boundary tensor (ForwardGraph.xla): y's step (t2, t3 from
    # t1) makes new 2 MiB copies of read2 and read3, alive while it runs.
    # Both forecasts with the weights' gradients consumed as written (the
    # XLA model's default: the update in the compiled step).
    import dataclasses

    def alive_after_proxies(fg):
        trace = _peak(fg, ["t1:0"], allocator=BFC, gradients_kept=False)
        return next(b for b, e in trace.timeline if e == "proxy of read3:0"), trace.peak_bytes

    fg = _weighted_chain(4)
    plain_alive, plain_peak = alive_after_proxies(fg)
    xla_alive, xla_peak = alive_after_proxies(dataclasses.replace(fg, xla=True))
    assert plain_alive == 11 * MiB  # resident 10 and t1's proxy
    assert xla_alive == plain_alive + 2 * 2 * MiB
    assert xla_peak > plain_peak


def test_a_weight_gradient_kernel_holds_its_reads_through_the_next_gradient():
    # t_i = Tanh(MatMul(h, w_i)), the w_i xs. mm1's gradient is two
    # kernels: the input's, consumed at once by t0's gradient, and the
    # weight's, which nothing waits for and which the executor runs beside
    # t0's gradient: what it reads (mm1's incoming gradient, 1 MiB, beside
    # t0 which stays anyway) is alive one allocating gradient longer.
    b = Builder()
    h = b.external("d")
    for i in range(2):
        w = b.source(f"w{i}", size_bytes=MiB // 4)
        h = b.op(f"t{i}", "Tanh", [b.op(f"mm{i}", "MatMul", [h, w])])
    fg = b.build(["w0", "w1"], [h])

    def backward(overlap):
        trace = _peak(fg, allocator=BFC, overlap=overlap)
        return {e: b for b, e in trace.timeline[trace.backward_start:]}

    alone, beside = backward(0), backward(1)
    assert beside["gradient of t0"] == alone["gradient of t0"] + MiB
    assert {e: b for e, b in beside.items() if e != "gradient of t0"} == {
        e: b for e, b in alone.items() if e != "gradient of t0"}


def test_a_weight_gradient_kernel_runs_beside_one_kernel_of_the_next_gradient():
    # c = concat(a, b) (2 MiB), y = Tanh(MatMul(c, w)). The concat's
    # gradient is one Slice per input (1 MiB each): MatMul's weight kernel,
    # still holding c and its incoming gradient (3 MiB), runs beside the
    # first Slice only; after it, the second Slice sees what it would alone.
    b = Builder()
    d = b.external("d")
    w = b.source("w", size_bytes=MiB // 4)
    c = b.op("c", "ConcatV2", [b.op("a", "Tanh", [d]), b.op("b", "Tanh", [d])], size_bytes=2 * MiB)
    fg = b.build(["w"], [b.op("y", "Tanh", [b.op("m", "MatMul", [c, w])])])

    def concat_gradient(overlap):
        trace = _peak(fg, allocator=BFC, overlap=overlap)
        return [b for b, e in trace.timeline if e == "gradient of c"], trace.peak_bytes

    (alone,), alone_peak = concat_gradient(0)
    (first, second), peak = concat_gradient(1)
    assert first == alone - MiB + 3 * MiB
    assert second == alone
    assert peak == max(alone_peak, first)


def _skip(size_bytes):
    """x -> a -> b, c = a + b, y = Tanh(c): a is read by two segments."""
    b = Builder()
    x = b.source("x", size_bytes=size_bytes)
    a = b.op("a", "Tanh", [x], size_bytes=size_bytes)
    t = b.op("b", "Tanh", [a], size_bytes=size_bytes)
    y = b.op("y", "Tanh", [b.op("c", "AddV2", [a, t], size_bytes=size_bytes)], size_bytes=size_bytes)
    return b.build(["x"], [y])


@pytest.mark.parametrize("size_bytes, proxy_bytes", [(MiB, 0), (12 * MiB, 12 * MiB)])
def test_the_gate_of_a_step_whose_gradients_are_constants_is_folded(size_bytes, proxy_bytes):
    # Checkpoints a and b. y's step gates a's proxy; a stays alive (b's step
    # reads it again), so ``a + gate`` is a new buffer, unless y's gradient
    # is the folded constant ones_like(y) (static shape, at most
    # CONSTANT_FOLDING_MAX_BYTES): Grappler then folds the gate to 0 and the
    # proxy to an Identity of a. Alive: x, the seed, a and b, and the proxy.
    trace = _peak(_skip(size_bytes), ["a:0", "b:0"], allocator=BFC)
    alive = next(b for b, e in trace.timeline if e == "proxy of a:0")
    assert alive == 4 * size_bytes + proxy_bytes


@pytest.mark.parametrize("size_bytes", [MiB, 16 * MiB])
def test_a_gradient_of_constants_too_large_to_fold_is_made_when_the_step_starts(size_bytes):
    # The gradient of a mean reads no forward value: from the folded seed,
    # it is computed from constants only. Up to CONSTANT_FOLDING_MAX_BYTES
    # Grappler folds it (resident from before the step); a larger one is a
    # Tile the executor runs as soon as the step starts, alive beside the
    # forward pass (measured: a mean over a [64, 1024, 128] sequence).
    b = Builder()
    x = b.source("x", size_bytes=size_bytes)
    a = b.op("a", "Tanh", [x], size_bytes=size_bytes)
    t = b.op("t", "Tanh", [a], size_bytes=size_bytes)
    y = b.op("y", "Mean", [t], size_bytes=4)
    trace = _peak(b.build(["x"], [y]), allocator=BFC)
    first_bytes, first_event = trace.timeline[0]
    assert first_event == "run a"
    seed = 256
    # x, a, and the mean's gradient (resident when folded, made early when not).
    assert first_bytes == 3 * size_bytes + seed
    assert (trace.resident_bytes == 2 * size_bytes + seed) == (size_bytes == MiB)


def test_a_gathered_variables_dense_gradient_is_a_buffer_of_its_own(graph):
    """In a loop, ``tf.gather(w, i)``'s gradient for ``w`` is the incoming
    gradient (1 MiB) as IndexedSlices; summed into ``w``'s dense gradient it
    makes a buffer of ``w``'s size (6 MiB). In-place writes into a view of a
    larger buffer (a row slice) must not take it for one: forecast_unseen's
    ``while_matmuls`` (the same loop) was forecast 31 MiB in total against
    38-45 measured when they did, 37 otherwise."""
    import numpy as np
    import tensorflow as tf

    import memsave

    rng = np.random.default_rng(0)
    w = tf.Variable((rng.normal(size=(6, 512, 512)) / 23).astype(np.float32))
    x = tf.constant(rng.normal(size=(512, 512)).astype(np.float32))

    def body(i, h):
        return i + 1, tf.nn.relu(tf.matmul(h, tf.gather(w, i)))

    _, h = tf.while_loop(lambda i, h: i < 6, body, [tf.constant(0), x])
    plan = memsave.plan(tf.reduce_mean(tf.square(h)), [w], checkpoints=[])
    assert plan.baseline_peak_bytes - plan.resident_bytes == 27 * MiB, plan.summary()
