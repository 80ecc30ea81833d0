"""Build time: ``memsave.gradients(checkpoints='memory')`` against ``tf.gradients``, side by side.

Target (issue 16): memsave's build at most 1.5x tf.gradients' on a
1000-layer chain and on the study's ResNet-110, and linear (2000 layers at
most 2.1x 1000 layers).

Graphs, each built fresh in a tf.compat.v1 Graph for every call:

* ``chain N [B, 16]``: N layers ``h = tanh(h @ w_i)``, 16x16 weights, loss
  ``sum(h * h)``. At B = 8 the weights' gradients outweigh the activations:
  'memory' plans, finds no saving worth a recomputation, and hands the call
  to tf.gradients (the planning is then all it adds). At B = 64 it
  rewrites: about one forward pass recomputed.
* ``resnet-110``: experiments/models.py's CIFAR ResNet (n = 18), batch 32.
* ``rnn 3 loops``: three LSTM cells, each a ``tf.scan`` over T = 64 steps
  (batch 256, 128 units) followed by a ReLU projection of every step's
  output, loss on all steps: 'memory' weighs each loop's gradient with the
  rest of the plan (``memsave.planners.loops``), one planning per
  combination of choices.

Times are CPU seconds of the gradients call alone (``time.process_time``:
the machine is shared, and CPU time moves far less than wall time under
load), median of ``--repeats`` calls, the two methods interleaved, each
after a garbage collection (memsave's call pauses the collector, and the
collection it defers fell inside the next timed call). The ratio is the
median over the repeats of each repeat's two adjacent calls' ratio: a slow
spell of the machine then slows both calls of a pair, where the ratio of
the two medians can take its tf.gradients time from one spell and its
memsave time from another. For the same reason the chain's sizes (of one
batch) are timed in turn in every repeat, and the growth from the first
size to the last is the median of the repeats' ratios. The
``ops`` columns count the ops each call added, and ``copies`` the ops
memsave recomputed (0: it fell back to tf.gradients).

Usage::

    .venv/bin/python experiments/bench_build.py             # about 3 minutes on 2 cores
    .venv/bin/python experiments/bench_build.py --repeats 1 --layers 250 500
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: The target ratio, and the linearity bound on 2000 / 1000 layers.
TARGET = 1.5
LINEAR = 2.1


def chain_graph(layers: int, batch: int):
    import numpy as np
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        rs = np.random.RandomState(0)
        ws = [tf.Variable(rs.randn(16, 16).astype(np.float32) * 0.25) for _ in range(layers)]
        h = tf.constant(rs.randn(batch, 16).astype(np.float32))
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
    return graph, loss, ws


def resnet_graph(n: int = 18, batch: int = 32):
    import tensorflow as tf

    import models

    m = models.MODELS["resnet"]
    params = m.init(n, 0)
    x, y = m.batch(batch, 0)
    graph = tf.Graph()
    with graph.as_default():
        v = {k: tf.Variable(val) for k, val in params.items()}
        loss = m.loss(n, v, tf.constant(x), tf.constant(y), models.Arch())
    return graph, loss, list(v.values())


def rnn_graph(loops: int = 3, steps: int = 64, batch: int = 256, units: int = 128):
    import numpy as np
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        rs = np.random.RandomState(0)
        h = tf.constant(rs.randn(steps, batch, units).astype(np.float32))
        ws = []
        for _ in range(loops):
            W = tf.Variable(rs.randn(units, 4 * units).astype(np.float32) * 0.1)
            U = tf.Variable(rs.randn(units, 4 * units).astype(np.float32) * 0.1)
            ws += [W, U]

            def cell(hc, x_t, W=W, U=U):
                i, f, o, g = tf.split(tf.matmul(x_t, W) + tf.matmul(hc[0], U), 4, axis=1)
                c = tf.sigmoid(f) * hc[1] + tf.sigmoid(i) * tf.tanh(g)
                return tf.sigmoid(o) * tf.tanh(c), c

            zeros = tf.zeros([batch, units])
            h, _ = tf.scan(cell, h, initializer=(zeros, zeros))
            # A projection of every step's output between loops (what a
            # TimeDistributed Dense does): activations a plan may keep.
            V = tf.Variable(rs.randn(units, units).astype(np.float32) * 0.1)
            ws.append(V)
            h = tf.nn.relu(tf.einsum("tbu,uv->tbv", h, V))
        loss = tf.reduce_mean(tf.square(h))
    return graph, loss, ws


def one_call(make, method: str) -> tuple[float, int, int]:
    """(CPU seconds, ops added, ops recomputed) of one gradients call on a fresh graph."""
    import tensorflow as tf

    import memsave

    graph, loss, ws = make()
    before = len(graph.get_operations())
    # The graphs of earlier calls are garbage with reference cycles: collected
    # here, not by a collection that happens to fall inside the timed call.
    gc.collect()
    with graph.as_default():
        t = time.process_time()
        if method == "tf":
            tf.gradients(loss, ws)
        else:
            memsave.gradients(loss, ws, checkpoints="memory")
        dt = time.process_time() - t
    added = graph.get_operations()[before:]
    copies = sum(1 for op in added if "/recompute_" in op.name and "/gradients" not in op.name
                 and op.type in ("MatMul", "Tanh", "Conv2D", "Relu", "FusedBatchNormV3"))
    return dt, len(added), copies


def measure(makes: list, repeats: int) -> list[dict]:
    """Per graph maker: the median seconds of each method, the median of the
    pairs' ratios (``ratio``) and the samples (``samples``). Each repeat
    times every graph in turn, the two methods back to back: graphs timed in
    one run share its slow spells, repeat by repeat."""
    for make in makes:
        one_call(make, "tf")  # warm-up: TensorFlow's lazy imports and caches
    out = [{"samples": {"tf": [], "memsave": []}, "info": {}} for _ in makes]
    for _ in range(repeats):
        for make, r in zip(makes, out):
            for method, s in r["samples"].items():
                dt, ops, copies = one_call(make, method)
                s.append(dt)
                r["info"][method] = (ops, copies)
    for r in out:
        s = r["samples"]
        r["ratio"] = statistics.median(m / t for t, m in zip(s["tf"], s["memsave"]))
        r.update({m: statistics.median(v) for m, v in s.items()})
    return out


def growth(small: dict, large: dict, method: str) -> float:
    """The median over the repeats of ``large``'s time over ``small``'s in the same repeat."""
    return statistics.median(b / a for a, b in zip(small["samples"][method],
                                                    large["samples"][method]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1000, 2000])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-resnet", action="store_true")
    p.add_argument("--no-rnn", action="store_true")
    args = p.parse_args(argv)
    import logging

    logging.getLogger("memsave").setLevel(logging.ERROR)  # the fallback's warning, once per call

    # Each batch's chain sizes in one group (timed in turn within each
    # repeat, for the growth); the ResNet and the RNN alone.
    groups = [[(f"chain {n} [{b}, 16]", (lambda n=n, b=b: chain_graph(n, b)), (n, b))
               for n in args.layers] for b in args.batches]
    if not args.no_resnet:
        groups.append([("resnet-110 (batch 32)", resnet_graph, "resnet")])
    if not args.no_rnn:
        groups.append([("rnn 3 loops (T 64, batch 256)", rnn_graph, "rnn")])
    print(f"CPU seconds of the gradients call, median of {args.repeats} (the ratio: median of "
          f"the {args.repeats} pairs' ratios), load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| graph | tf.gradients s | memsave s | memsave / tf | tf ops | memsave ops | copies |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for group in groups:
        for (label, _, key), r in zip(group, measure([make for _, make, _ in group], args.repeats)):
            results[key] = r
            (tf_ops, _), (ms_ops, copies) = r["info"]["tf"], r["info"]["memsave"]
            print(f"| {label} | {r['tf']:.2f} | {r['memsave']:.2f} | {r['ratio']:.2f} | {tf_ops} | "
                  f"{ms_ops} | {copies} |", flush=True)
    if len(args.layers) >= 2:
        n1, n2 = args.layers[0], args.layers[-1]
        print()
        for b in args.batches:
            small, large = results[(n1, b)], results[(n2, b)]
            # tf.gradients' own growth beside it: what the machine and
            # TensorFlow give, measured in the same repeats.
            grow = growth(small, large, "memsave")
            print(f"[{b}, 16]: memsave({n2}) / memsave({n1}) = {grow:.2f} "
                  f"(linear: {n2 / n1:.2f}; bound {LINEAR * n2 / 2 / n1:.2f}; "
                  f"tf.gradients: {growth(small, large, 'tf'):.2f}), median of the repeats' ratios")
    return 0


if __name__ == "__main__":
    sys.exit(main())
