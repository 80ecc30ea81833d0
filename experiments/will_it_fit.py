"""Will it fit? ``memsave.keras.max_batch_size`` checked against real ``fit`` steps.

For each model (keras.applications MobileNetV2 at 96x96, a 4-layer
Transformer encoder from keras layers, a deep MLP) and its memory cap:

1. In a fresh process, ``max_batch_size`` with ``checkpoints=None`` (plain
   ``fit``) and ``checkpoints='memory'`` (memsave), sharing one set of
   traces (:class:`memsave.capacity.Forecasts`); and the forecasts of a
   batch 25% larger than each answer.
2. Each answer run for one real ``fit`` step in its own fresh process:
   a warm-up ``fit`` of one step (tracing, the optimizer's slots, the
   metrics' state), then a second ``fit`` of one step whose callback calls
   ``tf.config.experimental.reset_memory_stats('CPU:0')`` when the batch
   begins and reads ``get_memory_info('CPU:0')['peak']`` when it ends: the
   allocator's peak of the step, its data iterator included (``fit`` on
   numpy arrays, as a user calls it). Plain answers run plain ``fit``;
   memsave answers run ``memsave.keras.checkpointed(model, 'memory')``.
3. A batch 25% larger than each answer: its forecast (raw, and padded by
   the margin as the search judges it) and, run for real like the answer,
   its measured peak.

Prints two tables: model, cap, plain batch, memsave batch, their ratio, the
measured peak of each at its batch (and as a fraction of the cap), whether
each is within the cap; then the 25% larger batches, the measured /
forecast ratio at each answer (the error the margin covers) and the
number of traces each search made (memsave's starts from plain's). Exit
status 1 when a measured peak is over its cap, a 25% larger batch's padded
forecast is not over the cap, or a ratio is under 2.

Usage::

    .venv/bin/python experiments/will_it_fit.py                 # every model
    .venv/bin/python experiments/will_it_fit.py --models mlp    # one
    .venv/bin/python experiments/will_it_fit.py --models resnet50 efficientnetb0  # held out
    .venv/bin/python experiments/will_it_fit.py --margin 0      # the forecast trusted as is
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

#: Memory caps (bytes), chosen so that each answer is a batch well above 8
#: whose tensors are all well above the CPU allocator's 256 KiB counting
#: threshold, and whose fit step runs in seconds on two cores.
CAPS = {
    "mobilenetv2": 1536 * 2**20,
    "transformer": 1024 * 2**20,
    "mlp": 384 * 2**20,
    # held out: not among the models the margins were measured on
    "resnet50": 1536 * 2**20,
    "efficientnetb0": 1536 * 2**20,
}

#: The models run by default (the margins' own); the others check them out of sample.
DEFAULT_MODELS = ("mobilenetv2", "transformer", "mlp")

WORKER_TIMEOUT_S = 1800


# -- models (experiments/forecast.py's Keras builders, each compiled with adam) ---------------


def _case(name: str, batch: int):
    """``forecast.KerasCase`` (model, x, y) of ``name`` with a random batch of ``batch``."""
    import forecast  # experiments/forecast.py, beside this file

    if name == "mobilenetv2":  # keras.applications.MobileNetV2, 96x96x3, no weights, 10 classes
        return forecast.keras_application("MobileNetV2", batch, 96)
    if name == "transformer":  # 4 blocks of MultiHeadAttention + FFN + LayerNorm, seq 128, d 128
        return forecast._keras_transformer(batch=batch, seq=128, d_model=128, heads=4, blocks=4)
    if name == "mlp":  # 48 Dense(256, relu) layers
        return forecast._keras_mlp(batch=batch, width=256, depth=48)
    if name in ("resnet50", "efficientnetb0"):  # 64x64x3
        return forecast.keras_application({"resnet50": "ResNet50",
                                           "efficientnetb0": "EfficientNetB0"}[name], batch, 64)
    raise ValueError(f"unknown model {name!r}; known: {sorted(CAPS)}")


# -- workers (each in a fresh process) -------------------------------------------------


def search(name: str, cap: int, margin: float | None) -> dict:
    """Both answers and the forecasts around them, from one set of traces."""
    from memsave.capacity import Forecasts

    case = _case(name, 1)
    forecasts = Forecasts(case.model, case.x, case.y, checkpoints="memory")
    out: dict = {}
    for method, plain in (("plain", True), ("memsave", False)):
        t0, traces0 = time.perf_counter(), forecasts.traces
        batch = forecasts.max_batch_size(cap, plain=plain, margin=margin)
        out[method] = dict(batch=batch, traces=forecasts.traces - traces0,
                           search_s=time.perf_counter() - t0,
                           margin=forecasts.margin(batch, plain=plain, margin=margin))
    for method, plain in (("plain", True), ("memsave", False)):
        batch = out[method]["batch"]
        larger = max(batch + 1, round(1.25 * batch))
        out[method].update(
            forecast=forecasts.peak(batch, plain=plain),
            forecast_next=forecasts.peak(batch + 1, plain=plain),
            larger=larger, forecast_larger=forecasts.peak(larger, plain=plain),
            padded_larger=forecasts.padded_peak(larger, plain=plain, margin=margin))
    return out


def measure(name: str, method: str, batch: int) -> dict:
    """The allocator peak of one real fit step at ``batch`` (see the module docstring)."""
    import keras
    import tensorflow as tf

    import memsave.keras

    case = _case(name, batch)
    model, x, y = case.model, case.x, case.y
    if method == "memsave":
        memsave.keras.checkpointed(model, "memory")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)  # warm-up

    class Peak(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, batch, logs=None):
            self.peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]

    peak = Peak()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[peak])
    return dict(peak=peak.peak, resident=peak.resident)


def _worker(args: list[str]) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True,
                          text=True, env=env, timeout=WORKER_TIMEOUT_S)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"worker {args} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the table ---------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(CAPS),
                        default=list(DEFAULT_MODELS))
    parser.add_argument("--margin", type=float, default=None,
                        help="forecast margin for both methods (default: max_batch_size's, "
                             "memsave.capacity.FORECAST_MARGIN_PLAIN / _CHECKPOINTED)")
    parser.add_argument("--no-larger", action="store_true",
                        help="do not run the 25%% larger batches for real")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        if kind == "search":
            result = search(rest[0], int(rest[1]), None if rest[2] == "None" else float(rest[2]))
        else:
            result = measure(rest[0], rest[1], int(rest[2]))
        print(json.dumps(result))
        return 0

    rows = []
    for name in args.models:
        cap = CAPS[name]
        found = _worker(["search", name, str(cap), str(args.margin)])
        for method in ("plain", "memsave"):
            f = found[method]
            f.update(_worker(["measure", name, method, str(f["batch"])]))
            if not args.no_larger:
                f["peak_larger"] = _worker(["measure", name, method, str(f["larger"])])["peak"]
        rows.append((name, cap, found))
        print(f"{name}: {json.dumps(found)}", file=sys.stderr, flush=True)
    return 1 if _table(rows) else 0


def _table(rows) -> bool:
    """Print the table; True when a check failed."""
    mib = 2**20
    failed = False
    print("A batch fits when forecast * (1 + margin) <= cap; measured = allocator peak of one "
          "real fit step in a fresh process\n")
    print("| model | cap MiB | plain batch | memsave batch | ratio | plain measured MiB (of cap) "
          "| memsave measured MiB (of cap) | within cap? |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cap, f in rows:
        p, m = f["plain"], f["memsave"]
        within = p["peak"] <= cap and m["peak"] <= cap
        ratio = m["batch"] / p["batch"]
        failed |= not within or ratio < 2
        print(f"| {name} | {cap / mib:.0f} | {p['batch']} | {m['batch']} | {ratio:.2f}x "
              f"| {p['peak'] / mib:.1f} ({p['peak'] / cap:.0%}) "
              f"| {m['peak'] / mib:.1f} ({m['peak'] / cap:.0%}) | {'yes' if within else 'NO'} |")

    print("\nA batch 25% larger than each answer: its forecast, padded forecast (the search's "
          "verdict) and measured peak, against the cap:\n")
    print("| model | method | batch | forecast MiB | padded MiB | over cap? | measured MiB | over cap? "
          "| margin | measured / forecast at the answer | traces |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, cap, f in rows:
        for method in ("plain", "memsave"):
            r = f[method]
            padded = r["padded_larger"]
            failed |= padded <= cap
            measured = r.get("peak_larger")
            print(f"| {name} | {method} | {r['larger']} | {r['forecast_larger'] / mib:.1f} "
                  f"| {padded / mib:.1f} | {'yes' if padded > cap else 'NO'} "
                  + (f"| {measured / mib:.1f} | {'yes' if measured > cap else 'no'} "
                     if measured is not None else "| - | - ")
                  + f"| {r['margin']:.0%} | {r['peak'] / r['forecast']:.3f} "
                  f"| {r['traces']} ({r['search_s']:.1f} s) |")
    return failed


if __name__ == "__main__":
    sys.exit(main())
