"""memsave in the places users call tf.gradients from, and its errors.

Patching, XLA, devices, tf.distribute, the fallback warning, the plan, and
every user error the API documents. tf.compat.v1 optimizers and training
loops across replicas and workers are in test_distribute.py.
"""

import functools
import logging
import sys

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import _tf_private

RNG = np.random.RandomState(0)
W_INIT = [RNG.randn(8, 8).astype(np.float32) * 0.5 for _ in range(6)]
#: A batch of 512: activations (16 KiB) outweigh the 256-byte weights, so the
#: simulator predicts a saving and 'memory' keeps a plan (on a batch of 4 the
#: weights' gradients dominate and it rightly falls back to tf.gradients).
DATA = RNG.randn(512, 8).astype(np.float32)


def chain(h, ws):
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


def assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())


def recompute_ops(graph):
    """Ops memsave copied (they live under a recompute_<k> name scope)."""
    return [op for op in graph.get_operations() if "/recompute_" in op.name]


# -- patching ---------------------------------------------------------------


def test_patch_replaces_every_alias_and_restores_them():
    import tensorflow.python.ops.gradients as ops_gradients

    before = (tf.gradients, tf.compat.v1.gradients, ops_gradients.gradients)
    with memsave.patch(checkpoints="memory") as p:
        assert p.aliases >= 3
        assert tf.gradients is not before[0]
        assert tf.compat.v1.gradients is not before[1]
        assert ops_gradients.gradients is not before[2]
    assert (tf.gradients, tf.compat.v1.gradients, ops_gradients.gradients) == before


def test_patch_call_and_unpatch_pair():
    original = tf.compat.v1.gradients
    memsave.patch(checkpoints="speed")
    try:
        assert tf.compat.v1.gradients is not original
    finally:
        memsave.unpatch()
    assert tf.compat.v1.gradients is original


def test_nested_patches_undo_in_order():
    original = tf.gradients
    with memsave.patch(checkpoints="memory"):
        outer = tf.gradients
        with memsave.patch(checkpoints="speed"):
            assert tf.gradients is not outer
            assert tf.gradients.memsave_checkpoints == "speed"
        assert tf.gradients is outer
    assert tf.gradients is original


def test_nested_patches_keep_each_alias_signature(graph):
    """The inner patch gives the v1 aliases (tf.compat.v1 optimizers call
    gradients_impl.gradients with colocate_gradients_with_ops) its v1
    wrapper: it once gave them the v2 one, and minimize raised TypeError."""
    from tensorflow.python.ops import gradients_impl

    w = tf.compat.v1.Variable(W_INIT[0])
    loss = chain(tf.constant(DATA), [w])
    with memsave.patch(checkpoints="memory"), memsave.patch(checkpoints="speed"):
        assert gradients_impl.gradients.memsave_signature == "v1"
        assert tf.gradients.memsave_signature == "v2"
        tf.compat.v1.gradients(loss, [w], colocate_gradients_with_ops=True)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def test_patch_as_a_decorator_patches_while_the_function_runs():
    original = tf.gradients

    @memsave.patch(checkpoints="speed")
    def inside():
        return tf.gradients.memsave_checkpoints

    assert tf.gradients is original, "decorating left the patch applied"
    assert inside() == "speed" and inside() == "speed"
    assert tf.gradients is original
    with pytest.raises(memsave.MemsaveError, match="decorates a function"):
        memsave.patch()(3)
    assert tf.gradients is original


def test_patch_plans_a_placeholder_of_unknown_batch_for_batch_size(graph, session, caplog):
    # A tf.compat.v1 placeholder [None, 256]: planned for a batch of 1, the
    # weights outweigh every activation and 'memory' gives tf.gradients'
    # own graph (and says why); planned for batch_size=1024, it rewrites.
    x = tf.compat.v1.placeholder(tf.float32, [None, 256])
    ws = [tf.Variable(0.05 * RNG.randn(256, 256).astype(np.float32)) for _ in range(16)]
    loss = chain(x, ws)
    want = tf.gradients(loss, ws)
    with caplog.at_level("WARNING", logger="memsave.api"), memsave.patch(checkpoints="memory"):
        tf.compat.v1.gradients(loss, ws)
    assert not recompute_ops(graph)
    assert "pass batch_size=" in caplog.text
    with memsave.patch(checkpoints="memory", batch_size=1024):
        got = tf.compat.v1.train.GradientDescentOptimizer(0.1).compute_gradients(loss, ws)
    assert recompute_ops(graph)
    session.run(tf.compat.v1.global_variables_initializer())
    feed = {x: RNG.randn(1024, 256).astype(np.float32)}
    assert_close(session.run([g for g, _ in got], feed), session.run(want, feed))


def test_patched_tf_gradients_inside_tf_function():
    ws = [tf.Variable(w) for w in W_INIT]

    @tf.function
    def f():
        loss = chain(tf.constant(DATA), ws)
        want = _tf_private.original_gradients(loss, ws)
        with memsave.patch(checkpoints="memory"):
            got = tf.gradients(loss, ws)
        return got, want, len(recompute_ops(tf.compat.v1.get_default_graph()))

    got, want, copies = f()
    assert int(copies) > 0
    assert_close([g.numpy() for g in got], [w.numpy() for w in want])


# -- XLA, devices, tf.distribute ---------------------------------------------


def test_xla_gradients_match():
    ws = [tf.Variable(w) for w in W_INIT]

    @tf.function(jit_compile=True)
    def f():
        loss = chain(tf.constant(DATA), ws)
        return memsave.gradients(loss, ws, checkpoints="memory"), tf.gradients(loss, ws)

    got, want = f()
    assert_close([g.numpy() for g in got], [w.numpy() for w in want])


def test_copies_keep_the_device_of_their_original():
    g = tf.Graph()
    with g.as_default():
        ws = [tf.compat.v1.Variable(w) for w in W_INIT]
        h = tf.constant(DATA)
        for i, w in enumerate(ws):
            with tf.device(f"/device:CPU:{i % 2}"):
                h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h)
        memsave.gradients(loss, ws, checkpoints="memory")
        originals = {op.name: op for op in g.get_operations()}
        copies = recompute_ops(g)
        checked = set()
        for op in copies:
            # A copy is named <scope>/recompute_<k>/<original name>.
            original_name = op.name.split("/recompute_", 1)[1].split("/", 1)[1]
            original = originals.get(original_name)
            if original is not None and original.type == op.type:
                assert op.device == original.device, op.name
                checked.add(op.device)
        assert {"/device:CPU:0", "/device:CPU:1"} <= checked


