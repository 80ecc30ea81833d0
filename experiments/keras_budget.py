"""Keras budgets mean the fit step: measured peak of a budgeted ``fit`` step against plain ``fit``'s.

``memsave.keras.checkpointed(model, memory_budget=f)`` plans the least
recomputation whose forecast peak of the whole ``fit`` train step (weights,
optimizer slots, metric state and the batch included) is at most ``f``
times plain ``fit``'s forecast step peak; ``memsave.keras.plan(model, x, y,
memory_budget=f)`` forecasts that step. For each model and method this runs,
in a fresh process: compile (adam), forecast, one warm-up ``train_on_batch``
(the step ``fit`` runs: tracing, slots, kernels), then
``reset_memory_stats`` and one more, reading the allocator's peak.

Prints the table (measured peak, its ratio to plain fit's, the forecast and
its error) and exits 1 when a budgeted step measures over ``--limit`` times
plain's peak, or a forecast is off by more than ``--max-error``. A budget
below every plan is a result (the smallest feasible fraction is printed),
not a failure.

Usage::

    .venv/bin/python experiments/keras_budget.py                 # MobileNetV2 and a Transformer
    .venv/bin/python experiments/keras_budget.py --budget 0.5 --models transformer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

MiB = 1 << 20

#: name -> (builder kwargs): small enough for 2 cores, every activation above 256 KiB.
MODELS = {
    "mobilenetv2": dict(batch=32, size=96),
    "transformer": dict(batch=32, seq=128, d_model=128, heads=4, blocks=4),
}


def build(name: str, cfg: dict):
    """(compiled model, x, y) with seeded weights and data."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "mobilenetv2":
        s = cfg["size"]
        model = keras.applications.MobileNetV2(weights=None, input_shape=(s, s, 3), classes=10)
        x = rng.normal(size=(cfg["batch"], s, s, 3)).astype("float32")
    else:
        d = cfg["d_model"]
        inputs = keras.Input((cfg["seq"], d))
        h = inputs
        for _ in range(cfg["blocks"]):
            a = keras.layers.MultiHeadAttention(num_heads=cfg["heads"], key_dim=d // cfg["heads"])(h, h)
            h = keras.layers.LayerNormalization()(h + a)
            f = keras.layers.Dense(4 * d, activation="gelu")(h)
            h = keras.layers.LayerNormalization()(h + keras.layers.Dense(d)(f))
        model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
        x = rng.normal(size=(cfg["batch"], cfg["seq"], d)).astype("float32")
    y = rng.integers(0, 10, size=(cfg["batch"],)).astype("int32")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=name != "mobilenetv2"))
    return model, x, y


def child(name: str, method: str, budget: float) -> dict:
    """One measurement (in a fresh process): forecast, warm up, measure one step."""
    import tensorflow as tf

    import memsave
    import memsave.keras

    model, x, y = build(name, MODELS[name])
    out: dict = {"model": name, "method": method}
    if method == "plain":
        p = memsave.keras.plan(model, x, y)
        out["forecast_bytes"] = p.baseline_peak_bytes
    else:
        try:
            p = memsave.keras.plan(model, x, y, memory_budget=budget)
        except memsave.MemoryBudgetError as e:
            base = memsave.keras.plan(model, x, y).baseline_peak_bytes
            out.update(infeasible=True, min_fraction=e.min_peak_bytes / base)
            return out
        out.update(forecast_bytes=p.predicted_peak_bytes, budget_bytes=p.budget_bytes,
                   solver=p.solver)
        memsave.keras.checkpointed(model, memory_budget=budget)
    model.train_on_batch(x, y)  # warm-up: tracing, optimizer slots, kernels
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x, y)
    out["peak_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return out


def run_child(name: str, method: str, budget: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", name, method, str(budget)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"model": name, "method": method,
                "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--budget", type=float, default=0.5, help="memory_budget fraction")
    p.add_argument("--limit", type=float, default=0.55,
                   help="largest measured budgeted/plain peak ratio accepted")
    p.add_argument("--max-error", type=float, default=0.20, help="largest forecast error accepted")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        name, method, budget = args.child
        print(json.dumps(child(name, method, float(budget))))
        return 0
    ok = True
    print(f"| model | method | measured MiB | x plain | forecast MiB | forecast error | note |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        plain = run_child(name, "plain", args.budget)
        ours = run_child(name, "budget", args.budget)
        for r in (plain, ours):
            label = "plain fit" if r["method"] == "plain" else f"memory_budget={args.budget:g}"
            if "error" in r:
                ok = False
                print(f"| {name} | {label} | failed: {r['error']} | | | | |")
                continue
            if r.get("infeasible"):
                print(f"| {name} | {label} | refused | | | | smallest feasible fraction "
                      f"{r['min_fraction']:.3f} |")
                continue
            ratio = r["peak_bytes"] / plain["peak_bytes"] if "peak_bytes" in plain else float("nan")
            err = r["forecast_bytes"] / r["peak_bytes"] - 1
            note = "" if r["method"] == "plain" else (
                f"budget {r['budget_bytes'] / MiB:.1f} MiB ({r['solver']})")
            if abs(err) > args.max_error or (r["method"] != "plain" and ratio > args.limit):
                ok = False
                note += " OVER"
            print(f"| {name} | {label} | {r['peak_bytes'] / MiB:.1f} | {ratio:.2f} | "
                  f"{r['forecast_bytes'] / MiB:.1f} | {err:+.1%} | {note.strip()} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
