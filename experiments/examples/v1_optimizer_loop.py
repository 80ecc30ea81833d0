"""A tf.compat.v1 Session training loop whose optimizer goes through memsave.

The model code and the training loop are plain TF1 style: placeholders, a
deep MLP, ``tf.compat.v1.train.AdamOptimizer().minimize(loss)``, a Session
fed with ``feed_dict``. The only change memsave asks for is to build the
train op inside ``memsave.patch``::

    with memsave.patch(checkpoints="memory"):
        train_op = optimizer.minimize(loss)

The optimizer calls ``tf.gradients`` (as every tf.compat.v1 optimizer does
in ``compute_gradients``), which the patch routes through memsave; the
slot variables, ``var_list``, ``gate_gradients`` and ``global_step`` work as
before. Leaving the ``with`` block restores tf.gradients; the train op keeps
its checkpointed gradients.

The script trains the same model from the same weights twice, with plain
tf.gradients and under memsave.patch, and prints each step's loss and the
CPU allocator's peak during the steps (``tf.config.experimental.
get_memory_info``). Runs in a few seconds::

    python experiments/examples/v1_optimizer_loop.py
    python experiments/examples/v1_optimizer_loop.py --layers 64 --optimizer momentum
"""

from __future__ import annotations

import argparse
import os
import contextlib

# Peaks are read from the CPU allocator's statistics, kept only with oneDNN
# on (off by default on CPUs without AVX-512): see experiments/allocator.py.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import memsave  # noqa: E402

MiB = 1 << 20

OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.02, 0.9),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(1e-3),
}


def build_model(x, layers, width):
    """A deep tanh MLP: every layer's output is an activation the backward pass needs."""
    h = x
    for i in range(layers):
        w = tf.compat.v1.get_variable(
            f"w{i}", [width, width],
            initializer=tf.compat.v1.initializers.random_normal(stddev=width ** -0.5, seed=i))
        b = tf.compat.v1.get_variable(f"b{i}", [width], initializer=tf.compat.v1.zeros_initializer())
        h = tf.tanh(tf.matmul(h, w) + b)
    return h


def batches(args):
    """Synthetic regression data: targets from a fixed random teacher, so the loss can fall."""
    rs = np.random.RandomState(0)
    teacher = rs.randn(args.width, args.width).astype(np.float32) / np.sqrt(args.width)
    for _ in range(args.steps):
        x = rs.randn(args.batch, args.width).astype(np.float32)
        yield x, np.tanh(x @ teacher)


def train(args, checkpoints):
    """Train for args.steps steps; (losses, median peak bytes over the steps after the first)."""
    graph = tf.Graph()
    with graph.as_default():
        # The batch size in the shape, not None: memsave plans for the sizes it
        # can see, and at batch 1 'memory' would find nothing worth saving.
        x = tf.compat.v1.placeholder(tf.float32, [args.batch, args.width], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [args.batch, args.width], name="y")
        loss = tf.reduce_mean(tf.square(build_model(x, args.layers, args.width) - y))
        optimizer = OPTIMIZERS[args.optimizer]()
        global_step = tf.compat.v1.train.get_or_create_global_step()
        patch = memsave.patch(checkpoints=checkpoints) if checkpoints else contextlib.nullcontext()
        with patch:
            train_op = optimizer.minimize(loss, global_step=global_step)
        init = tf.compat.v1.global_variables_initializer()

    losses, peaks = [], []
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        for xb, yb in batches(args):
            tf.config.experimental.reset_memory_stats("CPU:0")
            value, _ = sess.run([loss, train_op], {x: xb, y: yb})
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            losses.append(float(value))
    return losses, float(np.median(peaks[1:] or peaks))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--checkpoints", default="memory",
                        help="memsave strategy: memory, speed or collection (default memory)")
    args = parser.parse_args(argv)

    plain_losses, plain_peak = train(args, None)
    losses, peak = train(args, args.checkpoints)

    print(f"{args.optimizer} on a {args.layers}-layer MLP, batch {args.batch} x {args.width}")
    print(f"{'step':>4}  {'tf.gradients':>12}  {'memsave':>12}")
    for k, (a, b) in enumerate(zip(plain_losses, losses)):
        print(f"{k:>4}  {a:12.6f}  {b:12.6f}")
    diff = max(abs(a - b) for a, b in zip(plain_losses, losses))
    print(f"max |loss difference|: {diff:.2e}")
    print(f"peak memory: tf.gradients {plain_peak / MiB:.1f} MiB, "
          f"memsave({args.checkpoints!r}) {peak / MiB:.1f} MiB ({peak / plain_peak:.2f}x)")


if __name__ == "__main__":
    main()