def mirrored_replicas() -> dict:
    """memsave.gradients in each replica of MirroredStrategy on two logical CPUs.

    Run in a fresh process (tests/fresh.py): logical devices must be set
    before TensorFlow initialises. The same process also reports whether
    ``import memsave`` left memsave.keras (and Keras) unloaded, and whether
    memsave.keras then loads on first use.
    """
    keras_unloaded = "memsave.keras" not in sys.modules
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    rng = np.random.RandomState(0)
    w_init = [rng.randn(8, 8).astype(np.float32) * 0.5 for _ in range(6)]
    data = tf.constant(rng.randn(4, 8).astype(np.float32))
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        ws = [tf.Variable(w) for w in w_init]

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            h = data * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h * h)
            got = memsave.gradients(loss, ws, checkpoints="memory")
            want = tf.gradients(loss, ws)
            n_ops = memsave.plan(loss, ws, checkpoints="memory").forward_ops
            return got, want, tf.constant(n_ops)
        return strategy.run(replica_fn)

    got, want, n_ops = step()
    local = strategy.experimental_local_results
    return {
        "forward_ops": [int(n) for n in local(n_ops)],
        "max_abs_diff": max(float(np.abs(a.numpy() - b.numpy()).max())
                            for g, w in zip(got, want) for a, b in zip(local(g), local(w))),
        "grad_scale": max(float(np.abs(b.numpy()).max()) for w in want for b in local(w)),
        "replica_grads_differ": bool(
            np.abs(local(want[0])[0].numpy() - local(want[0])[1].numpy()).max() > 0),
        "keras_unloaded_after_import_memsave": keras_unloaded,
        "keras_loads_on_first_use": memsave.keras.__name__ == "memsave.keras",
    }


@pytest.mark.slow
def test_mirrored_strategy_each_replica_touches_its_own_ops(fresh):
    result = fresh.call(mirrored_replicas, timeout_s=300)
    # 6 layers of (read, matmul, tanh), then mul and sum: each replica's own ops only.
    assert result["forward_ops"] == [20, 20]
    assert result["replica_grads_differ"]
    assert result["max_abs_diff"] <= 1e-5 * result["grad_scale"]


@pytest.mark.slow
def test_import_memsave_leaves_keras_support_unloaded_until_used(fresh):
    # In the fresh process of the test above: no test has imported Keras there.
    result = fresh.call(mirrored_replicas, timeout_s=300)
    assert result["keras_unloaded_after_import_memsave"]
    assert result["keras_loads_on_first_use"]


# -- fallback, plan, linear size ---------------------------------------------


def test_empty_collection_warns_and_returns_exact_gradients(caplog):
    g = tf.Graph()
    with g.as_default():
        ws = [tf.compat.v1.Variable(w) for w in W_INIT]
        loss = chain(tf.constant(DATA), ws)
        with caplog.at_level(logging.WARNING, logger="memsave"):
            got = memsave.gradients(loss, ws)  # empty 'checkpoints' collection
        want = tf.gradients(loss, ws)
        assert not recompute_ops(g)
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([got, want])
    assert "add_to_collection" in caplog.text
    assert_close(got, want)


@pytest.mark.parametrize("checkpoints", ["memory", "list"])
def test_a_plan_that_saves_nothing_says_what_to_change(caplog, checkpoints):
    """A kept plan forecast to save nothing (a tiny chain: every buffer is
    under what the CPU allocator counts) warns; the advice fits the
    strategy: a list is told to try 'memory', 'memory' is not."""
    g = tf.Graph()
    with g.as_default():
        ws = [tf.compat.v1.Variable(w) for w in W_INIT]
        h = tf.tanh(tf.constant(DATA[:4]) @ ws[0])
        mid = tf.tanh(h @ ws[1])
        loss = tf.reduce_sum(tf.tanh(mid @ ws[2]) ** 2)
        kwargs = ({"checkpoints": [mid]} if checkpoints == "list" else
                  {"checkpoints": "memory", "strategy_options": {"min_saving_fraction": 0.0}})
        with caplog.at_level(logging.WARNING, logger="memsave"):
            memsave.gradients(loss, ws[:3], **kwargs)
        assert recompute_ops(g), "the rewrite did not run"
    assert "not expected to save memory" in caplog.text
    assert ("try checkpoints='memory'" in caplog.text) == (checkpoints == "list"), caplog.text


def test_plan_lists_checkpoints_and_reasons():
    g = tf.Graph()
    with g.as_default():
        ws = [tf.compat.v1.Variable(tf.zeros([8, 8])) for _ in range(16)]
        # A batch of 512: activations (16 KiB each) outweigh the weights'
        # gradients, alive to the end. Every byte counted (BFC): on the CPU
        # allocator these buffers are all under its 256 KiB reporting floor.
        loss = chain(tf.zeros([512, 8]), ws)
        p = memsave.plan(loss, ws, checkpoints="memory", allocator=memsave.simulate.BFC)
    assert 2 <= len(p.checkpoints) <= 8
    assert set(p.reasons) == {"articulation point"}
    assert p.checkpoint_bytes < p.activation_bytes
    assert 0 < p.predicted_peak_bytes < p.baseline_peak_bytes / 2
    assert p.checkpoints[0] in p.summary()


@pytest.mark.parametrize("strategy", ["memory", "speed"])
def test_rewrite_size_is_linear_in_depth(strategy):
    def ops_added(n):
        g = tf.Graph()
        with g.as_default():
            ws = [tf.compat.v1.Variable(tf.zeros([8, 8])) for _ in range(n)]
            loss = chain(tf.zeros([4, 8]), ws)
            before = len(g.get_operations())
            memsave.gradients(loss, ws, checkpoints=strategy)
            return len(g.get_operations()) - before

    small, large = ops_added(100), ops_added(200)
    assert 1.8 < large / small < 2.2


