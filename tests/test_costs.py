"""The cost model: what TensorFlow's gradients read, bytes, FLOPs, assumptions."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from memsave import _tf_private
from memsave.costs import estimate_costs, is_activation
from memsave.extract import extract
from memsave.schedule import build_schedule


def _graph_op(build):
    g = tf.Graph()
    with g.as_default():
        return build()


def _use(build):
    t = _graph_op(build)
    return _tf_private.learn_gradient_use(t.op)


def _ph(shape):
    return tf.compat.v1.placeholder(tf.float32, shape)


@pytest.mark.parametrize(
    "name, build, reads_inputs, reads_outputs",
    [
        ("Tanh", lambda: tf.tanh(_ph([4, 8])), (), (0,)),
        ("Relu", lambda: tf.nn.relu(_ph([4, 8])), (), (0,)),
        ("Sigmoid", lambda: tf.sigmoid(_ph([4, 8])), (), (0,)),
        ("MatMul", lambda: tf.matmul(_ph([4, 8]), _ph([8, 3])), (0, 1), ()),
        ("AddV2", lambda: _ph([4, 8]) + _ph([4, 8]), (), ()),
        ("Mul", lambda: _ph([4, 8]) * _ph([4, 8]), (0, 1), ()),
        # Square's 2 * x runs early: it is what waits (see the early test below)
        ("Square", lambda: tf.square(_ph([4, 8])), (), ()),
        ("Conv2D", lambda: tf.nn.conv2d(_ph([2, 8, 8, 3]), _ph([3, 3, 3, 4]), 1, "SAME"), (0, 1), ()),
        ("BiasAdd", lambda: tf.nn.bias_add(_ph([4, 8]), _ph([8])), (), ()),
        ("Reshape", lambda: tf.reshape(_ph([4, 8]), [32]), (), ()),
    ],
)
def test_learned_gradient_reads(name, build, reads_inputs, reads_outputs):
    use = _use(build)
    assert use is not None, name
    assert use["reads_inputs"] == reads_inputs, name
    assert use["reads_outputs"] == reads_outputs, name
    assert use["has_gradient"]


def test_add_gradient_passes_the_incoming_buffer_through():
    assert _use(lambda: _ph([4, 8]) + _ph([4, 8]))["aliases"] == (0, 0)
    # With broadcasting the gradient is reduced: a new buffer.
    assert _use(lambda: _ph([4, 8]) + _ph([8]))["aliases"][1] is None
    assert _use(lambda: tf.nn.bias_add(_ph([4, 8]), _ph([8])))["aliases"] == (0, None)


def test_stop_gradient_has_no_gradient():
    assert _use(lambda: tf.stop_gradient(_ph([4])))["has_gradient"] is False


def test_a_call_is_read_through_its_body():
    g = tf.Graph()
    with g.as_default():
        w = tf.compat.v1.placeholder(tf.float32, [256, 1024])

        @tf.function
        def f(a):
            return tf.tanh(tf.sin(a))

        y = f(w)  # a PartitionedCall: its gradient reads the function's insides
        ex = extract([y], [w])
    assert [op.type for op in ex.fg.ops] in (["StatefulPartitionedCall"], ["PartitionedCall"])
    op = ex.fg.ops[0]
    # Sin's gradient reads a (the call's input), Tanh's its output (the
    # call's output): nothing else is kept for the gradient.
    assert op.body is not None and op.body.trips == 1
    assert op.gradient.reads_inputs == (0,) and op.gradient.reads_outputs == (0,)
    assert op.body.saved == ()
    costs = estimate_costs(ex.fg)
    assert not any("not learned" in a for a in costs.assumptions)


@pytest.mark.parametrize("w_shape, scratch", [
    ([16, 24], (8 * 16 * 24 * 4,)),  # broadcast over x's batch of 8: summed after the product
    ([8, 16, 24], ()),  # the same batch: each example's gradient is its own
])
def test_a_broadcast_matmul_gradient_holds_the_per_example_products(w_shape, scratch):
    """TensorFlow's BatchMatMulV2 gradient computes a broadcast operand's
    gradient for every batch element before summing it ([8, 16, 24] here):
    the forecast left it out (4 such layers, [512, 64, 256]: 193 MiB
    forecast, 386-449 MiB measured)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 32, 16])
        w = tf.compat.v1.placeholder(tf.float32, w_shape)
        y = tf.reduce_sum(tf.tanh(x @ w))
        ex = extract([y], [x, w])
    costs = estimate_costs(ex.fg)
    (i,) = [op.index for op in ex.fg.ops if op.type.startswith("BatchMatMul")]
    assert costs.gradient_scratch[i] == scratch


