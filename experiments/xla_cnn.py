"""Does memsave's saving survive XLA on a real CNN? (issue 10, item 2)

Which step: a custom loop whose compiled function takes the gradients,
applies them with SGD (the update inside the step) and also returns a
digest of every gradient, which holds each gradient to a reduction. A
training step returns its loss only: ``xla_train.py`` (issue 18, this
experiment's successor) measures that, with SGD, Adam and loss scaling, in
a custom loop and in Keras ``fit``, on ResNet50 and MobileNetV2, and
checks the forecast.

One custom training step on ``keras.applications.ResNet50(weights=None,
input_shape=(S, S, 3), classes=10)``: forward, softmax cross-entropy, the
gradients of the loss with respect to ``model.trainable_weights`` by
``tf.gradients`` ("plain") or ``memsave.gradients(..., checkpoints='memory')``,
and an SGD update, in a ``tf.function`` with and without ``jit_compile=True``. Each
configuration runs in a fresh Python process (the allocator peak counts
every live tensor of the process): build the model, trace and run the
step once (compilation, warm-up), then ``RUNS`` times between
``reset_memory_stats('CPU:0')`` and ``get_memory_info('CPU:0')['peak']``.

"resident" is the allocator's ``current`` before the measured step (the
weights, the batch, anything the runtime keeps between steps); "above" is
peak - resident. Ratios are memsave / plain of the same XLA setting.

    .venv/bin/python experiments/xla_cnn.py                       # table, batch 32
    .venv/bin/python experiments/xla_cnn.py --batch 8 16 32 --repeats 2
    .venv/bin/python experiments/xla_cnn.py --one plain xla 32    # one process, JSON

Why pre-split: under XLA every method's step peak reads as the same power
of two unless the CPU allocator's pool was split first; see
``allocator.py`` (shared with ``applications.py``). For a step that returns
the gradients, ResNet50 at batch 32 needs 249 MiB of XLA temporaries under
tf.gradients and 184 MiB under memsave before commit 6843059 (141 MiB
after): both of the first two were counted as 256 MiB, and the measured
peaks were equal to the byte. At batch 16 (this step, default allocator)
plain and memsave both read 256.4 MiB above resident, the issue's "256.00
MiB for plain and memsave alike". Pass ``--presplit-mib 0`` to see the
quantised figures.

Measured (TF 2.21 CPU, oneDNN on, 64x64, batch 32, pre-split, commit
6843059; "peak (each process)", MiB; 2 fresh processes, median of 2 steps):

    | XLA   | method | peak                  | above resident | peak ratio | above ratio |
    | xla   | plain  | 431.6 (431.6, 431.6)  | 340.3          | 1.00       | 1.00        |
    | xla   | memory | 305.9 (306.9, 304.9)  | 215.6          | 0.71       | 0.63        |
    | xla   | memory at bf35940 (before) | 364.6 (1 process) | 273.3 | 0.84 | 0.80 |
    | xla   | memory at 552cc20  | 271.8 (271.8, 271.8) | 180.5 | 0.63 | 0.53 |
    | noxla | plain  | 367.0 (366.6, 367.3)  | 267.5          | 1.00       | 1.00        |
    | noxla | memory | 216.9 (220.0, 213.8)  | 121.7          | 0.59       | 0.45        |
    | xla   | blocks | 258.2 (1 process)     | 166.9          | 0.60       | 0.49        |
    | noxla | blocks | 204.4 (1 process)     | 103.3          | 0.56       | 0.40        |

At 552cc20 the simulator counts the weight copies the rewrite gates under
XLA when it picks 'memory''s plan (plain 431.6 in both processes, gradient
digests equal to plain's: relative error 0).

At batch 16 under XLA (1 process each): plain 314.7 (225.4 above
resident), memory 244.8 (154.5 above, 0.69); with ``--presplit-mib 0``
both read 351.7 (256.4 above). "blocks" keeps the 16 bottleneck block
outputs (an explicit list): what 'memory' would keep if its articulation
candidates were restricted to cuts between the input and the loss.

The step also returns digests of the gradients (per output channel sums
and the sum of squares of each); the first step's (at the initial weights)
are compared between memsave and plain of the same setting, relative to
the largest digest entry ("grad rel err").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from allocator import PRESPLIT_MIB, presplit_cpu_pool

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

MiB = 1 << 20
SEED = 0
LEARNING_RATE = 0.01

#: Names of the Relu ops that end ResNet50's bottleneck blocks (method "blocks").
BLOCK_OUTPUT = re.compile(r"_block\d+_out(_\d+)?/Relu$")

CLASSES = 10


def _one(method: str, xla: bool, batch: int, size: int, runs: int, dump: str | None,
         presplit_mib: int) -> dict:
    import numpy as np
    import tensorflow as tf
    import keras

    import memsave

    presplit_cpu_pool(presplit_mib)  # first: see "Why pre-split"

    keras.utils.set_random_seed(SEED)
    model = keras.applications.ResNet50(
        weights=None, input_shape=(size, size, 3), classes=CLASSES
    )
    rng = np.random.default_rng(SEED)
    x = tf.constant(rng.normal(size=(batch, size, size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, CLASSES, size=(batch,)))
    weights = model.trainable_weights
    opt = keras.optimizers.SGD(LEARNING_RATE)
    opt.build(weights)

    def step(x, y):
        logits = model(x, training=True)
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )
        if method == "plain":
            grads = tf.gradients(loss, weights)
        elif method == "blocks":
            # The 16 bottleneck block outputs: the graph's true cuts (what
            # 'memory' would choose with articulation points restricted to
            # cuts between the input and the loss; see the report of issue 10).
            graph = tf.compat.v1.get_default_graph()
            blocks = [op.outputs[0] for op in graph.get_operations()
                      if op.type == "Relu" and BLOCK_OUTPUT.search(op.name)]
            grads = memsave.gradients(loss, weights, checkpoints=blocks)
        else:
            grads = memsave.gradients(loss, weights, checkpoints=method)
        # Digests of every gradient (its sums over all axes but the last,
        # and its sum of squares): a wrong entry shows in them.
        digest = tf.concat(
            [tf.concat([tf.reshape(tf.reduce_sum(g, list(range(g.shape.rank - 1))), [-1]),
                        tf.reshape(tf.reduce_sum(g * g), [1])], 0) for g in grads], 0)
        opt.apply(grads, weights)
        return loss, digest

    fn = tf.function(step, jit_compile=xla)
    # The first step (trace, compile, warm-up) runs at the initial weights:
    # its digests are the ones compared between methods.
    digest = fn(x, y)[1].numpy().copy()
    peaks, residents = [], []
    for _ in range(runs):
        resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        fn(x, y)[0].numpy()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
        residents.append(resident)
    if dump:
        np.save(dump, digest)
    return {
        "method": method, "xla": xla, "batch": batch, "size": size,
        "peak_bytes": statistics.median(peaks), "resident_bytes": statistics.median(residents),
        "peaks_bytes": peaks,
    }


def _spawn(method, xla, batch, size, runs, presplit_mib, dump=None) -> dict:
    cmd = [sys.executable, __file__, "--one", method, "xla" if xla else "noxla", str(batch),
           "--size", str(size), "--runs", str(runs), "--presplit-mib", str(presplit_mib)]
    if dump:
        cmd += ["--dump", dump]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _grad_error(a: str, b: str) -> float:
    """Largest difference of the gradient digests, relative to the largest digest entry."""
    import numpy as np

    da, db = np.load(a), np.load(b)
    return float(np.max(np.abs(da - db)) / max(float(np.max(np.abs(da))), 1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", nargs=3, metavar=("METHOD", "XLA", "BATCH"))
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="measured steps per process (median)")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per configuration")
    p.add_argument("--methods", nargs="+", default=["memory"],
                   help="memsave strategies, or 'blocks': the block outputs as an explicit list")
    p.add_argument("--xla", nargs="+", default=["xla", "noxla"], choices=["xla", "noxla"])
    p.add_argument("--presplit-mib", type=int, default=PRESPLIT_MIB,
                   help="allocate and free this many MiB first (0: measure the allocator as it comes)")
    p.add_argument("--dump", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        method, xla, batch = a.one
        print(json.dumps(_one(method, xla == "xla", int(batch), a.size, a.runs, a.dump,
                              a.presplit_mib)))
        return

    # Each configuration's first process dumps its gradients into a temporary
    # directory, compared with plain's there; it goes once the table is printed.
    with tempfile.TemporaryDirectory(prefix="xla_cnn_") as tmpdir:
        _print_table(a, os.path.join(tmpdir, "grads"))


def _print_table(a: argparse.Namespace, tmp: str) -> None:
    """Measure every configuration of ``a`` and print one row each; gradients go to ``tmp``_*.npy."""
    print("| XLA | batch | method | peak MiB | resident MiB | above MiB | peak ratio | above ratio | grad rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for xla_name in a.xla:
        xla = xla_name == "xla"
        for batch in a.batch:
            rows = {}
            for method in ["plain", *a.methods]:
                rs = []
                for r in range(a.repeats):
                    dump = f"{tmp}_{method}_{xla_name}_{batch}.npy" if r == 0 else None
                    rs.append(_spawn(method, xla, batch, a.size, a.runs, a.presplit_mib, dump))
                    print(f"  {xla_name} b{batch} {method}: peaks {[round(v / MiB, 1) for v in rs[-1]['peaks_bytes']]}"
                          f" resident {rs[-1]['resident_bytes'] / MiB:.1f}", file=sys.stderr, flush=True)
                rows[method] = rs
            base = rows["plain"]
            bp = statistics.median(r["peak_bytes"] for r in base)
            bres = statistics.median(r["resident_bytes"] for r in base)
            for method, rs in rows.items():
                pk = statistics.median(r["peak_bytes"] for r in rs)
                res = statistics.median(r["resident_bytes"] for r in rs)
                err = "" if method == "plain" else "%.1e" % _grad_error(
                    f"{tmp}_plain_{xla_name}_{batch}.npy", f"{tmp}_{method}_{xla_name}_{batch}.npy")
                above_ratio = (pk - res) / (bp - bres) if bp > bres else float("nan")
                each = ", ".join("%.1f" % (r["peak_bytes"] / MiB) for r in rs)
                print(f"| {xla_name} | {batch} | {method} | {pk / MiB:.1f} ({each}) | {res / MiB:.1f} | "
                      f"{(pk - res) / MiB:.1f} | {pk / bp:.2f} | {above_ratio:.2f} | {err} |", flush=True)


if __name__ == "__main__":
    main()