def test_each_steps_gradient_call_walks_its_own_ops_only(monkeypatch):
    # A recompute step differentiates its copies with respect to forward
    # tensors (the weights) read as they are, whose other readers lead on
    # through the whole graph: tf.gradients' walk forward from its xs is
    # bounded to the step's own ops (_tf_private.forward_walk_after), or
    # the build would be quadratic in depth. Recorded per stock call: the
    # ops its walk reached.
    reached_sizes = []
    real = _tf_private._MARK_REACHED._replacement

    def recording(from_ops, reached_ops, func_graphs):
        bounded = "bound" in _tf_private._walk.__dict__
        real(from_ops, reached_ops, func_graphs)
        reached_sizes.append((bounded, len(reached_ops)))

    monkeypatch.setattr(_tf_private._MARK_REACHED, "_replacement", recording)
    g = tf.Graph()
    with g.as_default():
        ws = [tf.compat.v1.Variable(tf.zeros([8, 8])) for _ in range(200)]
        h, kept = tf.zeros([4, 8]), []
        for i, w in enumerate(ws):
            h = tf.tanh(tf.matmul(h, w))
            if i % 14 == 13:
                kept.append(h)
        loss = tf.reduce_sum(h * h)
        forward = len(g.get_operations())
        p = memsave.plan(loss, ws, checkpoints=kept)
        memsave.gradients(loss, ws, checkpoints=p)
    steps = [s for s in p.schedule.steps if s.kind == "recompute"]
    bounded = [n for b, n in reached_sizes if b]
    assert len(bounded) == len(steps) > 5
    # Each walk: the step's boundary, copies and their readers in the step.
    for n, step in zip(bounded, steps):
        assert n <= 2 * (len(step.ops) + len(step.boundary)), (n, step)
    assert sum(bounded) < forward


def test_a_gradient_that_calls_tf_gradients_inside_a_recomputed_segment():
    # The bound applies to the step's own call only: a gradient function
    # that calls tf.gradients on forward tensors (in the same graph) walks
    # the whole graph, as it must to find its ops.
    @tf.custom_gradient
    def odd_tanh(x):
        y = tf.tanh(x)

        def grad(dy):
            return tf.gradients(y, x, grad_ys=3.0 * dy)[0]

        return tf.identity(y), grad

    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        ws = [tf.compat.v1.Variable(rs.randn(8, 8).astype(np.float32) * 0.4) for _ in range(12)]
        h = tf.constant(rs.randn(4, 8).astype(np.float32))
        for i, w in enumerate(ws):
            h = tf.matmul(h, w)
            h = odd_tanh(h) if i % 3 == 1 else tf.tanh(h)
        loss = tf.reduce_sum(h * h)
        ckpt = memsave.plan(loss, ws, checkpoints="memory")
        got = memsave.gradients(loss, ws, checkpoints=ckpt)
        want = tf.gradients(loss, ws)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([got, want])
    assert ckpt.recomputed_ops > 0
    assert_close(got, want)


def _batch_norm_net(override=None):
    """Conv -> FusedBatchNormV3 -> ReLU, four times; ``override``: the batch
    norms' gradient replaced (gradient_override_map) by that registered name."""
    rs = np.random.RandomState(0)
    x = tf.constant(rs.randn(4, 8, 8, 3).astype(np.float32))
    ws = [tf.compat.v1.Variable(rs.randn(3, 3, 3 if i == 0 else 8, 8).astype(np.float32) * 0.3)
          for i in range(4)]
    scales = [tf.compat.v1.Variable(np.ones(8, np.float32)) for _ in range(4)]
    h, relus = x, []
    for w, s in zip(ws, scales):
        h = tf.nn.conv2d(h, w, 1, "SAME")
        if override:
            with tf.compat.v1.get_default_graph().gradient_override_map(
                    {"FusedBatchNormV3": override}):
                h = tf.compat.v1.nn.fused_batch_norm(h, s, tf.zeros(8), is_training=True)[0]
        else:
            h = tf.compat.v1.nn.fused_batch_norm(h, s, tf.zeros(8), is_training=True)[0]
        h = tf.nn.relu(h)
        relus.append(h)
    return tf.reduce_sum(h * h), ws + scales, relus[1]


def _zeros_of_batch_norms(graph, start):
    return [op for op in graph.get_operations()[start:] if op.type == "ZerosLike"
            and op.inputs[0].op.type == "FusedBatchNormV3"]


def test_the_rewrite_builds_no_zero_gradient_a_batch_norm_ignores(graph, session):
    """tf.gradients builds a ZerosLike for each of a batch norm's five other
    outputs; its gradient reads grad[0] only, so the rewrite leaves them
    out: same gradients, fewer ops to build."""
    loss, xs, mid = _batch_norm_net()
    start = len(graph.get_operations())
    ref = tf.gradients(loss, xs)
    assert len(_zeros_of_batch_norms(graph, start)) == 4 * 5
    start = len(graph.get_operations())
    ours = memsave.gradients(loss, xs, checkpoints=[mid])
    assert recompute_ops(graph), "the rewrite did not run"
    assert _zeros_of_batch_norms(graph, start) == []
    session.run(tf.compat.v1.global_variables_initializer())
    assert_close(*session.run([ours, ref]))
    # Only within memsave's own calls: tf.gradients is stock again afterwards.
    start = len(graph.get_operations())
    tf.gradients(loss, xs)
    assert len(_zeros_of_batch_norms(graph, start)) == 4 * 5


_OVERRIDE_SAW = []


@tf.RegisterGradient("MemsaveTestBatchNormReadsEveryGradient")
def _batch_norm_gradient_reading_every_output(op, *grads):
    _OVERRIDE_SAW.append(all(g is not None for g in grads))
    dx, dscale, doffset = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=grads[0], x=op.inputs[0], scale=op.inputs[1],
        reserve_space_1=op.outputs[3], reserve_space_2=op.outputs[4],
        reserve_space_3=op.outputs[5], epsilon=op.get_attr("epsilon"))[:3]
    return dx, dscale, doffset, None, None