def test_a_custom_gradient_reads_its_captured_arguments_and_gives_the_results_nothing():
    g = tf.Graph()
    with g.as_default():
        w = tf.compat.v1.placeholder(tf.float32, [4, 4])

        @tf.custom_gradient
        def f(a):
            s = tf.sigmoid(a)
            return a * s, lambda dy: dy * a  # reads its argument only

        y = f(2.0 * w)  # IdentityN over (result, argument); the argument is internal
        ex = extract([y], [w])
    op = next(o for o in ex.fg.ops if o.type == "IdentityN")
    assert op.gradient.gives == (1,) and op.gradient.reads_inputs == (1,)
    assert op.gradient.captured and op.gradient.reads_outputs == ()
    costs = estimate_costs(ex.fg)
    assert not any("not learned" in a for a in costs.assumptions)
    # Its function reads the argument it captured, not a recomputed copy's:
    # a schedule keeps it.
    arg = op.inputs[1]
    assert ex.fg.tensors[arg].kind == "internal"
    assert arg in build_schedule(ex.fg, ()).kept


def test_unlearnable_gradient_is_assumed_to_read_everything_and_says_so():
    g = tf.Graph()
    with g.as_default():
        w = tf.compat.v1.placeholder(tf.float32, [4, 4])

        @tf.RegisterGradient("MemsaveTestOverride")
        def _override(op, *grads):
            return [g * op.inputs[0] for g in grads]

        with g.gradient_override_map({"IdentityN": "MemsaveTestOverride"}):
            y = tf.identity_n([tf.identity(w)])[0]  # a Python gradient of unknown shape
        ex = extract([y], [w])
    op = next(o for o in ex.fg.ops if o.type == "IdentityN")
    assert op.gradient is None
    costs = estimate_costs(ex.fg)
    assert costs.gradient[op.index].reads_inputs == tuple(range(len(op.inputs)))
    assert any("not learned" in a and "IdentityN" in a for a in costs.assumptions)


def _mlp_graph(batch):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 8])
        w = tf.compat.v1.Variable(tf.zeros([8, 16]))
        y = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
        ex = extract([y], _tf_private.convert_xs([w]))
    return ex


def test_bytes_flops_and_resident():
    ex = _mlp_graph(4)
    fg = ex.fg
    costs = estimate_costs(fg)
    by_type = {op.type: op for op in fg.ops}
    mm = by_type["MatMul"]
    assert costs.tensor_bytes[mm.outputs[0]] == 4 * 16 * 4
    # TensorFlow's registered statistics: 2 * m * k * n for MatMul.
    assert costs.op_flops[mm.index] == 2 * 4 * 8 * 16
    # Element count where TensorFlow registers nothing (Tanh).
    assert costs.op_flops[by_type["Tanh"].index] == 4 * 16
    # The variable (behind the handle), the input and reduce_sum's axes
    # (a constant, int32[2]) are resident.
    assert costs.resident_bytes == 8 * 16 * 4 + 4 * 8 * 4 + 2 * 4
    assert costs.assumptions == ()
    assert is_activation(fg, by_type["Tanh"].outputs[0])
    assert not is_activation(fg, by_type["ReadVariableOp"].outputs[0])  # stateful read


def test_unknown_batch_is_an_assumption_or_the_hint():
    fg = _mlp_graph(None).fg
    guessed = estimate_costs(fg)
    assert any("unknown dimensions" in a and "batch_size=" in a for a in guessed.assumptions)
    hinted = estimate_costs(fg, batch_size=32)
    assert any("batch_size=32" in a for a in hinted.assumptions)
    tanh = next(op for op in fg.ops if op.type == "Tanh")
    assert guessed.tensor_bytes[tanh.outputs[0]] == 16 * 4
    assert hinted.tensor_bytes[tanh.outputs[0]] == 32 * 16 * 4
    with pytest.raises(ValueError, match="batch_size"):
        estimate_costs(fg, batch_size=0)


