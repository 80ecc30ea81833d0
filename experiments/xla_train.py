"""Does memsave's saving survive XLA in a training step that updates the weights? (issue 18)

The step measured is what a user compiles: forward, loss, gradients and the
optimizer's update of every weight, all in one ``jit_compile=True`` cluster.
Two forms:

* ``loop``: a custom loop, ``tf.function(step, jit_compile=XLA)`` whose step
  computes the loss of ``model(x, training=True)``, takes
  ``tf.gradients(loss, weights)`` ("plain") or ``memsave.gradients(loss,
  weights, checkpoints=METHOD)`` and applies them with
  ``optimizer.apply(grads, weights)``; with ``--optimizer lossscale`` under
  the ``mixed_float16`` policy, the loss is ``optimizer.scale_loss``'d and
  ``keras.optimizers.LossScaleOptimizer`` (around SGD) unscales and skips
  non-finite steps.
* ``fit``: ``model.compile(optimizer, loss, jit_compile=XLA)`` and
  ``model.fit`` ("plain": Keras' own train step with ``tf.GradientTape``;
  a method: through ``memsave.keras.checkpointed(model, METHOD)``).

Models: ``keras.applications`` ResNet50 / MobileNetV2 (``weights=None``,
64x64x3, 10 classes, logits), batch 32, seeded random data (one batch per
step). Each configuration runs in a fresh process, which pre-splits the CPU
allocator's pool (``allocator.py``: otherwise XLA's one temporary buffer is
counted as the power-of-two region it lands in; ``--presplit-mib 0`` shows
that), runs one step (trace, compile, warm-up), then ``STEPS - 1`` more,
each between ``reset_memory_stats('CPU:0')`` and ``get_memory_info``:

* ``resident``: the allocator's ``current`` before a step (weights,
  optimizer slots, the batch); ``above``: its peak minus that; the
  ratio of a method is its ``above`` over plain's (same form, optimizer and
  XLA setting); "vs no XLA" divides the XLA ratio by the same step's ratio
  without XLA;
* the first ``STEPS`` losses, compared with plain's (largest relative
  difference);
* the gradients at the initial weights, from a separate compiled function
  that takes them the same way (custom loop only), compared with plain's:
  largest ``max|g - g_plain| / max|g_plain|`` over the weights whose
  gradient is not zero but for rounding (``NEGLIGIBLE_GRADIENT_FRACTION``).
  What rounding does here: on MobileNetV2 (64x64, batch 32) plain's own
  gradients under XLA and without differ by up to 0.23 (block_13_expand_BN
  beta; 0.13 on Conv_1's kernel): its last blocks normalise 2x2 maps, and
  a different order of sums moves the batch statistics. memsave's under
  XLA differ from plain XLA's by at most 0.05 (Conv_1's kernel), and so do
  the losses after the first update;
* ``forecast``: ``memsave.plan`` (custom loop) or ``memsave.keras.plan``
  (fit) of the same step, and its error against the measured peak.

    .venv/bin/python experiments/xla_train.py                        # the must-show table
    .venv/bin/python experiments/xla_train.py --models ResNet50 --optimizers sgd --forms loop
    .venv/bin/python experiments/xla_train.py --one ResNet50 sgd memory xla loop   # one process, JSON
    .venv/bin/python experiments/xla_train.py --one ResNet50 sgd memory xla loop --dump /tmp/d
        # and XLA's buffer assignment of the step in /tmp/d (*buffer-assignment.txt)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from allocator import PRESPLIT_MIB, presplit_cpu_pool

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

MiB = 1 << 20
SEED = 0
CLASSES = 10
STEPS = 5
LEARNING_RATE = 0.01
CHILD_TIMEOUT_S = 3600

MODELS = ("ResNet50", "MobileNetV2")
OPTIMIZERS = ("sgd", "adam", "lossscale")
FORMS = ("loop", "fit")


def _optimizer(name: str):
    import keras

    if name == "sgd":
        return keras.optimizers.SGD(LEARNING_RATE)
    if name == "adam":
        return keras.optimizers.Adam(1e-3)
    if name == "lossscale":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LEARNING_RATE))
    raise ValueError(name)


def _data(batch: int, size: int, steps: int):
    import numpy as np

    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(steps * batch, size, size, 3)).astype("float32")
    y = rng.integers(0, CLASSES, size=(steps * batch,)).astype("int32")
    return x, y


def _one(a) -> dict:
    import numpy as np
    import tensorflow as tf
    import keras

    import memsave
    import memsave.keras

    presplit_cpu_pool(a.presplit_mib)  # first: see allocator.py
    model_name, opt_name, method, xla_name, form = a.one
    xla = xla_name == "xla"
    if opt_name == "lossscale":
        keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(SEED)
    model = getattr(keras.applications, model_name)(
        weights=None, input_shape=(a.size, a.size, 3), classes=CLASSES, classifier_activation=None)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    xs, ys = _data(a.batch, a.size, STEPS)
    opt = _optimizer(opt_name)
    out = dict(model=model_name, optimizer=opt_name, method=method, xla=xla, form=form,
               batch=a.batch, size=a.size)
    if form == "loop":
        out.update(_loop(a, model, opt, method, xla, xs, ys))
    else:
        out.update(_fit(a, model, opt, method, xla, xs, ys))
    return out


def _loss_fn(y, logits):
    import tensorflow as tf

    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.cast(logits, tf.float32)))


def _loop(a, model, opt, method, xla, xs, ys) -> dict:
    import numpy as np
    import tensorflow as tf

    import memsave

    weights = model.trainable_weights
    opt.build(weights)
    # The optimizer's slots and counters: resident, besides what the graph reads.
    counted = memsave.MemoryModel().allocator.counted
    slots = sum(counted(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size) for v in opt.variables)

    def gradients(loss):
        if method == "plain":
            return tf.gradients(loss, weights)
        return memsave.gradients(loss, weights, checkpoints=method, extra_resident_bytes=slots)

    def step(x, y):
        loss = _loss_fn(y, model(x, training=True))
        scaled = opt.scale_loss(loss)
        opt.apply(gradients(scaled), weights)
        return loss

    def grads_only(x, y):
        loss = _loss_fn(y, model(x, training=True))
        return gradients(loss)

    # The gradients at the initial weights (a separate function, so the
    # measured step returns only its loss, as a training step does).
    x0, y0 = tf.constant(xs[:a.batch]), tf.constant(ys[:a.batch])
    g0 = [np.array(g, copy=True) for g in tf.function(grads_only, jit_compile=xla)(x0, y0)]
    plan = {}
    if method != "plain":
        def planned(x, y):
            loss = opt.scale_loss(_loss_fn(y, model(x, training=True)))
            p = memsave.plan(loss, weights, checkpoints=method, extra_resident_bytes=slots)
            plan.update(forecast_bytes=p.predicted_peak_bytes,
                        baseline_forecast_bytes=p.baseline_peak_bytes,
                        checkpoints=len(p.checkpoints))
            return loss
        tf.function(planned, jit_compile=xla).get_concrete_function(
            tf.TensorSpec(x0.shape, x0.dtype), tf.TensorSpec(y0.shape, y0.dtype))
    fn = tf.function(step, jit_compile=xla)
    losses, peaks, residents = [], [], []
    for k in range(STEPS):
        x = tf.constant(xs[k * a.batch:(k + 1) * a.batch])
        y = tf.constant(ys[k * a.batch:(k + 1) * a.batch])
        resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        losses.append(float(fn(x, y).numpy()))
        if k:  # step 0 traces, compiles and warms up
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            residents.append(resident)
    if a.save:
        np.savez(a.save, *g0)
    return dict(losses=losses, peaks_bytes=peaks, residents_bytes=residents,
                peak_bytes=statistics.median(peaks), resident_bytes=statistics.median(residents),
                **plan)


def _fit(a, model, opt, method, xla, xs, ys) -> dict:
    import tensorflow as tf
    import keras

    import memsave.keras

    if method != "plain":
        memsave.keras.checkpointed(model, checkpoints=method)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=xla)
    plan = {}
    if method != "plain":
        p = memsave.keras.plan(model, xs[:a.batch], ys[:a.batch], checkpoints=method)
        plan.update(forecast_bytes=p.predicted_peak_bytes,
                    baseline_forecast_bytes=p.baseline_peak_bytes, checkpoints=len(p.checkpoints))

    losses, peaks, residents = [], [], []

    class Measure(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            residents.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, batch, logs=None):
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            losses.append(float(logs["loss"]))

    model.fit(xs, ys, batch_size=a.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[Measure()])
    peaks, residents = peaks[1:], residents[1:]  # the first step traces, compiles, warms up
    return dict(losses=losses, peaks_bytes=peaks, residents_bytes=residents,
                peak_bytes=statistics.median(peaks), resident_bytes=statistics.median(residents),
                **plan)


def _spawn(a, config: tuple, save: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", *config,
           "--size", str(a.size), "--batch", str(a.batch), "--presplit-mib", str(a.presplit_mib)]
    if save:
        cmd += ["--save", save]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                         timeout=CHILD_TIMEOUT_S)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


#: Weights whose largest gradient entry is below this fraction of the
#: largest of all are left out of the gradient comparison: their gradient is
#: zero but for rounding (MobileNetV2's project_BN betas: each feeds a
#: convolution followed by a batch norm, which removes a per-channel shift;
#: measured 1e-8 to 4e-6 against 0.6 for the largest weight gradient).
NEGLIGIBLE_GRADIENT_FRACTION = 1e-4


def _grad_error(a: str, b: str) -> float:
    """Largest over the weights of max|g_b - g_a| / max|g_a| (negligible
    gradients left out: :data:`NEGLIGIBLE_GRADIENT_FRACTION`)."""
    import numpy as np

    with np.load(a) as fa, np.load(b) as fb:
        pairs = [(fa[k].astype(np.float64), fb[k].astype(np.float64)) for k in fa.files]
    largest = max(float(np.max(np.abs(ga))) for ga, _ in pairs)
    err = 0.0
    for ga, gb in pairs:
        scale = float(np.max(np.abs(ga)))
        if scale >= NEGLIGIBLE_GRADIENT_FRACTION * largest:
            err = max(err, float(np.max(np.abs(ga - gb))) / scale)
    return err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", nargs=5, metavar=("MODEL", "OPTIMIZER", "METHOD", "XLA", "FORM"))
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--optimizers", nargs="+", default=["sgd", "adam"], choices=OPTIMIZERS)
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    p.add_argument("--methods", nargs="+", default=["memory"])
    p.add_argument("--xla", nargs="+", default=["noxla", "xla"], choices=["xla", "noxla"])
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--presplit-mib", type=int, default=PRESPLIT_MIB,
                   help="allocate and free this many MiB first (0: the allocator as it comes)")
    p.add_argument("--jsonl", help="append every process's result to this file (JSON lines)")
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--dump", help="XLA dump directory for --one (buffer assignment, HLO)")
    a = p.parse_args()
    if a.one:
        if a.dump:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_dump_to={a.dump} --xla_dump_hlo_as_text").strip()
        print(json.dumps(_one(a)))
        return
    with tempfile.TemporaryDirectory(prefix="xla_train_") as tmp:
        _table(a, tmp)


def _table(a, tmp: str) -> None:
    print("| model | optimizer | form | XLA | method | peak MiB | resident MiB | above MiB | "
          "above ratio | vs no XLA | forecast MiB (err) | loss rel diff | grad rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in a.models:
        for opt in a.optimizers:
            for form in a.forms:
                ratios = {}
                for xla in a.xla:
                    rows = {}
                    for method in ["plain", *a.methods]:
                        save = os.path.join(tmp, f"{model}_{opt}_{form}_{xla}_{method}.npz") \
                            if form == "loop" else None
                        rows[method] = r = _spawn(a, (model, opt, method, xla, form), save)
                        if a.jsonl:
                            with open(a.jsonl, "a") as f:
                                f.write(json.dumps(r) + "\n")
                        print(f"  {model} {opt} {form} {xla} {method}: peaks "
                              f"{[round(v / MiB, 1) for v in r['peaks_bytes']]} resident "
                              f"{r['resident_bytes'] / MiB:.1f}", file=sys.stderr, flush=True)
                    base = rows["plain"]
                    base_above = base["peak_bytes"] - base["resident_bytes"]
                    for method, r in rows.items():
                        above = r["peak_bytes"] - r["resident_bytes"]
                        ratio = above / base_above
                        ratios[xla, method] = ratio
                        vs = ""
                        if xla == "xla" and ("noxla", method) in ratios:
                            vs = f"{ratio / ratios['noxla', method]:.2f}"
                        fc = ""
                        if r.get("forecast_bytes"):
                            fc = (f"{r['forecast_bytes'] / MiB:.1f} "
                                  f"({r['forecast_bytes'] / r['peak_bytes'] - 1:+.0%})")
                        loss_diff = max(abs(u - v) / max(abs(v), 1e-30)
                                        for u, v in zip(r["losses"], base["losses"]))
                        grad = ""
                        if form == "loop" and method != "plain":
                            grad = "%.1e" % _grad_error(
                                os.path.join(tmp, f"{model}_{opt}_{form}_{xla}_plain.npz"),
                                os.path.join(tmp, f"{model}_{opt}_{form}_{xla}_{method}.npz"))
                        print(f"| {model} | {opt} | {form} | {xla} | {method} | "
                              f"{r['peak_bytes'] / MiB:.1f} | {r['resident_bytes'] / MiB:.1f} | "
                              f"{above / MiB:.1f} | {ratio:.2f} | {vs} | {fc} | "
                              f"{loss_diff:.1e} | {grad} |", flush=True)


if __name__ == "__main__":
    main()
