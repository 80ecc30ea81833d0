"""keras.applications models under memsave: does each build, run, match, save?

For every model of the registry :data:`MODELS` (``weights=None``, small
inputs, 10 classes) and every gradient method of :data:`METHODS` (plain
``tf.gradients``, memsave ``'memory'``, ``'speed'``, ``'collection'``; on
request ``budget0.5`` and ``budget0.75``, ``memory_budget=`` at that fraction
of the forecast plain peak), with and without ``jit_compile``, one fresh
process:

0. allocates and frees ``--presplit-mib`` MiB, so the allocator's peak
   counts requested bytes rather than the power-of-two regions its pool
   grows by (see ``allocator.py``; without it every XLA step, whose
   temporaries are one buffer, reads the same peak whatever the method);
1. builds the model and a seeded random batch; sets every ``Dropout`` layer's
   rate to 0 (EfficientNet's drop-connect and MobileNetV3's head are Dropout
   layers: with a random mask per call no two gradient computations could be
   compared);
2. takes the reference gradients with ``tf.GradientTape`` at the initial
   weights, in a ``tf.function`` with the same ``jit_compile`` (an eager
   tape runs other kernels than the graph's fused ones, and these nets at
   small inputs amplify that: MobileNetV2 at 64x64, batch 4, eager tape vs
   graph tf.gradients differ by 0.41 of a gradient's scale, while tape,
   tf.gradients and memsave 'memory' in one tf.function agree exactly);
3. traces a custom-loop step ``tf.function(jit_compile=...)``: forward with
   ``training=True``, the method's gradients, an SGD update; it returns the
   gradients, so the first call (the warm-up) gives the method's gradients
   at the same initial weights: relative error ``max|g - g_tape| /
   max|g_tape|``, the largest over the variables;
4. ``reset_memory_stats`` and calls the step once more (with ``--returns
   loss``, a second step that returns only the loss, warmed up first): the allocator's
   peak of that step (``peak_MiB``), and what was allocated before it
   (``resident_MiB``: weights, optimizer-free SGD so only the weights and
   the batch).

For ``'collection'`` the step tags layer outputs the way a user would in a
custom loop: the model is wrapped in a functional model that also returns
the outputs of chosen layers (:func:`collection_layers`: about sqrt(n) of
the block-ending ``Add`` / ``Concatenate`` layers, evenly spaced), and the
step adds those tensors to the ``'checkpoints'`` collection of its graph.

A budgeted method also reports its budget in bytes and, with ``--returns
loss``, whether the measured peak is within ``BUDGET_SLACK`` of it (a failure
if not; a step that returns its gradients keeps them all alive past the
backward pass, which the budget does not cover); a budget below
every plan's forecast is reported as infeasible with the smallest forecast
peak (``MemoryBudgetError.min_peak_bytes``), which is not a failure.

A method's peak ratio is its peak over plain ``tf.gradients``' peak with the
same ``jit_compile`` (each from its own process: peaks vary by a few MiB
between processes). Progress to stderr, a Markdown table to stdout,
``results/applications.csv`` (one row per model, method, jit). Exit status
1 if any case failed to build or run or computed wrong gradients.

Usage::

    .venv/bin/python experiments/applications.py                   # everything (~1 h on 2 cores)
    .venv/bin/python experiments/applications.py --models ResNet50 MobileNetV2 --jit off
    .venv/bin/python experiments/applications.py --methods plain memory --size 32 --batch 2
    .venv/bin/python experiments/applications.py --methods plain memory budget0.5 budget0.75 \
        --jit off --batch 32 --returns loss
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from allocator import PRESPLIT_MIB, presplit_cpu_pool

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

ROOT = Path(__file__).resolve().parent.parent

# A model a user picks from keras.applications, and the smallest input side
# it accepts (InceptionV3 needs >= 75, Xception >= 71; the others >= 32).
MODELS = {
    "ResNet50": 32,
    "ResNet50V2": 32,
    "MobileNetV2": 32,
    "MobileNetV3Small": 32,
    "EfficientNetB0": 32,
    "EfficientNetV2B0": 32,
    "DenseNet121": 32,
    "InceptionV3": 75,
    "Xception": 71,
    "ConvNeXtTiny": 32,
    "NASNetMobile": 32,
}

# method name -> memsave keyword arguments (None: plain tf.gradients).
METHODS = {
    "plain": None,
    "memory": dict(checkpoints="memory"),
    "speed": dict(checkpoints="speed"),
    "collection": dict(checkpoints="collection"),
    # memory_budget= as a fraction of the forecast tf.gradients peak: the
    # measured peak must stay within BUDGET_SLACK of the budget in bytes.
    "budget0.5": dict(checkpoints="memory", memory_budget=0.5),
    "budget0.75": dict(checkpoints="memory", memory_budget=0.75),
}
DEFAULT_METHODS = ("plain", "memory", "speed", "collection")
# A budgeted step "fits" when its measured peak is at most the budget times
# this (issue 9's "budget + 10%").
BUDGET_SLACK = 1.10

NUM_CLASSES = 10
# Gradients "equal" GradientTape's when, for every variable, the largest
# entry of the difference is at most this fraction of the largest entry of
# the tape's gradient (see relative_error). Batch norm over a handful of
# positions (batch 4 at the last stages' 2x2 maps) amplifies rounding:
# measured on ResNet50 64x64 batch 4, plain tf.gradients vs the tape in the
# same XLA-compiled step 3.6e-4, memsave 'memory' vs the tape without XLA
# 3.0e-4; elsewhere 0 to 1e-6. A wrong mask or a missing gradient part is
# of order 1.
GRADIENT_RTOL = 1e-3
ZERO_GRADIENT_FLOOR = 1e-3
CHILD_TIMEOUT_S = 1800
MiB = 2 ** 20


def collection_layers(model, candidates_types=("Add", "Concatenate")) -> list:
    """About sqrt(n) block-ending layers of ``model``, evenly spaced.

    Block ends are ``Add`` (residual sums) and ``Concatenate`` (dense and
    inception blocks) layers with a 4-D output; a model with fewer than two
    of them falls back to its ``Activation``/``ReLU`` layers.
    """
    import keras

    def pick(types):
        out = []
        for layer in model.layers:
            if type(layer).__name__ in types and len(layer.output.shape) == 4:
                out.append(layer)
        return out

    cands = pick(candidates_types)
    if len(cands) < 2:
        cands = pick(("Activation", "ReLU"))
    k = max(1, round(math.sqrt(len(cands))))
    # evenly spaced, not the first nor the last
    idx = sorted({int((i + 1) * len(cands) / (k + 1)) for i in range(k)})
    del keras
    return [cands[i] for i in idx]


def build_model(name: str, size: int):
    import keras

    model = getattr(keras.applications, name)(
        weights=None, input_shape=(size, size, 3), classes=NUM_CLASSES,
        classifier_activation=None,
    )
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def child(a) -> dict:
    """One model, one method, one jit setting; returns a result row."""
    import numpy as np
    import tensorflow as tf
    import keras

    import memsave

    presplit_cpu_pool(a.presplit_mib)  # first: see allocator.py
    row = dict(model=a.model, method=a.method, jit=a.jit, size=a.size, batch=a.batch,
               returns=a.returns,
               builds=False, runs=False, rel_err=None, grads_equal=None,
               peak_MiB=None, resident_MiB=None, plan_steps=None, plan_recomputed_ops=None,
               checkpoints=None, error="")
    keras.utils.set_random_seed(0)
    model = build_model(a.model, a.size)
    rng = np.random.RandomState(0)
    x = tf.constant(rng.standard_normal((a.batch, a.size, a.size, 3)).astype(np.float32))
    y = tf.constant(rng.randint(0, NUM_CLASSES, size=(a.batch,)).astype(np.int32))
    variables = model.trainable_variables
    tagged = collection_layers(model) if a.method == "collection" else []
    net = keras.Model(model.inputs, [model.output] + [l.output for l in tagged]) if tagged else model

    def loss_of(logits):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    def forward():
        outs = net(x, training=True)
        if tagged:
            for t in outs[1:] if not tf.executing_eagerly() else ():
                tf.compat.v1.add_to_collection("checkpoints", t)
            return loss_of(outs[0])
        return loss_of(outs)

    @tf.function(jit_compile=a.jit)
    def tape_gradients():
        with tf.GradientTape() as tape:
            loss = forward()
        return tape.gradient(loss, variables)

    ref_file = Path(a.ref_dir) / f"{a.model}_{a.size}_{a.batch}_{'xla' if a.jit else 'graph'}.npz"
    if ref_file.exists():
        with np.load(ref_file) as f:
            ref = [f[f"g{i}"] for i in range(len(f.files))]
    else:
        ref = [g.numpy() for g in tape_gradients()]
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        np.savez(ref_file, **{f"g{i}": g for i, g in enumerate(ref)})

    kwargs = METHODS[a.method]
    plan_box = {}

    def train_step(return_gradients: bool):
        loss = forward()
        if kwargs is None:
            grads = tf.gradients(loss, variables)
        else:
            p = memsave.plan(loss, variables, **kwargs)
            plan_box.update(steps=len(p.steps), recomputed_ops=p.recomputed_ops,
                            checkpoints=len(p.checkpoints), budget_bytes=p.budget_bytes,
                            forecast_bytes=p.predicted_peak_bytes)
            grads = memsave.gradients(loss, variables, **kwargs)
        for v, g in zip(variables, grads):
            v.assign_sub(1e-3 * g)
        return grads if return_gradients else loss

    step = tf.function(lambda: train_step(True), jit_compile=a.jit)
    # The measured step: by default the same one; with --returns loss, one
    # that returns only the loss, so each gradient is freed once its update
    # has read it, as in a real training loop (what memory_budget bounds).
    measured = step if a.returns == "gradients" else tf.function(
        lambda: train_step(False), jit_compile=a.jit)
    try:
        step.get_concrete_function()
        if measured is not step:
            measured.get_concrete_function()
    except memsave.MemoryBudgetError as e:
        # Not a failure: the budget is below every plan's forecast, and the
        # error says so before anything runs.
        row.update(builds=True, runs=True, infeasible=True,
                   min_peak_MiB=e.min_peak_bytes / MiB)
        return row
    except Exception as e:  # noqa: BLE001 - reported, not handled
        row["error"] = f"build: {type(e).__name__}: {_first_line(e)}"
        return row
    row["builds"] = True
    row.update(plan_steps=plan_box.get("steps"), plan_recomputed_ops=plan_box.get("recomputed_ops"),
               checkpoints=plan_box.get("checkpoints"))
    if plan_box.get("budget_bytes") is not None:
        row.update(budget_MiB=plan_box["budget_bytes"] / MiB, forecast_MiB=plan_box["forecast_bytes"] / MiB)
    try:
        grads = [g.numpy() for g in step()]
        if measured is not step:
            measured()  # its warm-up
        tf.config.experimental.reset_memory_stats("CPU:0")
        resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
        measured()
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except Exception as e:  # noqa: BLE001
        row["error"] = f"run: {type(e).__name__}: {_first_line(e)}"
        return row
    row["runs"] = True
    err = relative_error(grads, ref)
    row.update(rel_err=err, grads_equal=err <= GRADIENT_RTOL,
               peak_MiB=peak / MiB, resident_MiB=resident / MiB)
    if row.get("budget_MiB") is not None and a.returns == "loss":
        row["within_budget"] = row["peak_MiB"] <= BUDGET_SLACK * row["budget_MiB"]
    return row


def relative_error(grads, ref) -> float:
    """Largest over variables of max|g - ref| / max(max|ref|, floor).

    The floor, ZERO_GRADIENT_FLOOR times the largest entry of all the
    reference gradients, is for gradients that are zero but for rounding
    (the beta of a batch norm followed by another batch norm): their
    entries are noise of the order of eps times the terms that cancel.
    """
    import numpy as np

    top = max(float(np.max(np.abs(r))) for r in ref if r.size)
    err = 0.0
    for g, r in zip(grads, ref):
        scale = max(float(np.max(np.abs(r))), ZERO_GRADIENT_FLOOR * top)
        err = max(err, float(np.max(np.abs(g.astype(np.float64) - r))) / scale)
    return err


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def run_child(model: str, method: str, jit: bool, args) -> dict:
    cmd = ([sys.executable, str(Path(__file__).resolve()), "--child", "--model", model,
           "--method", method, "--size", str(max(args.size, MODELS[model])),
           "--batch", str(args.batch), "--ref-dir", str(args.out.parent / "applications_ref"),
           "--presplit-mib", str(args.presplit_mib), "--returns", args.returns]
           + (["--jit-child"] if jit else []))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    if args.threads:
        env.update(TF_NUM_INTRAOP_THREADS=str(args.threads), TF_NUM_INTEROP_THREADS=str(args.threads))
    t0 = time.time()
    base = dict(model=model, method=method, jit=jit, builds=False, runs=False, error="")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(base, error=f"timeout after {args.timeout} s", wall_s=time.time() - t0)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [l for l in proc.stderr.strip().splitlines() if l.strip()][-1:] or ["?"]
        return dict(base, error=f"process exit {proc.returncode}: {tail[0][:300]}",
                    wall_s=time.time() - t0)
    row = json.loads(lines[-1])
    row["wall_s"] = time.time() - t0
    return row


def table(rows: list[dict]) -> str:
    plain = {(r["model"], r["jit"]): r.get("peak_MiB") for r in rows if r["method"] == "plain"}
    out = ["| model | jit | method | builds | runs | rel. err | peak MiB | ratio | budget MiB "
           "| steps/recomputed | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = plain.get((r["model"], r["jit"]))
        ratio = (f"{r['peak_MiB'] / base:.2f}" if r.get("peak_MiB") and base else "")
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
        peak = f"{r['peak_MiB']:.1f}" if r.get("peak_MiB") is not None else ""
        plan = (f"{r.get('plan_steps')}/{r.get('plan_recomputed_ops')}"
                if r.get("plan_steps") is not None else "")
        budget = ""
        if r.get("budget_MiB") is not None:
            fits = ({True: "fits", False: "OVER"}.get(r.get("within_budget"), "not checked: "
                                                       "the step returns its gradients"))
            budget = f"{r['budget_MiB']:.1f} ({fits})"
        elif r.get("min_peak_MiB") is not None:
            budget = f"infeasible, min {r['min_peak_MiB']:.1f}"
        out.append(f"| {r['model']} | {'on' if r['jit'] else 'off'} | {r['method']} | "
                   f"{'yes' if r['builds'] else 'NO'} | {'yes' if r['runs'] else 'NO'} | {err} | "
                   f"{peak} | {ratio} | {budget} | {plan} | {r.get('error', '')} |")
    return "\n".join(out)


FIELDS = ["model", "method", "jit", "size", "batch", "returns", "builds", "runs", "rel_err", "grads_equal",
          "peak_MiB", "resident_MiB", "ratio", "plan_steps", "plan_recomputed_ops",
          "checkpoints", "budget_MiB", "forecast_MiB", "within_budget", "min_peak_MiB",
          "wall_s", "error"]


def write_csv(path: Path, rows: list[dict]) -> None:
    plain = {(r["model"], r["jit"]): r.get("peak_MiB") for r in rows if r["method"] == "plain"}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            base = plain.get((r["model"], r["jit"]))
            ratio = r["peak_MiB"] / base if r.get("peak_MiB") and base else None
            w.writerow(dict(r, ratio=ratio))


def _parse_row(r: dict) -> dict:
    out = dict(r)
    for k in ("builds", "runs", "jit", "grads_equal"):
        out[k] = r.get(k) == "True"
    out["within_budget"] = {"True": True, "False": False}.get(r.get("within_budget"))
    for k in ("rel_err", "peak_MiB", "resident_MiB", "wall_s", "budget_MiB", "forecast_MiB",
              "min_peak_MiB"):
        out[k] = float(r[k]) if r.get(k) else None
    for k in ("plan_steps", "plan_recomputed_ops", "checkpoints"):
        out[k] = int(r[k]) if r.get(k) else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    p.add_argument("--jit", choices=["off", "on", "both"], default="both")
    p.add_argument("--size", type=int, default=64, help="input side (raised to a model's minimum)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="TF intra/inter-op threads (0: TF default)")
    p.add_argument("--presplit-mib", type=int, default=PRESPLIT_MIB,
                   help="allocate and free this many MiB first in each process, so the allocator's "
                        "peak counts requested bytes (see allocator.py; 0: as it comes)")
    p.add_argument("--returns", choices=["gradients", "loss"], default="gradients",
                   help="what the measured step returns: its gradients (kept alive to the end of "
                        "the step, as in the tables of experiments/README.md) or only the loss "
                        "(each gradient freed after its update: what memory_budget= bounds; "
                        "budgeted methods are checked against their budget only then)")
    p.add_argument("--timeout", type=int, default=CHILD_TIMEOUT_S, help="seconds per process")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "applications.csv")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--jit-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ref-dir", default=str(ROOT / "results" / "applications_ref"),
                   help=argparse.SUPPRESS)
    p.add_argument("--report", nargs="+", type=Path, metavar="CSV",
                   help="print the table of earlier runs' CSVs and exit")
    a = p.parse_args(argv)
    if a.report:
        rows = []
        for path in a.report:
            with path.open() as f:
                rows += [_parse_row(r) for r in csv.DictReader(f)]
        print(table(rows))
        return 0
    if a.child:
        a.jit = a.jit_child
        print(json.dumps(child(a)))
        return 0

    jits = {"off": [False], "on": [True], "both": [False, True]}[a.jit]
    rows = []
    for jit in jits:
        for model in a.models:
            for method in a.methods:
                row = run_child(model, method, jit, a)
                rows.append(row)
                print(f"{model} jit={jit} {method}: builds={row['builds']} runs={row['runs']} "
                      f"err={row.get('rel_err')} peak={row.get('peak_MiB')} "
                      f"({row.get('wall_s', 0):.0f} s) {row.get('error', '')}",
                      file=sys.stderr, flush=True)
                write_csv(a.out, rows)
    print(table(rows))
    failed = [r for r in rows if not r["runs"] or r.get("grads_equal") is False
              or r.get("within_budget") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