def test_an_unknown_batch_takes_the_hint_in_flops_too():
    """A matrix product or convolution with an unknown batch has no
    registered FLOP count (TensorFlow's needs static shapes): its count per
    example times the hint, as for the bytes, not the elements it produces
    (a Keras step traced for a partial last batch was costed 46 times too
    cheap). A product whose other dimension is unknown stays elements."""
    def conv_graph(batch):
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [batch, 8, 8, 3])
            w = tf.compat.v1.Variable(np.ones([3, 3, 3, 4], np.float32))
            v = tf.compat.v1.Variable(np.ones([4, 5], np.float32))
            h = tf.tanh(tf.nn.conv2d(x, w, 1, "SAME"))
            loss = tf.reduce_sum(tf.reduce_sum(tf.matmul(tf.reduce_mean(h, [1, 2]), v), 1))
            return extract([loss], _tf_private.convert_xs([w, v])).fg

    def flops(fg, batch_size):
        costs = estimate_costs(fg, batch_size=batch_size)
        return {op.type: costs.op_flops[op.index] for op in fg.ops
                if op.type in ("Conv2D", "MatMul") or op.name == "Sum_1"}

    static = flops(conv_graph(32), None)
    # The last sum adds 32 numbers: 31 additions (not linear in the batch).
    assert static == {"Conv2D": 2 * 32 * 8 * 8 * 4 * 3 * 3 * 3, "MatMul": 2 * 32 * 4 * 5,
                      "Sum": 31}
    assert flops(conv_graph(None), 32) == static
    assert flops(conv_graph(None), None) == {"Conv2D": static["Conv2D"] // 32,
                                             "MatMul": static["MatMul"] // 32, "Sum": 0}
    g = tf.Graph()
    with g.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [4, None])
        w = tf.compat.v1.Variable(np.ones([4, 4], np.float32))
        fg = extract([tf.reduce_sum(tf.matmul(w, a))], _tf_private.convert_xs([w])).fg
    mm = next(op for op in fg.ops if op.type == "MatMul")
    assert mm.flops is None and mm.flops_linear is None


def test_gradient_of_an_input_that_needs_none_is_pruned():
    # h * mask with mask from outside: TensorFlow prunes mask's gradient
    # (which reads h), so only mask is kept for h's gradient.
    g = tf.Graph()
    with g.as_default():
        w = tf.compat.v1.placeholder(tf.float32, [4, 4])
        mask = tf.constant(np.ones((4, 4), np.float32))
        y = tf.tanh(w) * mask
        ex = extract([y], [w])
    costs = estimate_costs(ex.fg)
    mul = next(o for o in ex.fg.ops if o.type == "Mul")
    assert mul.gradient.reads_inputs == (0, 1)
    assert costs.gradient[mul.index].reads_inputs == (1,)


def _while_body(limit_kw, cond):
    g = tf.Graph()
    with g.as_default():
        w = tf.compat.v1.placeholder(tf.float32, [64, 64])
        h0 = tf.tanh(w)

        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, w))

        _, h = tf.while_loop(cond, body, [tf.constant(0), h0], **limit_kw)
        ex = extract([h], [w])
    return next(o for o in ex.fg.ops if o.type in ("While", "StatelessWhile"))


def test_while_loop_trips_and_what_its_gradient_accumulates():
    op = _while_body(dict(maximum_iterations=5), lambda i, h: i < 100)
    body = op.body
    assert body.loop and (body.trips, body.trips_known) == (5, True)
    # MatMul's gradient reads h (a loop variable) and w (loop invariant,
    # captured: not accumulated); Tanh's its output, the next trip's h.
    # One buffer per trip.
    assert [body.fg.tensors[t].dtype for t in body.saved] == ["float32"]
    assert len(body.invariant) >= 1


def test_while_loop_trips_from_its_counter():
    assert _while_body({}, lambda i, h: i < 7).body.trips == 7
    assert _while_body({}, lambda i, h: i <= 7).body.trips == 8
    body = _while_body({}, lambda i, h: tf.reduce_sum(h) < 3.0).body
    assert body.trips_known is False


def test_gradient_values_computed_from_forward_values_alone_are_early():
    # Erfc's gradient is grad * c * exp(-square(x)): square(x) does not wait
    # for grad (its control edge does not hold it back), so it runs in the
    # forward pass and is what waits for the gradient, not x.
    use = _use(lambda: tf.math.erfc(_ph([256, 1024])))
    assert use["early_bytes"] == (256 * 1024 * 4,)
    assert use["reads_inputs"] == () and use["reads_outputs"] == ()
    # Tanh's gradient reads its output with the incoming gradient: nothing early.
    assert _use(lambda: tf.tanh(_ph([256, 1024])))["early_bytes"] == ()