def test_a_batch_norm_with_another_gradient_gets_every_zero_gradient(graph):
    """A gradient_override_map'd batch norm may read its other outputs'
    gradients: the rewrite passes them zeros, as tf.gradients does."""
    loss, xs, mid = _batch_norm_net("MemsaveTestBatchNormReadsEveryGradient")
    _OVERRIDE_SAW.clear()
    memsave.gradients(loss, xs, checkpoints=[mid])
    assert recompute_ops(graph), "the rewrite did not run"
    assert _OVERRIDE_SAW and all(_OVERRIDE_SAW)


def _normalisation_net(version, data_format, dtype, factor, *, read_mean=False):
    """Conv -> FusedBatchNorm ``version`` -> ReLU, four times, in ``dtype``
    with the batch norms computing in float32; ``factor``: their
    exponential_avg_factor (1: no running statistics); ``read_mean``: the
    loss reads the first batch norm's batch mean too."""
    rs = np.random.RandomState(1)
    shape = [4, 8, 8, 6] if data_format == "NHWC" else [4, 6, 8, 8]
    h = tf.constant(rs.randn(*shape).astype(np.float32))
    xs, extra = [], 0.0
    for i in range(4):
        w = tf.compat.v1.Variable(rs.randn(3, 3, 6, 6).astype(np.float32) * 0.3)
        scale = tf.compat.v1.Variable(np.linspace(0.5, 1.5, 6).astype(np.float32))
        offset = tf.compat.v1.Variable(np.linspace(-0.2, 0.2, 6).astype(np.float32))
        xs += [w, scale, offset]
        c = tf.nn.conv2d(tf.cast(h, dtype), tf.cast(w, dtype), 1, "SAME", data_format=data_format)
        running = factor != 1.0
        kw = {} if version == "FusedBatchNorm" else {"exponential_avg_factor": factor}
        out = getattr(tf.raw_ops, version)(
            x=c, scale=scale, offset=offset, mean=tf.zeros([6 if running else 0]),
            variance=tf.ones([6 if running else 0]), epsilon=1e-3, data_format=data_format,
            is_training=True, **kw)
        if read_mean and i == 0:
            extra = tf.reduce_sum(out[1])
        h = tf.nn.relu(tf.cast(out[0], tf.float32))
    return tf.reduce_sum(h * h) + extra, xs


def _inference_copies(graph):
    return [op for op in recompute_ops(graph) if op.type.startswith("FusedBatchNorm")
            and "Grad" not in op.type and not op.get_attr("is_training")]


@pytest.mark.parametrize("version,data_format,dtype,factor", [
    ("FusedBatchNorm", "NHWC", tf.float32, 1.0),
    ("FusedBatchNormV2", "NCHW", tf.float32, 1.0),
    ("FusedBatchNormV3", "NHWC", tf.float32, 1.0),
    ("FusedBatchNormV3", "NCHW", tf.float32, 0.9),
    ("FusedBatchNormV3", "NHWC", tf.float16, 0.9),
])
def test_a_recomputed_batch_norm_normalises_with_the_forward_statistics(
        graph, session, version, data_format, dtype, factor):
    """On the CPU a training batch norm's copy runs in inference mode on the
    forward pass's batch mean and variance (its reserve spaces), one pass
    instead of a reduction and a pass; its gradient is still the training
    one (through the statistics), so the gradients are tf.gradients'."""
    loss, xs = _normalisation_net(version, data_format, dtype, factor)
    ref = tf.gradients(loss, xs)
    start = len(graph.get_operations())
    ours = memsave.gradients(loss, xs, checkpoints="memory")
    copies = _inference_copies(graph)
    assert copies, "no batch norm was recomputed from its statistics"
    assert all(op.type == version for op in copies)
    # The forward op's third reserve space is oneDNN's ReLU workspace where
    # it fuses the batch norm with its ReLU: nothing memsave builds reads
    # that of a recomputed one, or the workspace would be held to the
    # backward pass.
    forward = {op.inputs[3].op for op in copies}
    assert all(op in graph.get_operations()[:start] for op in forward)
    assert not [op for op in graph.get_operations()[start:] for t in op.inputs
                if t.op in forward and t.value_index == 5]
    session.run(tf.compat.v1.global_variables_initializer())
    assert_close(*session.run([ours, ref]))
    if dtype != tf.float32:
        return  # (float16's second derivative differs from tf.gradients' by rounding, 0.14%
        #         here, whether the copies reuse the statistics or not)
    # And the second derivative through them (a gradient penalty).
    penalty = [tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]) for grads in (ours, ref)]
    second = [tf.gradients(p, xs[:3]) for p in penalty]
    assert_close(*session.run(second))


def test_a_batch_norm_whose_statistics_the_graph_reads_is_copied_whole(graph, session):
    """A batch norm whose batch mean the loss reads, or that a GPU runs (its
    reserve spaces hold another statistic there), is copied as it is."""
    loss, xs = _normalisation_net("FusedBatchNormV3", "NHWC", tf.float32, 1.0, read_mean=True)
    fg = memsave.plan(loss, xs, checkpoints="memory").problem.fg
    reusing = [op.name for op in fg.ops if op.reuses_statistics]
    batch_norms = [op.name for op in fg.ops if op.type == "FusedBatchNormV3"]
    assert len(batch_norms) == 4 and len(reusing) == 3 and batch_norms[0] not in reusing
    kept = graph.get_tensor_by_name(batch_norms[2] + ":0")
    ours = memsave.gradients(loss, xs, checkpoints=[kept])
    # Each copy is named after its original: whether it runs in training mode.
    copies = {op.name.rsplit("/", 1)[-1]: op.get_attr("is_training")
              for op in recompute_ops(graph) if op.type == "FusedBatchNormV3"}
    assert copies.get(batch_norms[0]) is True, f"the first batch norm is not copied whole: {copies}"
    assert len(copies) > 1 and not any(training for name, training in copies.items()
                                       if name != batch_norms[0])
    session.run(tf.compat.v1.global_variables_initializer())
    assert_close(*session.run([ours, tf.gradients(loss, xs)]))
    with tf.device("/GPU:0"):
        gpu_loss, gpu_xs = _normalisation_net("FusedBatchNormV3", "NHWC", tf.float32, 1.0)
    gpu_fg = memsave.plan(gpu_loss, gpu_xs, checkpoints="memory").problem.fg
    assert not any(op.reuses_statistics for op in gpu_fg.ops)
    assert [op for op in gpu_fg.ops if op.type == "FusedBatchNormV3"]


