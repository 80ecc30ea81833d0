"""Where does a training step's time go? Kernel counts and times per op type.

Builds the study's model (``models.py``) in a ``tf.compat.v1`` Graph for
each requested method, runs the SGD step in a Session a few times, then
once more with ``RunOptions(trace_level=FULL_TRACE)``, and sums the kernel
times in ``RunMetadata.step_stats`` by op type (the type is read from each
node's timeline label, so Grappler's fused kernels such as ``_FusedConv2D``
show under their own names). Prints, per method, the wall time of the
untraced steps (median), the number of executions and total kernel time of
the heaviest op types, and the ratio of each to the first method's.

By default the executor runs independent kernels in parallel on the two
cores, and each kernel's time then includes the time it shared the cores
with others; with ``--inter-op 1`` kernels run one at a time, so their
times add up to the step and show what each op type really costs.

Usage::

    .venv/bin/python experiments/profile_step.py                       # ResNet-110, batch 32
    .venv/bin/python experiments/profile_step.py --model mlp --size 128 --batch-size 2048
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

import tensorflow as tf  # noqa: E402

import models  # noqa: E402
import registry  # noqa: E402

# "[mklcpu 1.0MB 1.0MB] name = OpType(inputs)"; the bracket (allocations) is optional
LABEL_OP = re.compile(r"^(?:\[[^\]]*\]\s*)?\S+ = ([A-Za-z0-9_]+)\(")


def profile(model_name, size, batch, method, steps, inter_op=0, seed=0):
    model = models.MODELS[model_name]
    init = model.init(size, seed)
    x_np, y_np = model.batch(batch, seed)
    graph = tf.Graph()
    with graph.as_default():
        params = {k: tf.Variable(v, name=k.replace("/", "_")) for k, v in init.items()}
        variables = list(params.values())
        x, y = tf.constant(x_np), tf.constant(y_np)
        m = registry.METHODS[method]
        arch = m.arch()
        loss, grads = m.gradients(lambda: model.loss(size, params, x, y, arch), variables,
                                  {"peak_bytes": {}})
        train = tf.group([v.assign_sub(0.0 * g) for v, g in zip(variables, grads)])
        init_op = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op)
    sess = tf.compat.v1.Session(graph=graph, config=config)
    sess.run(init_op)
    sess.run([train, loss])  # Grappler, warm-up
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sess.run([train, loss])
        wall.append(time.perf_counter() - t0)
    meta = tf.compat.v1.RunMetadata()
    sess.run([train, loss],
             options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
             run_metadata=meta)
    count, micros = collections.Counter(), collections.Counter()
    for dev in meta.step_stats.dev_stats:
        for ns in dev.node_stats:
            m = LABEL_OP.match(ns.timeline_label)
            op = m.group(1) if m else ns.node_name
            count[op] += 1
            micros[op] += ns.all_end_rel_micros
    sess.close()
    return statistics.median(wall), count, micros


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet", choices=list(models.MODELS))
    p.add_argument("--size", type=int, default=18)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--methods", nargs="+", choices=list(registry.METHODS),
                   default=["GradientTape", "memsave-memory", "recompute_grad", "memsave-speed"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=14, help="op types to list")
    p.add_argument("--inter-op", type=int, default=0,
                   help="inter-op threads (1: one kernel at a time, so kernel times add up "
                        "to the step time; 0: TensorFlow's default)")
    a = p.parse_args(argv)

    res = {}
    for m in a.methods:
        print(f"profiling {m} ...", file=sys.stderr)
        res[m] = profile(a.model, a.size, a.batch_size, m, a.steps, a.inter_op)
    base = a.methods[0]
    _, bc, bt = res[base]
    total = {m: sum(t.values()) for m, (_, _, t) in res.items()}
    print(f"## {models.MODELS[a.model].label(a.size)}, batch {a.batch_size}: one SGD step in a "
          f"Session (inter-op threads: {a.inter_op or 'default'}), kernels by op type "
          f"(x: ratio to {base})\n")
    print("| method | wall ms (median) | x | kernel ms (sum) | x |")
    print("|---|---|---|---|---|")
    for m, (w, _, _) in res.items():
        print(f"| {m} | {1e3 * w:.0f} | {w / res[base][0]:.2f} | {total[m] / 1e3:.0f} | "
              f"{total[m] / total[base]:.2f} |")
    ops = sorted(set().union(*(t for _, _, t in res.values())),
                 key=lambda o: -max(t[o] for _, _, t in res.values()))[:a.top]
    print("\n| op type | " + " | ".join(f"{m} n / ms" for m in a.methods) + " |")
    print("|---|" + "---|" * len(a.methods))
    for op in ops:
        print(f"| {op} | " + " | ".join(f"{c[op]} / {t[op] / 1e3:.0f}" for _, c, t in res.values())
              + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