def test_a_broadcast_products_per_example_gradients_outlive_it_by_one_gradient(graph):
    """The per-example products are summed by a kernel of their own, beside
    the next gradient ops: with four layers, two layers' products are alive
    together (measured at [512, 64, 256]: 417-449 MiB against 417 forecast;
    193 when they were left out, 321 when counted one at a time)."""
    import memsave

    rs = np.random.RandomState(0)
    x = tf.constant(rs.randn(64, 8, 128).astype("float32"))
    ws = [tf.Variable(rs.randn(128, 128).astype("float32") / 12) for _ in range(4)]
    h = x
    for w in ws:
        h = tf.tanh(h @ w)
    plan = memsave.plan(tf.reduce_sum(h * h), ws)
    product = 64 * 128 * 128 * 4  # 4 MiB each; every activation is 256 KiB
    working = plan.baseline_peak_bytes - plan.resident_bytes
    assert 2 * product <= working < 3 * product, (working, product)


@pytest.mark.parametrize("name, build, views", [
    # TensorFlow returns these as parts of the input's buffer (a [64, 1024,
    # 128] float32 input: 512 KiB rows): measured, each held all 32 MiB.
    ("last row", lambda a: a[-1], 0),
    ("row range", lambda a: a[2:5], 0),
    ("slice", lambda a: tf.slice(a, [2, 0, 0], [3, -1, -1]), 0),
    ("split along 0", lambda a: tf.split(a, 4, axis=0)[0], 1),
    ("split_v along 0", lambda a: tf.split(a, [16, 48], axis=0)[0], 0),
    ("unstack along 0", lambda a: tf.unstack(a, axis=0)[3], 0),
    # ... and copies (measured: only the result's bytes held)
    ("every other row", lambda a: a[::2], None),
    ("a column", lambda a: a[:, 3], None),
    ("split along 1", lambda a: tf.split(a, 4, axis=1)[0], None),
    ("gather", lambda a: tf.gather(a, 3), None),
])
def test_row_slices_are_views_of_their_input(name, build, views):
    from memsave.extract import views_rows

    out = _graph_op(lambda: build(_ph([64, 1024, 128])))
    assert views_rows(out.op) == views, name


def test_a_row_slice_of_unaligned_rows_is_a_copy():
    # A row of 1023 x 129 floats is not a multiple of 64 bytes: the kernels
    # copy (measured: 0.5 MiB held, not the input's 32 MiB).
    from memsave.extract import views_rows

    assert views_rows(_graph_op(lambda: _ph([64, 1023, 129])[-1]).op) is None
    assert views_rows(_graph_op(lambda: _ph([64, 1024, 128])[-1]).op) == 0


def test_an_elementwise_op_on_a_row_view_holds_the_whole_input(graph):
    """``tanh(h[-1])``: TensorFlow writes the tanh in place into the view,
    and its gradient in place into that, so the whole sequence ``h`` is
    alive until the slice's own (dense) gradient is made. Measured on this
    graph: 16.0 MiB above resident in some processes, 8.5 in others (the
    executor's choice of which input to write into): the forecast counts
    the larger. On a loss on a TensorArray's last stacked item (T=64, batch
    1024, 128 units, per-step loop gradient) 95.5 was measured every time,
    forecast 64.5 when the slice was a copy (test_loops has it)."""
    import memsave

    rs = np.random.RandomState(0)
    x = tf.constant(rs.randn(16 * 1024, 128).astype("float32"))
    w = tf.Variable(rs.randn(128, 128).astype("float32") / 12)
    h = tf.reshape(x @ w, [16, 1024, 128])  # 8 MiB; its gradient reads no output
    w_out = tf.Variable(rs.randn(128, 4).astype("float32") / 12)
    loss = tf.reduce_mean(tf.square(tf.tanh(h[-1]) @ w_out))
    plan = memsave.plan(loss, [w, w_out], checkpoints=[])
    sequence = 16 * 1024 * 128 * 4
    # the sequence, beside the slice's dense gradient of its size
    working = plan.baseline_peak_bytes - plan.resident_bytes
    assert 2 * sequence <= working < 3 * sequence, plan.summary()