# -- errors ------------------------------------------------------------------


def test_eager_call_raises_with_the_fix():
    w = tf.Variable(W_INIT[0])
    loss = tf.reduce_sum(tf.matmul(tf.constant(DATA), w))
    with pytest.raises(memsave.EagerExecutionError, match="tf.function"):
        memsave.gradients(loss, [w])
    assert issubclass(memsave.EagerExecutionError, RuntimeError)


def test_tensors_from_different_graphs_raise():
    g1, g2 = tf.Graph(), tf.Graph()
    with g1.as_default():
        x1 = tf.compat.v1.placeholder(tf.float32, [4], name="x_in_g1")
        y1 = tf.reduce_sum(tf.tanh(x1))
    with g2.as_default():
        x2 = tf.compat.v1.placeholder(tf.float32, [4], name="x_in_g2")
    with pytest.raises(memsave.GraphMismatchError, match="x_in_g2"):
        memsave.gradients(y1, [x2], checkpoints="memory")


def test_checkpoint_not_between_xs_and_ys_raises():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        h = tf.tanh(x)
        y = tf.reduce_sum(tf.tanh(h))
        elsewhere = tf.sin(tf.ones([4]), name="elsewhere")
        with pytest.raises(memsave.CheckpointError, match=r"elsewhere:0.*op type Sin.*not between"):
            memsave.gradients(y, [x], checkpoints=[h, elsewhere])


def test_checkpoint_equal_to_a_y_raises():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        y = tf.reduce_sum(tf.tanh(x), name="the_loss")
        with pytest.raises(memsave.CheckpointError, match=r"the_loss:0.*op type Sum.*one of the ys"):
            memsave.gradients(y, [x], checkpoints=[y])


def test_checkpoint_that_is_not_a_tensor_raises():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        h = tf.tanh(x)
        y = tf.reduce_sum(tf.tanh(h))
        with pytest.raises(memsave.CheckpointError, match="graph tensors"):
            memsave.gradients(y, [x], checkpoints=[h.op])


def test_unknown_strategy_lists_the_known_ones():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        y = tf.reduce_sum(tf.tanh(x))
        with pytest.raises(memsave.UnknownStrategyError, match="'fastest'.*collection.*memory.*speed"):
            memsave.gradients(y, [x], checkpoints="fastest")


def test_an_unknown_strategy_fails_when_patching_not_at_the_first_call():
    saved = tf.gradients
    with pytest.raises(memsave.UnknownStrategyError, match="memsave.patch: .*'fastest'"):
        memsave.patch("fastest")
    assert tf.gradients is saved  # nothing was patched


def test_a_bad_budget_or_option_fails_when_patching_not_at_the_first_call():
    saved = tf.gradients
    with pytest.raises(memsave.MemoryBudgetError, match="memsave.patch: memory_budget=7.0"):
        memsave.patch("memory", memory_budget=7.0)
    with pytest.raises(memsave.errors.OptionsError, match="memsave.patch: .*not options of"):
        memsave.patch("memory", strategy_options={"num_checkpoint": 4})
    assert tf.gradients is saved  # nothing was patched


@pytest.mark.parametrize("batch_size", [0, -4, "8", 2.5, True])
def test_a_bad_batch_size_fails_when_patching(batch_size):
    """It was accepted, and failed inside the first patched tf.gradients call."""
    saved = tf.gradients
    with pytest.raises(memsave.ArgumentError, match="memsave.patch: batch_size must be"):
        memsave.patch("memory", batch_size=batch_size)
    assert tf.gradients is saved  # nothing was patched


@pytest.mark.parametrize("preset", ["gradients_memory", "gradients_speed", "gradients_collection"])
def test_a_preset_given_checkpoints_says_to_call_gradients(preset):
    """Python's "got multiple values for keyword argument" before."""
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        with pytest.raises(memsave.ArgumentError, match=f"memsave.{preset}: checkpoints='speed'"):
            getattr(memsave, preset)(w * w, [w], checkpoints="speed")


def test_an_allocator_that_is_not_one_is_refused():
    """A string was accepted; the Plan's first figure then raised AttributeError."""
    with tf.Graph().as_default():
        w = tf.Variable(tf.ones([4, 4]))
        with pytest.raises(memsave.ArgumentError, match="allocator='bfc' is not"):
            memsave.plan(tf.reduce_sum(tf.tanh(w @ w)), [w], allocator="bfc")


@pytest.mark.parametrize("checkpoints", [None, 5])
def test_checkpoints_that_are_no_strategy_list_or_plan_fail_when_patching(checkpoints):
    saved = tf.gradients
    with pytest.raises(memsave.CheckpointError, match="memsave.patch: checkpoints=.*neither"):
        memsave.patch(checkpoints=checkpoints)
    assert tf.gradients is saved  # nothing was patched


def test_a_patch_entered_again_after_undo_applies_again():
    """A second ``with`` on one Patch object once ran under the stock
    tf.gradients, silently: entering did not apply an undone patch."""
    original = tf.gradients
    p = memsave.patch(checkpoints="speed")
    p.undo()
    assert tf.gradients is original
    for _ in range(2):
        with p:
            assert tf.gradients.memsave_checkpoints == "speed"
        assert tf.gradients is original


def test_a_patch_entered_while_applied_is_undone_by_the_outermost_exit():
    original = tf.gradients
    with memsave.patch(checkpoints="speed") as p:
        with p:
            assert tf.gradients.memsave_checkpoints == "speed"
        assert tf.gradients.memsave_checkpoints == "speed"  # the inner exit undid it
    assert tf.gradients is original


