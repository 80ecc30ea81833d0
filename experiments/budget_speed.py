"""What a memory budget costs in step time on keras.applications models.

Issue 19's check on models nobody here wrote: keras.applications
MobileNetV2 and ResNet50 (``weights=None``, 64x64, batch 32, 10 classes),
a custom-loop train step in a ``tf.function`` (forward with
``training=True``, the gradients, an SGD update; it returns the loss, so
each gradient is freed after its update, what ``memory_budget=`` bounds).
Methods: plain ``tf.gradients``, memsave ``'memory'`` and ``memory_budget=``
0.5 and 0.75 (fractions of the forecast plain peak). A budget below every
plan's forecast is reported with the smallest feasible fraction
(``MemoryBudgetError.min_peak_bytes``), not as a failure.

All methods of a model are built in one process and run round-robin
(``--rounds`` rounds after a warm-up): the table gives the median CPU time
(``time.process_time``, steadier than wall time on a shared machine) and
wall time of each over plain's, beside the plan's forecast peak and step
ratios. Peaks are measured elsewhere, one fresh process per method
(``experiments/applications.py --methods plain budget0.5 budget0.75
--returns loss``).

Usage::

    .venv/bin/python experiments/budget_speed.py                 # ~10 min on 2 cores
    .venv/bin/python experiments/budget_speed.py --models MobileNetV2 --rounds 5
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: method -> memsave keyword arguments (None: plain tf.gradients).
METHODS = {
    "plain": None,
    "memory": dict(checkpoints="memory"),
    "budget0.75": dict(checkpoints="memory", memory_budget=0.75),
    "budget0.5": dict(checkpoints="memory", memory_budget=0.5),
}
#: Issue 19: a budget of 0.5 at most this step time over plain's.
TARGET = 1.10


def build_steps(name: str, size: int, batch: int, methods) -> tuple[dict, dict]:
    """(steps, info): a traced train step per feasible method, and per
    method the plan's figures or the smallest feasible fraction."""
    import numpy as np
    import tensorflow as tf
    import keras

    import memsave
    from applications import NUM_CLASSES, build_model

    keras.utils.set_random_seed(0)
    model = build_model(name, size)
    rng = np.random.RandomState(0)
    x = tf.constant(rng.standard_normal((batch, size, size, 3)).astype(np.float32))
    y = tf.constant(rng.randint(0, NUM_CLASSES, size=(batch,)).astype(np.int32))
    variables = model.trainable_variables
    steps, info = {}, {}

    def train_step(kwargs, box):
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model(x, training=True)))
        if kwargs is None:
            grads = tf.gradients(loss, variables)
        else:
            # The plain forecast first: a budget below every plan raises.
            box["baseline"] = memsave.plan(loss, variables, checkpoints="memory") \
                .baseline_peak_bytes
            box["plan"] = memsave.plan(loss, variables, **kwargs)
            grads = memsave.gradients(loss, variables, **kwargs)
        for v, g in zip(variables, grads):
            v.assign_sub(1e-3 * g)
        return loss

    for method in methods:
        kwargs, box = METHODS[method], {}
        step = tf.function(functools.partial(train_step, kwargs, box))
        try:
            step.get_concrete_function()
        except memsave.MemoryBudgetError as e:
            info[method] = dict(infeasible=True,
                                min_fraction=(e.min_peak_bytes or 0) / box["baseline"])
            continue
        p = box.get("plan")
        info[method] = {} if p is None else dict(
            forecast_peak=p.predicted_peak_bytes / p.baseline_peak_bytes,
            forecast_step=p.step_time_ratio, checkpoints=len(p.checkpoints))
        steps[method] = step
    return steps, info


def time_steps(steps: dict, rounds: int) -> dict:
    """Median CPU and wall seconds per method, run round-robin after a warm-up."""
    for s in steps.values():
        s()
        s()
    cpu = {m: [] for m in steps}
    wall = {m: [] for m in steps}
    for _ in range(rounds):
        for m, s in steps.items():
            c0, t0 = time.process_time(), time.perf_counter()
            s().numpy()
            cpu[m].append(time.process_time() - c0)
            wall[m].append(time.perf_counter() - t0)
    return {m: (statistics.median(cpu[m]), statistics.median(wall[m])) for m in steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["MobileNetV2", "ResNet50"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    methods = ["plain"] + [m for m in args.methods if m != "plain"]
    print(f"keras.applications, {args.size}x{args.size}, batch {args.batch}, custom loop + SGD; "
          f"median of {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}\n")
    print("| model | method | checkpoints | forecast peak / plain | forecast step / plain "
          "| CPU / plain | wall / plain |")
    print("|---|---|---|---|---|---|---|")
    verdicts = []
    for name in args.models:
        steps, info = build_steps(name, args.size, args.batch, methods)
        times = time_steps(steps, args.rounds)
        base_cpu, base_wall = times["plain"]
        for m in methods:
            i = info.get(m, {})
            if i.get("infeasible"):
                print(f"| {name} | {m} | refused: smallest feasible fraction "
                      f"{i['min_fraction']:.3f} | | | | |")
                verdicts.append(f"{name} {m}: refused (smallest feasible {i['min_fraction']:.3f})")
                continue
            cpu, wall = times[m]
            fp = f"{i['forecast_peak']:.3f}" if "forecast_peak" in i else "1"
            fs = f"{i['forecast_step']:.3f}" if "forecast_step" in i else "1"
            print(f"| {name} | {m} | {i.get('checkpoints', '')} | {fp} | {fs} | "
                  f"{cpu / base_cpu:.3f} | {wall / base_wall:.3f} |", flush=True)
            if m == "budget0.5":
                ok = cpu / base_cpu <= TARGET
                verdicts.append(f"[{'x' if ok else ' '}] {name} budget 0.5 step <= {TARGET}x "
                                f"plain (CPU): {cpu / base_cpu:.3f}")
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