def test_a_gradient_that_ends_in_a_product_with_an_output_says_so():
    # Softmax's gradient is (g - sum(g * y)) * y: its last factor is the
    # output itself. Erfc's ends in exp(-x^2), computed from x: not an own value.
    y = _graph_op(lambda: tf.nn.softmax(_ph([4, 8])))
    assert _tf_private.learn_gradient_use(y.op)["products"] == (((), (0,), 4 * 8 * 4),)
    e = _graph_op(lambda: tf.math.erfc(_ph([4, 8])))
    assert _tf_private.learn_gradient_use(e.op)["products"] == (None,)


@pytest.mark.parametrize("scale", ["constant", "variable"])
def test_a_constant_scale_before_a_softmax_is_pushed_into_the_forward_pass(graph, scale):
    """Keras' MultiHeadAttention scales the scores by a constant before the
    softmax: Grappler rewrites the gradient ``((g - s) * y) * c`` as ``(y *
    c) * (g - s)`` and runs ``y * c`` right after the softmax, a buffer of
    the scores' size alive until the gradient (measured, a two-layer
    encoder's step: 76-77 MiB above resident, forecast 62.2 MiB without it,
    78.2 with it). A variable scale is not a constant: nothing is pushed."""
    rs = np.random.RandomState(0)
    q = tf.Variable(rs.randn(8, 64, 32).astype("float32"))
    c = tf.constant(0.17, tf.float32) if scale == "constant" else tf.Variable(0.17)
    scores = tf.einsum("bqd,bkd->bqk", q, q) * c
    loss = tf.reduce_sum(tf.square(tf.nn.softmax(scores)))
    xs = _tf_private.convert_xs([q])
    fg = extract([loss], xs).fg
    costs = estimate_costs(fg)  # early gradient values off, the default
    (softmax,) = [op for op in fg.ops if op.type == "Softmax"]
    expected = (8 * 64 * 64 * 4,) if scale == "constant" else ()
    assert costs.gradient[softmax.index].early_bytes == expected


@pytest.mark.parametrize("equation, forward", [
    # measured (allocator records, TF 2.21 oneDNN): what the forward kernel
    # allocates besides its output
    ("tbd,de->tbe", ()),  # a dense layer on every step: nothing
    ("abc,cde->abde", ()),  # Keras EinsumDense's projection: nothing
    ("bij,bjk->bik", ()),
    ("bji,bjk->bik", ()),  # contract before free: the adjoint flag, no copy
    ("aecd,abcd->acbe", (("i", 0), ("i", 1), ("o", 0))),  # 1 + 1 + 4 MiB
    ("abcd,aecd->acbe", (("i", 0), ("i", 1))),  # 1 + 1 MiB
    ("acbe,aecd->abcd", (("i", 1), ("o", 0))),  # 1 + 1 MiB
    ("ijb,bjk->bik", (("i", 0),)),  # 2 MiB
    ("tbd,de->bte", (("o", 0),)),  # 8 MiB
])
def test_einsum_temporaries_are_read_from_the_equation(equation, forward):
    from memsave.costs import einsum_temporaries

    assert einsum_temporaries(equation) == forward


def test_einsum_temporaries_of_an_equation_not_read_are_unknown():
    from memsave.costs import einsum_temporaries

    for equation in ("...ij,jk->...ik", "abc->ab", "aab,bc->ac", "ab,bc,cd->ad"):
        assert einsum_temporaries(equation) is None, equation


def test_a_dense_layer_as_einsum_holds_no_copy_of_its_input(graph):
    # tbd,de->tbe on [16, 1024, 128]: the forward kernel reads the operands
    # in place (measured: only the 8 MiB output); each input used to be
    # counted once more while it ran.
    rs = np.random.RandomState(0)
    x = tf.constant(rs.randn(16, 1024, 128).astype("float32"))
    w = tf.Variable(rs.randn(128, 128).astype("float32") / 12)
    loss = tf.reduce_sum(tf.square(tf.einsum("tbd,de->tbe", x, w)))
    fg = extract([loss], _tf_private.convert_xs([w])).fg
    costs = estimate_costs(fg)
    (op,) = [op for op in fg.ops if op.type == "Einsum"]
    assert costs.scratch[op.index] == ()
