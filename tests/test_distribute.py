"""memsave where users scale out: tf.compat.v1 optimizers and tf.distribute.

* tf.compat.v1 optimizers under ``memsave.patch``: ``minimize`` and
  ``compute_gradients`` + ``apply_gradients`` of GradientDescent, Momentum
  (and Nesterov), Adam and RMSProp (slot variables), with the
  ``gate_gradients``, ``aggregation_method``, ``colocate_gradients_with_ops``,
  ``var_list`` and ``global_step`` options, in Session training loops fed
  through placeholders, on a deep MLP and a small conv net; once more in a
  process with ``tf.compat.v1.disable_v2_behavior()`` (reference variables).
  Each run is compared step by step with the same loop built without the
  patch, and proved to have gone through memsave twice over: a spy strategy
  registered with :func:`memsave.strategies.register` counts the calls that
  reach memsave, and the graph holds memsave's recompute copies.
* tf.distribute custom training loops (``strategy.run`` inside a
  tf.function, gradients all-reduced across replicas and applied): under
  MirroredStrategy on two logical CPUs, and under MultiWorkerMirroredStrategy
  with two worker processes on loopback ports. Each worker trains the same
  model from the same weights with memsave and with GradientTape; the
  per-step gradients and final weights of both are compared with a
  single-process run on the whole global batch, and each worker's allocator
  peak with memsave is compared with its peak with GradientTape.

The distributed runs happen in fresh Python processes (tests/fresh.py):
logical devices and the multi-worker cluster must be set up before
TensorFlow initialises, and allocator peaks count every live tensor in the
process.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf

import memsave

MiB = 1 << 20

# -- tf.compat.v1 optimizers under memsave.patch ---------------------------------------

V1_STEPS = 5
V1_BATCH, V1_WIDTH, V1_LAYERS = 16, 16, 12

#: float32 losses and variables after V1_STEPS updates from gradients summed
#: in another order: see tests/test_gradients_zoo.py (TOLERANCES) for why
#: 1e-5 relative, with 1e-5 of the variable's largest entry as the floor.
V1_RTOL, V1_ATOL = 1e-5, 1e-5


@contextlib.contextmanager
def _spying(name="spy_memory"):
    """Register a strategy ``name`` that runs 'memory' and records every call reaching it.

    Registered through the public API and removed on exit: a gradient call
    that went through memsave.patch but not through memsave's pipeline (or a
    patch that reached nothing) leaves the yielded list empty.
    """
    calls = []
    memory = memsave.strategies.get("memory")

    @memsave.strategies.register(name)
    def spy_memory(fg, **options):
        calls.append({"xs": len(fg.xs)})
        return memory(fg, **options)

    try:
        yield calls
    finally:
        memsave.strategies.unregister(name)


@pytest.fixture
def spy():
    """The calls that reached memsave through the strategy "spy_memory" (see _spying)."""
    with _spying() as calls:
        yield calls


def _mlp(x, y):
    """A V1_LAYERS-deep tanh MLP with a softmax head; v1 variables, weights drawn in-graph."""
    h = x
    for i in range(V1_LAYERS):
        w = tf.compat.v1.get_variable(
            f"w{i}", [V1_WIDTH, V1_WIDTH],
            initializer=tf.compat.v1.initializers.random_normal(stddev=V1_WIDTH ** -0.5, seed=i))
        b = tf.compat.v1.get_variable(f"b{i}", [V1_WIDTH], initializer=tf.compat.v1.zeros_initializer())
        h = tf.tanh(tf.matmul(h, w) + b)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))


def _convnet(x, y):
    """conv-relu x4 (stride 2 on the second) on 8x8x3 images, mean pool, dense head."""
    h, channels = x, 3
    for i, stride in enumerate([1, 2, 1, 1]):
        k = tf.compat.v1.get_variable(
            f"k{i}", [3, 3, channels, 8],
            initializer=tf.compat.v1.initializers.random_normal(stddev=0.3, seed=100 + i))
        h = tf.nn.relu(tf.nn.conv2d(h, k, strides=stride, padding="SAME"))
        channels = 8
    w = tf.compat.v1.get_variable(
        "head", [8, V1_WIDTH], initializer=tf.compat.v1.initializers.random_normal(seed=99))
    logits = tf.matmul(tf.reduce_mean(h, [1, 2]), w)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


MODELS = {"mlp": (_mlp, [V1_WIDTH]), "convnet": (_convnet, [8, 8, 3])}


def _v1_batches(shape):
    rs = np.random.RandomState(7)
    return [(rs.randn(V1_BATCH, *shape).astype(np.float32),
             rs.randint(0, V1_WIDTH, V1_BATCH).astype(np.int32)) for _ in range(V1_STEPS)]


def _train_v1(model, make_optimizer, build_train_op, checkpoints):
    """A Session loop of V1_STEPS steps fed through placeholders.

    ``build_train_op(optimizer, loss, trainable)`` builds the update; with
    ``checkpoints`` set it is built inside ``memsave.patch(checkpoints)``.
    Returns a dict: ``losses`` of every step, ``initial`` and ``final``
    values of every global variable (weights, slots, the global step) by
    name, the ``copies`` memsave made in the graph (recompute ops), and the
    op types of the ``variable_ops``.
    """
    build_model, shape = MODELS[model]
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, *shape])
        y = tf.compat.v1.placeholder(tf.int32, [None])
        loss = build_model(x, y)
        trainable = tf.compat.v1.trainable_variables()
        optimizer = make_optimizer()
        # These models are small (the weights' gradients outweigh the
        # activations), so the simulator predicts no saving and 'memory' would
        # fall back to tf.gradients: keep its plan anyway, to test the path.
        keep_any = {"min_saving_fraction": 0.0}
        with (memsave.patch(checkpoints=checkpoints, strategy_options=keep_any) if checkpoints
              else contextlib.nullcontext()):
            train_op = build_train_op(optimizer, loss, trainable)
        copies = sum("/recompute_" in op.name for op in g.get_operations())
        variables = tf.compat.v1.global_variables()
        init = tf.compat.v1.global_variables_initializer()
    losses = []
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        initial = sess.run(variables)
        for xb, yb in _v1_batches(shape):
            losses.append(sess.run([loss, train_op], {x: xb, y: yb})[0])
        final = sess.run(variables)
    names = [v.op.name for v in variables]
    return {"losses": losses, "initial": dict(zip(names, initial)),
            "final": dict(zip(names, final)), "copies": copies,
            "variable_ops": sorted({v.op.type for v in variables})}


def _minimize(**kwargs):
    def build(opt, loss, trainable):
        return opt.minimize(loss, **kwargs)
    return build


def _compute_apply(**kwargs):
    def build(opt, loss, trainable):
        grads_and_vars = opt.compute_gradients(loss, **kwargs)
        return opt.apply_gradients(grads_and_vars)
    return build


def _minimize_second_half(opt, loss, trainable):
    """Train only the second half of the variables (var_list) and count steps."""
    step = tf.compat.v1.train.get_or_create_global_step()
    return opt.minimize(loss, global_step=step, var_list=trainable[len(trainable) // 2:])


V1 = tf.compat.v1.train
V1_CASES = {
    # name: (model, optimizer, how the update is built)
    "gd-minimize": ("mlp", lambda: V1.GradientDescentOptimizer(0.5), _minimize()),
    "gd-gate-graph-add-n": ("mlp", lambda: V1.GradientDescentOptimizer(0.5), _minimize(
        gate_gradients=V1.Optimizer.GATE_GRAPH,
        aggregation_method=tf.AggregationMethod.ADD_N)),
    "gd-gate-none-accumulate-n-colocate": ("mlp", lambda: V1.GradientDescentOptimizer(0.5), _minimize(
        gate_gradients=V1.Optimizer.GATE_NONE,
        aggregation_method=tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
        colocate_gradients_with_ops=True)),
    "momentum-compute-apply": ("mlp", lambda: V1.MomentumOptimizer(0.1, 0.9), _compute_apply()),
    "nesterov-var-list-global-step": (
        "mlp", lambda: V1.MomentumOptimizer(0.1, 0.9, use_nesterov=True), _minimize_second_half),
    "adam-minimize": ("mlp", lambda: V1.AdamOptimizer(0.01), _minimize()),
    "adam-convnet-compute-apply": ("convnet", lambda: V1.AdamOptimizer(0.01), _compute_apply(
        gate_gradients=V1.Optimizer.GATE_GRAPH)),
    "rmsprop-convnet-minimize": ("convnet", lambda: V1.RMSPropOptimizer(0.01), _minimize()),
}


@pytest.mark.parametrize("case", sorted(V1_CASES))
def test_v1_optimizer_under_patch_goes_through_memsave_and_matches(case, spy):
    model, make_optimizer, build = V1_CASES[case]
    plain = _train_v1(model, make_optimizer, build, None)
    assert plain["copies"] == 0 and spy == []
    ours = _train_v1(model, make_optimizer, build, "spy_memory")
    plain_vars, initial, variables = plain["final"], plain["initial"], ours["final"]

    # Through memsave: the optimizer's one gradient call reached memsave's
    # strategy, with the variables it trains as xs, and the rewrite copied ops.
    assert len(spy) == 1, f"{case}: {len(spy)} calls reached memsave (expected 1)"
    assert ours["copies"] > 0, f"{case}: the update under memsave.patch holds no recomputation"
    n_trainable = 2 * V1_LAYERS if model == "mlp" else 5
    expected_xs = n_trainable // 2 if case == "nesterov-var-list-global-step" else n_trainable
    assert spy[0]["xs"] == expected_xs

    # Same updates: the loss of every step, and every variable (weights,
    # slots, global step) after the last.
    assert sorted(variables) == sorted(plain_vars)
    moved = [n for n, v in plain_vars.items() if np.abs(v - initial[n]).max() > 0]
    assert len(moved) >= expected_xs, f"{case}: the loop changed only {moved}"
    np.testing.assert_allclose(ours["losses"], plain["losses"], rtol=V1_RTOL)
    for name, want in plain_vars.items():
        scale = max(float(np.abs(want).max()), 1e-30)
        np.testing.assert_allclose(variables[name], want, rtol=V1_RTOL, atol=V1_ATOL * scale,
                                   err_msg=f"{case}: variable {name}")


def test_v1_optimizer_var_list_leaves_frozen_variables_alone(spy):
    # The frozen first half keeps its initial value; the trained half moves.
    run = _train_v1(
        "mlp", lambda: V1.MomentumOptimizer(0.1, 0.9, use_nesterov=True), _minimize_second_half,
        "spy_memory")
    initial, variables = run["initial"], run["final"]
    names = [f"{kind}{i}" for i in range(V1_LAYERS) for kind in "wb"]
    frozen, trained = names[:len(names) // 2], names[len(names) // 2:]
    for name in frozen:
        np.testing.assert_array_equal(variables[name], initial[name], err_msg=name)
    assert all(np.abs(variables[n] - initial[n]).max() > 0 for n in trained if n.startswith("w"))
    assert variables["global_step"] == V1_STEPS
    # memsave only looked at the trained half of the network.
    assert spy[0]["xs"] == len(trained)


def v1_legacy_run() -> dict:
    """The Momentum case with TF1 behaviour, compared as the test above compares (in a fresh
    process: disable_v2_behavior changes global state)."""
    tf.compat.v1.disable_v2_behavior()
    build = _minimize(gate_gradients=V1.Optimizer.GATE_GRAPH)
    make = lambda: V1.MomentumOptimizer(0.1, 0.9)  # noqa: E731
    plain = _train_v1("mlp", make, build, None)
    with _spying() as calls:
        ours = _train_v1("mlp", make, build, "spy_memory")
    want, got = plain["final"], ours["final"]
    return {
        "calls": len(calls),
        "copies": ours["copies"],
        "variable_ops": ours["variable_ops"],
        "variables": sorted(got) if sorted(got) == sorted(want) else None,
        "var_rel_err": max(float(np.abs(got[n] - v).max() / max(np.abs(v).max(), 1e-30))
                           for n, v in want.items()),
        "moved": sum(bool(np.abs(v - plain["initial"][n]).max() > 0) for n, v in want.items()),
        "loss_rel_err": float(np.abs(np.subtract(ours["losses"], plain["losses"])).max()
                              / np.abs(plain["losses"]).max()),
    }


@pytest.mark.slow
def test_v1_optimizer_with_tf1_behaviour(fresh):
    # A legacy program: tf.compat.v1.disable_v2_behavior() (reference
    # variables, v1 control flow enabled), Momentum with GATE_GRAPH. In a
    # fresh process: disable_v2_behavior changes global state.
    res = fresh.call(v1_legacy_run, timeout_s=SUBPROCESS_TIMEOUT_S)
    assert res["variable_ops"] == ["VariableV2"]  # reference variables, as in TF1
    assert res["calls"] == 1 and res["copies"] > 0
    assert res["variables"] is not None and len(res["variables"]) == 4 * V1_LAYERS  # + momenta
    assert res["moved"] == 4 * V1_LAYERS
    assert res["var_rel_err"] <= V1_RTOL and res["loss_rel_err"] <= V1_RTOL


# -- the distributed training loop (shared by every strategy) -------------------------
#
# A deep MLP ``h = tanh(h @ w + b)`` on a batch that is tall and narrow, so
# that activations outweigh the weights: at 2 replicas each layer output is
# 1024 x 128 floats (0.5 MiB), and backprop through the 32 layers needs 16 MiB
# of them (tanh's gradient reads its output, matmul's its input), against
# 2 MiB of weights.

LAYERS = 32
WIDTH = 128
GLOBAL_BATCH = 2048
STEPS = 4
LEARNING_RATE = 0.003

#: How each variant differentiates the per-replica loss.
METHODS = ("memsave", "tape")

#: float32 losses and gradients summed in another order (two half-batch sums
#: all-reduced against one full-batch sum; recomputed segments): see
#: tests/test_gradients_zoo.py for why 1e-5 of the largest entry. Measured:
#: at most 1.7e-7 of the largest entry (gradient digests) and 6e-8 (losses),
#: under both strategies, memsave and GradientTape alike.
GRAD_RTOL = 1e-5
#: Weights (entries up to 0.44) after STEPS updates: measured differences at
#: most 6e-8; every weight moves by more than 2e-4 (test_reference_run_trains).
WEIGHT_ATOL = 1e-5

#: memsave 'memory' must keep each worker's allocator peak at or below this
#: fraction of GradientTape's. Measured per worker (median peak of steps 2-4),
#: 7 two-worker runs on 2 shared cores: GradientTape 18.0-18.5 MiB, memsave
#: 6.0-7.0 MiB, ratio 0.33-0.39; a memsave that saves nothing measures 1.0.
MEMORY_MAX_RATIO = 0.55


def _initial_params():
    rs = np.random.RandomState(0)
    params = []
    for _ in range(LAYERS):
        params.append((rs.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32))
        params.append((rs.randn(WIDTH) * 0.1).astype(np.float32))
    return params


def _global_batch():
    """Inputs and the targets of a fixed random teacher layer (learnable, so the loss falls)."""
    rs = np.random.RandomState(1)
    x = rs.randn(GLOBAL_BATCH, WIDTH).astype(np.float32)
    teacher = (rs.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32)
    return x, np.tanh(x @ teacher)


def _loss(params, x, y):
    """This replica's share of the global batch's mean (over examples) squared error."""
    h = x
    for w, b in zip(params[0::2], params[1::2]):
        h = tf.tanh(tf.matmul(h, w) + b)
    return tf.reduce_sum(tf.square(h - y)) / GLOBAL_BATCH


def _grads(method, params, x, y):
    if method == "memsave":
        loss = _loss(params, x, y)
        return loss, memsave.gradients(loss, params, checkpoints="memory")
    if method == "tape":
        with tf.GradientTape() as tape:
            loss = _loss(params, x, y)
        return loss, tape.gradient(loss, params)
    raise ValueError(f"unknown method {method!r}")


def _recompute_ops(graph) -> int:
    """Ops memsave copied (they live under a recompute_<k> name scope)."""
    return sum("/recompute_" in op.name for op in graph.get_operations())


def _digest(g):
    """Column sums, row sums and sum of squares of a gradient (the vector itself for a bias).

    Steps return these rather than the gradients, so that each gradient is
    consumed as the update consumes it, not held to the end of the step
    (which would add every gradient to memsave's peak, late in the backward
    pass). A wrong entry shows in its row and its column sum.
    """
    parts = [tf.reduce_sum(g, 0), tf.reduce_sum(g, 1)] if g.shape.rank == 2 else [g]
    return tf.concat(parts + [tf.reshape(tf.reduce_sum(g * g), [1])], 0)


def train(strategy, method, *, steps=STEPS):
    """Train under ``strategy``; this process's results, as a dict of numpy arrays.

    The global batch is split evenly across the replicas in sync, replica
    ``i`` taking rows ``[i * n, (i + 1) * n)``. Each step all-reduces the
    replicas' gradients (a sum: each replica's loss is its share of the
    global mean) and applies ``w -= LEARNING_RATE * g`` on every replica.
    Returned: ``losses`` and gradient ``digests`` [steps, ...] of every step,
    the first local replica's ``weights`` after the last step, how far the
    other local replicas' weights are from them (``replica_spread``), the
    ``recompute_ops`` memsave put in the step's graph, and ``peak_bytes``, the
    median allocator peak on this process's CPU over the steps after the
    first (which traces the step).
    """
    x_np, y_np = _global_batch()
    replicas = strategy.num_replicas_in_sync
    per_replica = GLOBAL_BATCH // replicas

    def shard(ctx):
        i = ctx.replica_id_in_sync_group
        rows = slice(i * per_replica, (i + 1) * per_replica)
        return tf.constant(x_np[rows]), tf.constant(y_np[rows])

    x, y = strategy.experimental_distribute_values_from_function(shard)
    with strategy.scope():
        # Every replica applies the same all-reduced update, so the first
        # replica's value stands for all of them.
        params = [tf.Variable(p, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                  for p in _initial_params()]

    def replica_step(x, y):
        loss, grads = _grads(method, params, x, y)
        ctx = tf.distribute.get_replica_context()
        loss, grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, (loss, grads))
        updates = [p.assign_sub(LEARNING_RATE * g) for p, g in zip(params, grads)]
        with tf.control_dependencies(updates):
            return tf.identity(loss), tf.concat([_digest(g) for g in grads], 0)

    @tf.function
    def step(x, y):
        return strategy.run(replica_step, args=(x, y))

    local = strategy.experimental_local_results
    losses, digests, peaks = [], [], []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        loss, digest = step(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
        losses.append(local(loss)[0].numpy())
        digests.append(local(digest)[0].numpy())
    out = {
        "losses": np.array(losses),
        "digests": np.array(digests),
        "recompute_ops": np.array(_recompute_ops(step.get_concrete_function(x, y).graph)),
        "peak_bytes": np.array(np.median(peaks[1:])),
        "replicas": np.array(replicas),
    }
    for k, p in enumerate(params):
        out[f"weights.{k}"] = local(p)[0].numpy()
    out["replica_spread"] = np.array(max(
        float(np.abs(v.numpy() - local(p)[0].numpy()).max()) for p in params for v in local(p)))
    return out


def _save(path, results):
    """Write {method: train(...)} to ``path`` as one .npz of "method/key" arrays."""
    np.savez(path, **{f"{m}/{k}": v for m, r in results.items() for k, v in r.items()})


def _load(path):
    with np.load(path) as f:
        out = {}
        for key in f.files:
            method, name = key.split("/", 1)
            out.setdefault(method, {})[name] = f[key]
    return out


# -- run in fresh processes (tests/fresh.py); results go to an .npz file ---------------


def worker_run(out: str) -> None:
    """One MultiWorkerMirroredStrategy worker; the launcher sets TF_CONFIG."""
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    _save(out, {m: train(strategy, m) for m in METHODS})


def mirrored_run(out: str) -> None:
    """MirroredStrategy over two logical CPUs of this process."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    _save(out, {m: train(strategy, m) for m in METHODS})


