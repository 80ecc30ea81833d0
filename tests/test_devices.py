"""Placement: memsave's backward runs where tf.gradients' would.

A model split across devices by hand (model parallelism) must keep its
split in the backward pass. TF2's ``tf.gradients`` colocates every gradient
op with its forward op; memsave's copies run on their originals' devices,
and with ``colocate_gradients_with_ops`` (its default, as TF2's) its gradient
ops, proxies, seeds and sums do too. The graphs here place a tanh/matmul
chain half on ``/device:CPU:0``, half on ``/device:CPU:1`` (two logical
CPUs, so a fresh process), and a ``tf.scan`` on CPU:1, and count the ops
each gradients call adds by the device they would run on.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

#: Seconds a placement run may take (about 10 s on 2 shared cores).
TIMEOUT_S = 300

LAYERS = 8


def _placed(op) -> str:
    """The device ``op`` is pinned to: its own, or that of its colocation
    group ("loc:<op>", resolved by the placer); "" when nothing places it."""
    if op.device:
        return op.device
    groups = [g for g in op.colocation_groups() if g != b"loc:@" + op.name.encode()]
    return "loc:" + groups[0].decode()[5:] if groups else ""


def _resolve(graph, name: str) -> str:
    """A colocation group's device (its op's, followed through further groups
    and, as the placer does, from an unplaced reader of a resource to the
    resource: TensorFlow reads a variable used in a device scope by a
    ReadVariableOp without a device)."""
    while name.startswith("loc:"):
        op = graph.get_operation_by_name(name[4:])
        name = _placed(op)
        if not name and op.inputs and op.inputs[0].dtype.name == "resource":
            name = "loc:" + op.inputs[0].op.name
    return name


def placement_run() -> dict:
    """Per method: {op type: {device: count}} of the ops the call added, and
    the largest relative difference from tf.gradients' values."""
    import tensorflow as tf

    import memsave

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    def chain(graph):
        rs = np.random.RandomState(0)
        h = tf.constant(rs.randn(1024, 64).astype(np.float32))
        ws = []
        for i in range(LAYERS):
            with tf.device(f"/device:CPU:{2 * i // LAYERS}"):
                ws.append(tf.Variable(rs.randn(64, 64).astype(np.float32) * 0.2))
                h = tf.tanh(h @ ws[-1])
        with tf.device("/device:CPU:1"):
            loss = tf.reduce_sum(h * h)
        return loss, ws

    def scan(graph):
        rs = np.random.RandomState(0)
        x = tf.constant(rs.randn(16, 512, 32).astype(np.float32))
        with tf.device("/device:CPU:1"):
            ws = [tf.Variable(rs.randn(32, 128).astype(np.float32) * 0.1),
                  tf.Variable(rs.randn(128, 128).astype(np.float32) * 0.1)]
            hs = tf.scan(lambda h, xt: tf.tanh(xt @ ws[0] + h @ ws[1]), x,
                         initializer=tf.zeros([512, 128]))
            loss = tf.reduce_sum(hs * hs)
        return loss, ws

    def v1_scope(loss, ws):
        with tf.device("/device:CPU:0"):
            return memsave.gradients(loss, ws, checkpoints="memory",
                                     colocate_gradients_with_ops=False)

    def patched(loss, ws):
        with memsave.patch(checkpoints="memory"):
            return tf.gradients(loss, ws)

    methods = {
        "tf": lambda loss, ws: tf.gradients(loss, ws),
        "memory": lambda loss, ws: memsave.gradients(loss, ws, checkpoints="memory"),
        "patched": patched,
        "v1_scope": v1_scope,
    }
    out = {}
    for model, make in (("chain", chain), ("scan", scan)):
        for method, call in methods.items():
            graph = tf.Graph()
            with graph.as_default():
                loss, ws = make(graph)
                plan_loops = [d.chosen.choice.kind
                              for d in memsave.plan(loss, ws, checkpoints="memory").loops]
                before = set(graph.get_operations())
                grads = call(loss, ws)
                reference = tf.gradients(loss, ws)
                added = [op for op in graph.get_operations() if op not in before]
                # (tf.gradients' reference call for the values adds ops too: count up to it)
                added = added[:next((i for i, op in enumerate(added)
                                     if op.name.startswith("gradients_1/")), len(added))]
                counts = collections.defaultdict(collections.Counter)
                for op in added:
                    counts[op.type][_resolve(graph, _placed(op))] += 1
                copies = sum(1 for op in added if "/recompute_" in op.name and op.type == "Tanh")
                init = tf.compat.v1.global_variables_initializer()
            with tf.compat.v1.Session(graph=graph) as session:
                session.run(init)
                got, want = session.run([grads, reference])
            diff = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
                       for a, b in zip(got, want))
            out[f"{model}/{method}"] = {
                "counts": {t: dict(c) for t, c in counts.items()}, "diff": diff,
                "copies": copies, "loops": plan_loops}
    return out


@pytest.fixture(scope="module")
def runs(fresh):
    return fresh.call(placement_run, timeout_s=TIMEOUT_S)


def _devices(run: dict, op_type: str) -> dict:
    return run["counts"].get(op_type, {})


@pytest.mark.parametrize("method", ["memory", "patched"])
def test_a_split_chain_keeps_its_split_backward(runs, method):
    tf_run, run = runs["chain/tf"], runs[f"chain/{method}"]
    assert run["copies"] > 0, "the rewrite did not run: nothing recomputed"
    assert run["diff"] <= 1e-5
    # Each layer's gradient where tf.gradients puts it: half on each device.
    half = LAYERS // 2
    assert _devices(tf_run, "TanhGrad") == {"/device:CPU:0": half, "/device:CPU:1": half}
    assert _devices(run, "TanhGrad") == _devices(tf_run, "TanhGrad")
    # Nothing memsave adds is left for the placer to put anywhere (on a GPU
    # machine: the first GPU).
    unplaced = {t: c[""] for t, c in run["counts"].items() if c.get("")}
    assert not unplaced, unplaced
    assert set().union(*run["counts"].values()) <= {"/device:CPU:0", "/device:CPU:1"}


def test_without_colocation_the_callers_scope_places_the_gradients(runs):
    """``colocate_gradients_with_ops=False`` (tf.compat.v1.gradients'
    default): the stock gradient ops take the caller's device scope; the
    recomputation still runs where the forward pass did."""
    run = runs["chain/v1_scope"]
    assert run["copies"] > 0
    assert run["diff"] <= 1e-5
    assert _devices(run, "TanhGrad") == {"/device:CPU:0": LAYERS}
    assert "/device:CPU:1" in _devices(run, "Tanh")  # copies of the layers on CPU:1


@pytest.mark.parametrize("method", ["memory", "patched"])
def test_a_rebuilt_loop_and_what_it_adds_stay_on_the_loops_device(runs, method):
    run = runs[f"scan/{method}"]
    assert run["loops"] and "plain" not in run["loops"], run["loops"]  # the loop is rewritten
    assert run["diff"] <= 1e-5
    assert _devices(run, "While") == {"/device:CPU:1": 1}  # its gradient loop
    unplaced = {t: c[""] for t, c in run["counts"].items() if c.get("")}
    assert not unplaced, unplaced