def test_nested_ys_get_an_error_that_says_so():
    """tf.gradients packs ``[[y]]`` into a tensor; memsave asks for a flat
    list (it said the ys were not graph tensors, inside a graph)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        y = tf.reduce_sum(tf.tanh(x))
        with pytest.raises(memsave.errors.ArgumentError, match="nested list.*flat list"):
            memsave.gradients([[y]], [x], checkpoints="memory")


def test_errors_of_plan_name_memsave_plan():
    with pytest.raises(memsave.EagerExecutionError, match=r"^memsave\.plan: y .* eager"):
        memsave.plan(tf.ones([2]), [tf.Variable(1.0)])
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        y = tf.reduce_sum(tf.tanh(x))
        with pytest.raises(memsave.CheckpointError, match=r"^memsave\.plan: checkpoint .* one of"):
            memsave.plan(y, [x], checkpoints=[y])


def test_grad_ys_of_wrong_length_raises():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        y = tf.reduce_sum(tf.tanh(x))
        with pytest.raises(ValueError, match="2 grad_ys for 1 ys"):
            memsave.gradients(y, [x], grad_ys=[tf.ones([]), tf.ones([])], checkpoints="memory")


def _chain_with_seeds(dtype=tf.float32):
    """Six tanh layers on 32x16 in a fresh graph: (graph, ys, ws, activations)."""
    g = tf.Graph()
    with g.as_default():
        rs = np.random.RandomState(0)
        ws = [tf.Variable(rs.randn(16, 16).astype(dtype.as_numpy_dtype) / 4) for _ in range(6)]
        h = tf.constant(rs.randn(32, 16).astype(dtype.as_numpy_dtype))
        acts = []
        for w in ws:
            h = tf.tanh(h @ w)
            acts.append(h)
    return g, h, ws, acts


def test_seeds_are_tf_gradients_own_where_memsave_rewrites():
    """The seeds of a rewritten call are made as tf.gradients makes them:
    a complex y without grad_ys and a NumPy float64 grad_y for a float32 y
    raise tf.gradients' errors (memsave once cast the array silently and
    seeded the complex y with ones), and an IndexedSlices grad_y gives its
    gradients."""
    g, h, ws, acts = _chain_with_seeds()
    with g.as_default():
        y = tf.reduce_sum(tf.complex(h, h))
        for differentiate in (tf.gradients, functools.partial(
                memsave.gradients, checkpoints=[acts[1], acts[3]])):
            with pytest.raises(TypeError, match="complex tensors .* must set grad_ys"):
                differentiate(y, ws)
            with pytest.raises(TypeError, match="float64 that does not match type float32"):
                differentiate(h, ws, grad_ys=np.ones([32, 16]))
        seed = tf.IndexedSlices(tf.ones([3, 16]), tf.constant([0, 5, 9]), tf.constant([32, 16]))
        ours = memsave.gradients(h, ws, grad_ys=seed, checkpoints=[acts[1], acts[3]])
        assert any("/recompute_" in op.name for op in g.get_operations())
        ref = tf.gradients(h, ws, grad_ys=seed)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for a, b in zip(*sess.run([ours, ref])):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_no_ys_gives_tf_gradients_answer():
    """tf.gradients([], xs) is a None per x (zeros with
    unconnected_gradients='zero'); memsave said ys was empty."""
    g, h, ws, _ = _chain_with_seeds()
    with g.as_default():
        assert memsave.gradients([], ws[:2], checkpoints="memory") == [None, None]
        zeros = memsave.gradients([], ws[:1], unconnected_gradients="zero")
        assert zeros[0].shape == ws[0].shape
        with memsave.patch(checkpoints="memory"):
            assert tf.gradients([], ws[:1]) == [None]


@pytest.mark.parametrize("options", [[1], "num_checkpoints=4", 5, {4: 1}])
def test_strategy_options_that_are_not_a_dict_are_an_options_error(options):
    g, h, ws, _ = _chain_with_seeds()
    with g.as_default():
        with pytest.raises(memsave.errors.OptionsError, match="strategy_options must be a dict"):
            memsave.gradients(tf.reduce_sum(h), ws, checkpoints="memory",
                              strategy_options=options)


def test_every_error_derives_from_the_base():
    for exc in (memsave.EagerExecutionError, memsave.GraphMismatchError, memsave.CheckpointError,
                memsave.UnknownStrategyError):
        assert issubclass(exc, memsave.MemsaveError)


def tf1_behaviour_run() -> dict:
    """'memory', 'speed' and a TF1 cond under tf.compat.v1.disable_v2_behavior().

    Run in a fresh process (tests/fresh.py): disable_v2_behavior changes
    global state. (memsave is imported before it here; memsave reads no
    TensorFlow mode at import.)
    """
    tf.compat.v1.disable_v2_behavior()  # reference variables, v1 control flow
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("memsave").addHandler(Keep())
    x = tf.compat.v1.placeholder(tf.float32, [512, 8])
    ws = [tf.compat.v1.Variable(np.random.RandomState(i).randn(8, 8).astype(np.float32) * 0.5)
          for i in range(8)]
    h = x
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_sum(h * h)
    cond_loss = tf.reduce_sum(tf.compat.v1.cond(loss > 0, lambda: h * 2.0, lambda: h * 3.0))
    _, looped = tf.while_loop(lambda k, a: k < 3, lambda k, a: (k + 1, tf.tanh(a @ ws[0])),
                              [0, h])
    loop_loss = tf.reduce_sum(looped * looped)
    result = {}
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {x: np.random.RandomState(9).randn(512, 8).astype(np.float32)}
        for strategy in ["memory", "speed"]:
            got, want = sess.run([memsave.gradients(loss, ws, checkpoints=strategy),
                                  tf.gradients(loss, ws)], feed)
            result[strategy] = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
        got, want = sess.run([memsave.gradients(cond_loss, ws, checkpoints="memory"),
                              tf.gradients(cond_loss, ws)], feed)
        result["cond"] = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
        result["cond_warned"] = any("TF1 control flow" in m for m in records)
        records.clear()
        got, want = sess.run([memsave.gradients(loop_loss, ws, checkpoints="memory"),
                              tf.gradients(loop_loss, ws)], feed)
        result["loop"] = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
        result["loop_warned"] = any("TF1 control flow" in m for m in records)
    result["copies"] = sum("/recompute_" in op.name
                           for op in tf.compat.v1.get_default_graph().get_operations())
    return result


@pytest.mark.slow
def test_tf1_behaviour_reference_variables_and_v1_control_flow(fresh):
    result = fresh.call(tf1_behaviour_run, timeout_s=300)
    assert result["copies"] > 0
    assert result["memory"] <= 1e-5 and result["speed"] <= 1e-5
    # TF1 cond is not rewritten: a warning, and tf.gradients' own answer.
    assert result["cond_warned"]
    assert result["cond"] == 0.0
    # Nor is a TF1 while loop (its cycle once stopped memsave reading the graph).
    assert result["loop_warned"]
    assert result["loop"] == 0.0


# -- tf.custom_gradient --------------------------------------------------------


@tf.custom_gradient
def _scaled_tanh(x):
    """tanh whose gradient is deliberately not tanh's: 0.5 * (1 - y**2)."""
    y = tf.tanh(x)
    return y, lambda dy: 0.5 * dy * (1.0 - y * y)