# -- the distributed tests ---------------------------------------------------------------

#: The distributed tests share module-scoped runs: one worker runs them all (tests/conftest.py).
_SHARED_RUNS = pytest.mark.xdist_group("test_distribute")

#: Seconds the subprocesses may take. Measured (2 shared cores): about 30 s
#: for the two workers, 15 s for the MirroredStrategy run.
SUBPROCESS_TIMEOUT_S = 300


def _free_loopback_ports(n):
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago.

    All ``n`` sockets are held open until every port is read, so they
    differ; another process may still take one before the workers bind it,
    which :func:`_run_workers` detects and retries.
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


#: What a worker's stderr says when its port was taken in the meantime.
_PORT_TAKEN = ("address already in use", "failed to add port", "could not start grpc server")


def _run_workers(fresh, out_dir, workers=2, attempts=3):
    """Run ``workers`` MultiWorkerMirroredStrategy workers on loopback ports; their results.

    Each worker is :func:`worker_run` in a fresh process with its own
    TF_CONFIG. When one worker fails the others would wait for it in a
    collective forever, so every worker is killed as soon as one fails or
    the time is up, and the failure shows every worker's stderr. A port taken between choosing and
    binding it is retried with fresh ports.
    """
    for attempt in range(attempts):
        ports = _free_loopback_ports(workers)
        cluster = {"worker": [f"localhost:{p}" for p in ports]}
        outs = [os.path.join(out_dir, f"attempt{attempt}-worker{i}.npz") for i in range(workers)]
        logs = [os.path.join(out_dir, f"attempt{attempt}-worker{i}.log") for i in range(workers)]
        procs = []
        try:
            for i in range(workers):
                tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
                with open(logs[i], "w") as log:
                    procs.append(subprocess.Popen(
                        fresh.command(worker_run, outs[i]),
                        env=fresh.env(TF_CONFIG=tf_config), stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        codes = [p.returncode for p in procs]
        if all(c == 0 for c in codes):
            return [_load(o) for o in outs]
        texts = []
        for path in logs:
            with open(path) as f:
                texts.append(f.read())
        if any(s in t.lower() for t in texts for s in _PORT_TAKEN) and attempt + 1 < attempts:
            continue
        report = "\n".join(f"--- worker {i} (port {ports[i]}, exit code {codes[i]}):\n{t[-3000:]}"
                           for i, t in enumerate(texts))
        pytest.fail(f"multi-worker run failed or timed out ({SUBPROCESS_TIMEOUT_S} s)\n{report}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def single_process():
    """The reference: GradientTape, one replica holding the whole global batch."""
    return train(tf.distribute.get_strategy(), "tape")


@pytest.fixture(scope="module")
def multi_worker(fresh, tmp_path_factory):
    """Results of the two MultiWorkerMirroredStrategy workers (one cluster for every test)."""
    start = time.monotonic()
    results = _run_workers(fresh, str(tmp_path_factory.mktemp("workers")))
    print(f"two-worker run: {time.monotonic() - start:.1f} s")
    return results


@pytest.fixture(scope="module")
def mirrored(fresh, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mirrored") / "mirrored.npz")
    fresh.call(mirrored_run, out, timeout_s=SUBPROCESS_TIMEOUT_S)
    return _load(out)


def _assert_same_training(got, ref, what):
    """``got`` trained as ``ref`` did: every step's loss and gradients, the final weights."""
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=GRAD_RTOL, err_msg=what)
    for k, (g, r) in enumerate(zip(got["digests"], ref["digests"])):
        np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_RTOL * np.abs(r).max(),
                                   err_msg=f"{what}: gradients of step {k}")
    for k in range(2 * LAYERS):
        r = ref[f"weights.{k}"]
        np.testing.assert_allclose(got[f"weights.{k}"], r, rtol=0, atol=WEIGHT_ATOL,
                                   err_msg=f"{what}: weights {k} after {STEPS} steps")


def _check_distributed(results, ref, replicas):
    for method in METHODS:
        got = results[method]
        assert int(got["replicas"]) == replicas
        assert float(got["replica_spread"]) == 0.0  # mirrored variables stay mirrored
        _assert_same_training(got, ref, method)
    assert int(results["memsave"]["recompute_ops"]) > 0, "memsave recomputed nothing"
    assert int(results["tape"]["recompute_ops"]) == 0


@_SHARED_RUNS
def test_reference_run_trains(single_process):
    # The comparisons below are not vacuous: the loss falls, every weight
    # moves by much more than the tolerance, and the steps' gradients differ.
    assert np.all(np.diff(single_process["losses"]) < 0), single_process["losses"]
    moved = [np.abs(single_process[f"weights.{k}"] - w).max()
             for k, w in enumerate(_initial_params())]
    assert min(moved) > 10 * WEIGHT_ATOL
    digests = single_process["digests"]
    assert np.abs(digests[-1] - digests[0]).max() > 100 * GRAD_RTOL * np.abs(digests[0]).max()


@pytest.mark.slow
@_SHARED_RUNS
def test_mirrored_training_loop_matches_single_process(mirrored, single_process):
    _check_distributed(mirrored, single_process, replicas=2)


@pytest.mark.slow
@_SHARED_RUNS
def test_multi_worker_training_matches_single_process(multi_worker, single_process):
    for task, results in enumerate(multi_worker):
        _check_distributed(results, single_process, replicas=2)
    # And the workers agree with each other to the bit: they applied the
    # same all-reduced update.
    for method in METHODS:
        for k in range(2 * LAYERS):
            np.testing.assert_array_equal(multi_worker[0][method][f"weights.{k}"],
                                          multi_worker[1][method][f"weights.{k}"])


@pytest.mark.slow
@_SHARED_RUNS
def test_multi_worker_memsave_cuts_each_workers_peak(multi_worker):
    for task, results in enumerate(multi_worker):
        ours, ref = int(results["memsave"]["peak_bytes"]), int(results["tape"]["peak_bytes"])
        assert ours <= MEMORY_MAX_RATIO * ref, (
            f"worker {task}: memsave 'memory' peak {ours / MiB:.1f} MiB is {ours / ref:.2f} of "
            f"GradientTape's {ref / MiB:.1f} MiB (allowed {MEMORY_MAX_RATIO})"
        )


def keras_fit_mirrored_batch_sizes() -> list:
    """The batch sizes memsave.keras plans a MirroredStrategy fit's step for (two CPUs)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import memsave.keras

    sizes = []
    real = memsave.keras._memsave_gradients

    def spy(loss, xs, **kw):
        sizes.append(kw["batch_size"])
        return real(loss, xs, **kw)

    memsave.keras._memsave_gradients = spy
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    memsave.keras.checkpointed(model)
    rs = np.random.RandomState(0)
    model.fit(rs.randn(300, 8).astype(np.float32), rs.randn(300, 1).astype(np.float32),
              batch_size=128, verbose=0)  # the last batch is partial
    return sizes


def test_keras_fit_under_mirrored_plans_each_replicas_share_of_the_batch(fresh):
    # Each replica's step takes half of fit's batch of 128.
    sizes = fresh.call(keras_fit_mirrored_batch_sizes, timeout_s=SUBPROCESS_TIMEOUT_S)
    assert sizes and set(sizes) == {64}, sizes
