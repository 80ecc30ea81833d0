"""Forecast against measurement on models that are NOT in forecast.py's registry.

The simulator must model TensorFlow's executor, not the registry's models:
this checks it on models it was not tuned on (a Keras GRU and LSTM
classifier, keras.applications MobileNetV2, DenseNet121, InceptionV3 and
EfficientNetB0 at small inputs, a tf.while_loop of matmuls in a tf.function
and in a Session). Each (model, method) is measured
in a fresh process exactly as forecast.py measures (one warm-up call, then
the median allocator peak of ``--repeats`` calls) and forecast by
``memsave.plan`` / ``memsave.keras.plan``.

Usage::

    .venv/bin/python experiments/forecast_unseen.py
    .venv/bin/python experiments/forecast_unseen.py --models while_matmuls --methods plain memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import forecast as F  # noqa: E402  (the measuring and predicting machinery)

MiB = 2**20


def _keras_rnn(layer: str, batch=256, seq=32, features=64, units=256):
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    cell = {"gru": keras.layers.GRU, "lstm": keras.layers.LSTM}[layer]
    model = keras.Sequential([keras.Input((seq, features)), cell(units), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, seq, features)).astype(np.float32)
    y = rng.integers(0, 10, size=(batch,)).astype(np.int32)
    return F.KerasCase(model, x, y)


def _mobilenet(batch=16, size=64):
    return F.keras_application("MobileNetV2", batch, size)


def _while_matmuls(batch=512, width=512, steps=6):
    """h <- relu(h W_k) for k in a tf.while_loop (W stacked, gathered per trip), no maximum_iterations."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    w_np = (rng.normal(size=(steps, width, width)) / np.sqrt(width)).astype(np.float32)
    x_np = rng.normal(size=(batch, width)).astype(np.float32)

    def make_variables():
        return {"w": tf.Variable(w_np, name="w"), "v": tf.Variable(np.eye(width, dtype=np.float32), name="v"),
                "__inputs__": (tf.constant(x_np),)}

    def forward(v):
        (x,) = v["__inputs__"]
        h0 = tf.matmul(x, v["v"])

        def body(i, h):
            return i + 1, tf.nn.relu(tf.matmul(h, tf.gather(v["w"], i)))

        _, h = tf.while_loop(lambda i, h: i < steps, body, [tf.constant(0), h0])
        loss = tf.reduce_mean(tf.square(h))
        return F._Forward(ys=loss, xs=[v["w"], v["v"]])

    return F.GraphCase(make_variables, forward, {}, (F.FUNCTION, F.SESSION))


UNSEEN = {
    "keras_gru": F.keras_entry("keras_gru", lambda: _keras_rnn("gru"), "GRU(256) seq 32, batch 256"),
    "keras_lstm": F.keras_entry("keras_lstm", lambda: _keras_rnn("lstm"), "LSTM(256) seq 32, batch 256"),
    "keras_mobilenetv2": F.keras_entry("keras_mobilenetv2", _mobilenet, "MobileNetV2 64x64, batch 16"),
    # Dense and inception blocks: skips everywhere, no articulation points
    # inside a block; EfficientNet: squeeze-excite multiplies and swish.
    "keras_densenet121": F.keras_entry(
        "keras_densenet121", lambda: F.keras_application("DenseNet121", 8, 64),
        "DenseNet121 64x64, batch 8"),
    "keras_inceptionv3": F.keras_entry(
        "keras_inceptionv3", lambda: F.keras_application("InceptionV3", 8, 75),
        "InceptionV3 75x75, batch 8"),
    "keras_efficientnetb0": F.keras_entry(
        "keras_efficientnetb0", lambda: F.keras_application("EfficientNetB0", 8, 64),
        "EfficientNetB0 64x64, batch 8"),
    "while_matmuls": F.Entry("while_matmuls", _while_matmuls, "while of 6 matmuls 512x512, batch 512",
                             (F.FUNCTION, F.SESSION)),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(UNSEEN), default=list(UNSEEN))
    ap.add_argument("--methods", nargs="+", choices=F.METHODS, default=[F.PLAIN, "memory", "speed"])
    ap.add_argument("--repeats", type=int, default=F.REPEATS)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    F.MODELS.update(UNSEEN)  # forecast.measure/predict look models up there
    if args.worker:
        model, mode, *methods = args.worker
        measured = F.measure(model, mode, methods, repeats=args.repeats)
        predicted = F.predict(model, mode, methods)
        print(json.dumps({"measured": measured, "predicted": predicted}))
        return 0
    print("| model | method | mode | measured MiB | predicted MiB | error % |")
    print("|---|---|---|---:|---:|---:|")
    errors = []
    for name in args.models:
        for mode in UNSEEN[name].modes:
            cmd = [sys.executable, __file__, "--worker", name, mode, *args.methods,
                   "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=F.WORKER_TIMEOUT_S)
            if proc.returncode != 0:
                print(f"| {name} | - | {mode} | failed: {proc.stderr.strip().splitlines()[-1][:100]} | | |")
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            for method in args.methods:
                m = out["measured"].get(method, {})
                p = out["predicted"].get(method)
                if "peak_bytes" not in m or not isinstance(p, (int, float)):
                    print(f"| {name} | {method} | {mode} | {m.get('error', '-')[:60]} | {p} | - |")
                    continue
                err = (p - m["peak_bytes"]) / m["peak_bytes"]
                errors.append(abs(err))
                print(f"| {name} | {method} | {mode} | {m['peak_bytes'] / MiB:.1f} | {p / MiB:.1f} | "
                      f"{100 * err:+.1f}{' !' if abs(err) > F.MAX_ERROR else ''} |", flush=True)
    if errors:
        errors.sort()
        print(f"\nmax abs error {100 * errors[-1]:.1f}%, median {100 * errors[len(errors) // 2]:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