@pytest.mark.parametrize("mode", ["session", "function"])
@pytest.mark.parametrize("checkpoints", ["memory", "list"])
def test_custom_gradient_ops_are_recomputed_with_their_own_gradient(mode, checkpoints):
    def build(ws):
        h, acts = tf.constant(DATA), []
        for w in ws:
            h = _scaled_tanh(tf.matmul(h, w))
            acts.append(h)
        loss = tf.reduce_sum(h * h)
        cps = "memory" if checkpoints == "memory" else [acts[1], acts[3]]
        got = memsave.gradients(loss, ws, checkpoints=cps)
        want = _tf_private.original_gradients(loss, ws)
        graph = tf.compat.v1.get_default_graph()
        copied = sum(op.type == "IdentityN" for op in recompute_ops(graph)
                     if "/gradients" not in op.name)
        return got, want, copied

    if mode == "session":
        g = tf.Graph()
        with g.as_default():
            got, want, copied = build([tf.compat.v1.Variable(w) for w in W_INIT])
            with tf.compat.v1.Session(graph=g) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                got, want = sess.run([got, want])
    else:
        ws = [tf.Variable(w) for w in W_INIT]
        got, want, copied = tf.function(lambda: build(ws))()
        got, want = [g.numpy() for g in got], [w.numpy() for w in want]
    assert int(copied) >= 2, "no custom-gradient op was recomputed"
    assert_close(got, want)


@pytest.mark.parametrize("checkpoints", ["memory", "collection"])
def test_graph_tensors_can_be_differentiated_outside_their_graph_context(checkpoints):
    # TF2 runs eagerly by default; tf.gradients accepts a finished Graph's
    # tensors from outside its `with` block, so memsave must too, on the
    # rewrite path ('memory') and the fallback path (empty collection).
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        h = tf.tanh(tf.tanh(tf.tanh(x)))
        y = tf.reduce_sum(tf.tanh(h))
    assert tf.executing_eagerly()
    got = memsave.gradients(y, [x], checkpoints=checkpoints)
    with g.as_default():
        want = tf.gradients(y, [x])
    with tf.compat.v1.Session(graph=g) as sess:
        feed = {x: DATA[0, :4]}
        assert_close(sess.run(got, feed), sess.run(want, feed))


# -- a GradientTape over memsave's gradients -----------------------------------


def _tanh_chain_values(layers: int, *, rows: int):
    """16x16 float32 weights of a tanh chain (0.3 standard deviation) and a
    [rows, 16] input, from one seed."""
    rs = np.random.RandomState(0)
    inits = [rs.randn(16, 16).astype(np.float32) * 0.3 for _ in range(layers)]
    return inits, tf.constant(rs.randn(rows, 16).astype(np.float32))


@pytest.mark.parametrize("checkpoints", ["memory", "list"])
def test_a_tape_differentiates_memsave_gradients_further(checkpoints):
    """A gradient penalty taken by the tape that watched the forward pass
    (``tape.gradient`` of a function of memsave's gradients, in the same
    tf.function). A tape records the ops made through TensorFlow's op
    wrappers; memsave's copies are made from NodeDefs, so before they were
    recorded as one op the tape missed every path through a recomputed
    segment: None or wrong second-order gradients. Reference: the same with
    tf.gradients."""
    inits, x = _tanh_chain_values(8, rows=4)
    copies = []

    def penalty_gradients(method):
        ws = [tf.Variable(w) for w in inits]

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                hs = [x]
                for w in ws:
                    hs.append(tf.tanh(tf.matmul(hs[-1], w)))
                loss = tf.reduce_sum(hs[-1] * hs[-1])
                if method == "tf.gradients":
                    grads = tf.gradients(loss, ws)
                else:
                    grads = memsave.gradients(
                        loss, ws, checkpoints=[hs[3], hs[6]] if method == "list" else method,
                        strategy_options=None if method == "list" else {"min_saving_fraction": 0})
                penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
            copies.append(sum("recompute_" in op.name for op in loss.graph.get_operations()))
            return tape.gradient(penalty, ws)

        return [g.numpy() for g in step(x)]

    want = penalty_gradients("tf.gradients")
    got = penalty_gradients(checkpoints)
    assert copies[0] == 0 and copies[1] > 0, "the rewrite did not run"
    assert_close(got, want)


def test_nested_tapes_take_memsave_gradients_to_third_order():
    """Two tapes over memsave's gradients: the inner takes a gradient
    penalty's derivative (second order), the outer that one's (third). The
    ops of the second-order gradient read memsave's copies, which no tape
    saw made: recorded one by one, the outer tape missed every path through
    them (22-36% off). float64, so that the comparison is not of rounding."""
    rs = np.random.RandomState(0)
    inits = [rs.randn(16, 16) * 0.3 for _ in range(6)]
    x = tf.constant(rs.randn(256, 16))  # 32 KiB activations: 'memory' recomputes
    copies = []

    def third_order(first_order):
        ws = [tf.Variable(w) for w in inits]

        @tf.function
        def step(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    h = x
                    for w in ws:
                        h = tf.tanh(tf.matmul(h, w))
                    grads = first_order(tf.reduce_mean(h * h), ws)
                    penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
                gx = inner.gradient(penalty, x)
                s = tf.reduce_sum(gx * gx)
            copies.append(sum("recompute_" in op.name for op in h.graph.get_operations()))
            return [gx, *outer.gradient(s, ws)]

        return [g.numpy() for g in step(x)]

    want = third_order(tf.gradients)
    got = third_order(lambda y, xs: memsave.gradients(
        y, xs, checkpoints="memory", strategy_options={"min_saving_fraction": 0}))
    assert copies[0] == 0 and copies[1] > 0, "the rewrite did not run"
    for g, w in zip(got, want):
        assert np.abs(w).max() > 1e-6
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12 * np.abs(w).max())


