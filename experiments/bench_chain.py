"""Acceptance benchmark: peak memory on a tanh(matmul) chain.

Memory. A chain of ``--layers`` (36) layers ``h = tanh(h @ w_i)`` on a
``[--batch, --width]`` = [4096, 256] float32 input (4 MiB activations),
loss ``sum(h * h)``. For each mode (a tf.compat.v1 Graph run by a Session,
a ``tf.function``, a ``tf.function(jit_compile=True)``) and each method

- ``tf.gradients``        the baseline every ratio is taken against
- ``memsave-memory``      ``memsave.gradients(..., checkpoints='memory')``
- ``recompute_grad``      ``tf.recompute_grad`` on hand-made segments of
                          ``--segment`` layers (sqrt(36) = 6), differentiated
                          by ``tf.GradientTape``: what a user would write
                          without memsave
- ``GradientTape``        the tape without recomputation, for reference

a fresh Python process builds one step, runs it once to warm up, then
``--repeats`` times between ``tf.config.experimental.reset_memory_stats``
and ``get_memory_info('CPU:0')['peak']``, and reports the median peak. A
fresh process per measurement keeps one method's tensors out of another's
peak. The step returns the sum of squares of every gradient: each gradient
is consumed as soon as it is computed, as an optimizer's update would
consume it. (Fetching all gradients instead holds them to the end of the
step; the backward pass peaks early for tf.gradients but late for a
checkpointing method, so that raised memsave's peak, on a 20-layer chain of
1 MiB activations, from about 0.55 to 0.65 of tf.gradients'.) ``grad diff`` compares those sums with tf.gradients' (relative,
largest over layers): it shows that each method computed the same gradients.
Step times are not reported: measured in separate processes on a shared
machine they move up to 2x; experiments/study.py measures them
round-robin in one process.

Build time is measured by experiments/bench_build.py.

Usage::

    .venv/bin/python experiments/bench_chain.py           # about 3 minutes on 2 cores
    .venv/bin/python experiments/bench_chain.py --quick   # about a minute

Prints Markdown tables to stdout, progress to stderr. Exits 1 if a
measurement failed or a method's gradients differ from tf.gradients'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

MiB = 1 << 20
MODES = ("session", "function", "xla")
METHODS = ("tf.gradients", "memsave-memory", "recompute_grad", "GradientTape")

#: float32 sums of squares of the same gradients, summed in another order:
#: far below this; a wrong gradient is off by orders of magnitude more.
GRAD_DIFF_LIMIT = 1e-4


# -- one measurement (child process) ---------------------------------------------------


def _chain_loss(ws, x, method, segment):
    """The loss of the chain; recompute_grad wraps each run of ``segment`` layers."""
    import tensorflow as tf

    h = x
    if method == "recompute_grad":
        for start in range(0, len(ws), segment):
            block = ws[start:start + segment]

            def run_block(h, block=block):
                for w in block:
                    h = tf.tanh(tf.matmul(h, w))
                return h

            h = tf.recompute_grad(run_block)(h)
    else:
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


def _step(ws, x, method, segment):
    """Gradients of the chain's loss by ``method``, reduced to one sum of squares each."""
    import tensorflow as tf

    import memsave

    if method in ("recompute_grad", "GradientTape"):
        with tf.GradientTape() as tape:
            loss = _chain_loss(ws, x, method, segment)
        grads = tape.gradient(loss, ws)
    else:
        loss = _chain_loss(ws, x, method, segment)
        if method == "tf.gradients":
            grads = tf.gradients(loss, ws)
        else:
            grads = memsave.gradients(loss, ws, checkpoints="memory")
    return tf.stack([tf.reduce_sum(g * g) for g in grads])


def measure(mode, method, layers, batch, width, segment, repeats):
    """Median peak bytes over ``repeats`` runs after a warm-up, and the gradient digest."""
    import numpy as np
    import tensorflow as tf

    rs = np.random.RandomState(0)
    w_np = [(rs.randn(width, width) / np.sqrt(width)).astype(np.float32) for _ in range(layers)]
    x_np = rs.randn(batch, width).astype(np.float32)

    if mode == "session":
        graph = tf.Graph()
        with graph.as_default():
            ws = [tf.Variable(w) for w in w_np]
            out = _step(ws, tf.constant(x_np), method, segment)
            init = tf.compat.v1.global_variables_initializer()
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(init)
        run = lambda: sess.run(out)  # noqa: E731
    else:
        ws = [tf.Variable(w) for w in w_np]
        x = tf.constant(x_np)
        fn = tf.function(lambda: _step(ws, x, method, segment), jit_compile=(mode == "xla"))
        run = lambda: fn().numpy()  # noqa: E731

    digest = np.array(run(), copy=True)  # warm-up: tracing, compiling, first run
    peaks = []
    for _ in range(repeats):
        tf.config.experimental.reset_memory_stats("CPU:0")
        digest = np.array(run(), copy=True)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    return {
        "peak_bytes": int(statistics.median(peaks)),
        "peaks_bytes": peaks,
        "digest": [float(v) for v in digest],
    }


def _measure_in_child(args, mode, method):
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child", mode, method,
        "--layers", str(args.layers), "--batch", str(args.batch), "--width", str(args.width),
        "--segment", str(args.segment), "--repeats", str(args.repeats),
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"bench_chain: {mode} {method} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- driver -----------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smaller run: 16 layers of [1024, 256]")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--segment", type=int, default=None,
                   help="layers per tf.recompute_grad segment (default: round(sqrt(layers)))")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per memory figure")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--child", nargs=2, metavar=("MODE", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.batch = 16, 1024
    if args.segment is None:
        args.segment = max(1, round(args.layers ** 0.5))

    if args.child:
        mode, method = args.child
        res = measure(mode, method, args.layers, args.batch, args.width, args.segment, args.repeats)
        print(json.dumps(res))
        return 0

    import tensorflow as tf

    ok = True
    act_MiB = args.batch * args.width * 4 / MiB
    print(f"## Peak memory: {args.layers} layers of tanh(matmul), [{args.batch}, {args.width}] "
          f"float32 activations ({act_MiB:g} MiB each), recompute_grad segments of "
          f"{args.segment} layers\n")
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeats} runs after a warm-up, "
          "each figure from a fresh process.\n")
    print("| mode | method | peak MiB | x tf.gradients | peaks of the runs | grad diff |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        results = {}
        for method in args.methods:
            print(f"measuring {mode} {method} ...", file=sys.stderr)
            results[method] = _measure_in_child(args, mode, method)
        base = results.get("tf.gradients")
        for method in args.methods:
            r = results[method]
            if r is None:
                print(f"| {mode} | {method} | failed | | | |")
                ok = False
                continue
            ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else "-"
            if base:
                diff = max(abs(a - b) / max(abs(b), 1e-30)
                           for a, b in zip(r["digest"], base["digest"]))
                ok &= diff <= GRAD_DIFF_LIMIT
                diff_s = f"{diff:.1e}"
            else:
                diff_s = "-"
            runs = " ".join(f"{b / MiB:.1f}" for b in r["peaks_bytes"])
            print(f"| {mode} | {method} | {r['peak_bytes'] / MiB:.1f} | {ratio} | {runs} | {diff_s} |")
        sys.stdout.flush()

    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