def test_a_gradient_that_opens_its_own_tape_works_under_a_watching_tape():
    """memsave builds under a watching tape with recording stopped on the
    thread; a gradient function that opens a tape of its own (tf.recompute_grad's)
    got nothing recorded, and every weight at or below the block a zero
    gradient, silently."""
    inits, x = _tanh_chain_values(6, rows=256)
    copies = []

    def first_order(method):
        ws = [tf.Variable(w) for w in inits]
        block = tf.recompute_grad(lambda h: tf.tanh(tf.matmul(tf.tanh(tf.matmul(h, ws[2])), ws[3])))

        @tf.function
        def step():
            with tf.GradientTape():
                h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, ws[0])), ws[1]))
                h = block(h)
                h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(h, ws[4])), ws[5]))
                loss = tf.reduce_sum(h * h)
                grads = tf.gradients(loss, ws) if method == "tf.gradients" else memsave.gradients(
                    loss, ws, checkpoints="memory", strategy_options={"min_saving_fraction": 0})
            copies.append(sum("recompute_" in op.name for op in loss.graph.get_operations()))
            return grads

        return [g.numpy() for g in step()]

    want = first_order("tf.gradients")
    got = first_order("memory")
    assert copies[0] == 0 and copies[1] > 0, "the rewrite did not run"
    assert all(np.abs(w).max() > 1e-3 for w in want)
    assert_close(got, want)


def test_a_tape_takes_a_fused_batch_norm_s_second_derivative_through_memsave():
    """TensorFlow's gradient of FusedBatchNormGrad opens a tape; under
    memsave's recording of its gradients as one op it recorded nothing, and
    a tape's gradient penalty over a batch norm came out None."""
    rs = np.random.RandomState(1)
    x = tf.constant(rs.randn(4, 8, 8, 6).astype(np.float32))
    ws = [tf.Variable(rs.randn(3, 3, 6, 6).astype(np.float32) * 0.3) for _ in range(4)]
    scales = [tf.Variable(np.linspace(0.5, 1.5, 6).astype(np.float32)) for _ in range(4)]
    xs = ws + scales

    def penalty_gradients(method):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                h = x
                for w, scale in zip(ws, scales):
                    h = tf.compat.v1.nn.fused_batch_norm(
                        tf.nn.conv2d(h, w, 1, "SAME"), scale, tf.zeros(6), is_training=True)[0]
                    h = tf.nn.relu(h) + 0.1 * tf.sin(h)
                loss = tf.reduce_sum(h * h)
                grads = tf.gradients(loss, xs) if method == "tf.gradients" else memsave.gradients(
                    loss, xs, checkpoints="memory")
                penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
            return tape.gradient(penalty, xs)

        return step

    want_fn, got_fn = penalty_gradients("tf.gradients"), penalty_gradients("memory")
    assert _inference_copies(got_fn.get_concrete_function().graph), "the rewrite did not run"
    want = want_fn()
    assert all(w is not None for w in want)
    got = got_fn()
    assert all(g is not None for g in got)
    assert_close([g.numpy() for g in got], [w.numpy() for w in want])


# -- loss scaling --------------------------------------------------------------
#
# Mixed precision with loss scaling calls tf.gradients on the *scaled* loss
# of a float16 forward (casts in, casts out): tf.compat.v1's
# MixedPrecisionLossScaleOptimizer through the optimizer's compute_gradients
# (so through memsave.patch), Keras 3's LossScaleOptimizer through
# scale_loss in a custom step. Grappler's remapper fuses float16 MatMul +
# BiasAdd + tanh on CPUs with AVX512_FP16, but not where memsave keeps a
# checkpoint, so the two graphs may round differently: F16_ATOL is a few
# float16 ulps (eps 9.8e-4) of the largest gradient entry; a missing or
# unscaled gradient part is off by O(1) or by the loss scale.
F16_ATOL = 4e-3
LOSS_SCALE = 1024.0


def _f16_chain_loss(x, ws):
    h = tf.cast(x, tf.float16)
    for w in ws:
        h = tf.tanh(tf.nn.bias_add(tf.matmul(h, tf.cast(w, tf.float16)),
                                   tf.zeros([w.shape[1]], tf.float16)))
    return tf.reduce_mean(tf.square(tf.cast(h, tf.float32)))


@pytest.mark.parametrize("mode", ["session", "function"])
def test_loss_scaled_float16_gradients_go_through_memsave(mode):
    keep_any_plan = {"min_saving_fraction": 0.0}
    if mode == "session":
        g = tf.Graph()
        with g.as_default():
            ws = [tf.compat.v1.Variable(w) for w in W_INIT]
            loss = _f16_chain_loss(tf.constant(DATA), ws)
            opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1), loss_scale=LOSS_SCALE)
            want = [gr for gr, _ in opt.compute_gradients(loss, ws)]
            with memsave.patch(checkpoints="memory", strategy_options=keep_any_plan):
                got = [gr for gr, _ in opt.compute_gradients(loss, ws)]
            copied = len(recompute_ops(g))
            with tf.compat.v1.Session(graph=g) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                got, want = sess.run([got, want])
    else:
        import keras

        ws = [tf.Variable(w) for w in W_INIT]
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                  initial_scale=LOSS_SCALE)

        @tf.function
        def step():
            scaled = opt.scale_loss(_f16_chain_loss(tf.constant(DATA), ws))
            got = memsave.gradients(scaled, ws, checkpoints="memory",
                                    strategy_options=keep_any_plan)
            want = tf.gradients(scaled, ws)
            copied = len(recompute_ops(tf.compat.v1.get_default_graph()))
            return [gr / LOSS_SCALE for gr in got], [gr / LOSS_SCALE for gr in want], copied

        got, want, copied = step()
        got, want = [gr.numpy() for gr in got], [gr.numpy() for gr in want]
    assert int(copied) > 0, "nothing was recomputed: the scaled loss did not go through memsave"
    top = max(float(np.abs(w).max()) for w in want)
    for gr, w in zip(got, want):
        np.testing.assert_allclose(gr, w, rtol=0, atol=F16_ATOL * top)
