"""Benchmark: checkpointing inside while_v2 loops (``memsave.loops``).

Cases (batch 1024, 64 features, 128 units, so that one step's tensors are
256 KiB and more, which the CPU allocator counts):

- ``keras``: ``keras.layers.LSTM(128)`` + ``Dense(10)``, mean squared
  error, in a ``tf.function``; T = 128, 512, 1024.
- ``stacked``: ``LSTM(128, return_sequences=True)``, ``GRU(128,
  return_sequences=True)``, ``Dense(10)`` on every step; T = 128.
- ``bidirectional``: ``Bidirectional(LSTM(128))`` + ``Dense(10)``, two
  loops that run side by side; T = 128.
- ``while``: a hand-written ``tf.while_loop`` running an LSTM cell
  (``x[t] @ W + h @ U``, four gates) over a time-major input; T = 1000, in
  a ``tf.compat.v1`` Session and in a ``tf.function``.
- ``scan``: the same cell as a ``tf.scan`` over the input; T = 1000,
  Session and ``tf.function``.

Methods: ``plain`` (``tf.gradients``, while_v2's own gradient);
``per_step`` (``memsave.loops.prepare(op, LoopChoice.per_step())``: the
loop stores its state each trip, the backward loop recomputes the trip);
``chunk`` (``LoopChoice.chunk(k)``, state every k trips, each chunk's trips
recomputed, then each trip again; k from :func:`memsave.loopmodel.chunk_size`,
about sqrt(T)); ``chunk_store`` (``LoopChoice.chunk(k, inner="store")``:
a chunk's recomputation keeps what the gradient reads; its own k);
``slots`` (``LoopChoice.slots(s)``: chunks of s, s - 1, ..., 1 trips, s
from :func:`memsave.loopmodel.slot_count`, about sqrt(2T): the same
recomputation as ``chunk``, fewer states stored at once); ``memory`` (``memsave.gradients(checkpoints="memory")``: the planner picks
each loop's gradient, the lowest forecast peak at the least recompute) and
``budget_0.5``, ``budget_0.25`` (``memory_budget=``: the least recompute
whose forecast fits that fraction of the plain forecast peak). The
methods that fix a loop choice then differentiate as memsave.gradients
does a plan that changes only loops: one stock gradient call, its chain
waiting for the weights' kernels (:func:`memsave.rewrite.differentiate`).
Each step returns the gradients with respect to the weights; ``prepare`` is given
those xs, so the input sequence gets no gradient.

Memory: one fresh process per (case, mode, method, T): the CPU pool is
pre-split (``allocator.presplit_cpu_pool``), the step runs once (warm-up),
then ``--peak-steps`` times, each between ``reset_memory_stats`` and
``peak``; *peak above resident* is the largest of those peaks (the step
that decides whether training fits) minus the bytes in use before the
step (variables, inputs), and the table also shows the median step's.
They differ where the executor's order varies from step to step: in the
``stacked`` case under one stock ``tf.gradients`` call the Dense's
weight-gradient kernel sometimes finished after the next gradient op had
allocated, holding the GRU's 64 MiB output sequence a little longer
(T=128, chunk(11): 209-217 MiB in most steps, 280.5 in about one in
five); memsave's ordered call (``memsave.rewrite.differentiate``) runs
that gradient after the kernel.
Forecast: memsave's simulator on the step's forward graph, with the loop's
figures from :func:`memsave.loopmodel.figures` for the method's choice
(``Problem.with_loops``, read before ``prepare`` changes the loop); for the
planned methods, ``memsave.plan``'s ``predicted_peak_bytes``. Time: per (case, mode, T), all
methods built in one process and run round-robin (``--time-repeats``
rounds); the median wall time and the median CPU time of the process
(``time.process_time``, steadier than wall time on a shared machine) over
plain's. Gradients are compared with plain's (float32, rtol 1e-5 and an
atol of 1e-6 of the largest gradient: chunks sum the trips in another
order).

Prints a Markdown table (method, T, peak ratio, step ratios, forecast
error against the largest peak), the exponent of a least-squares fit of
log(peak above resident) against log(T) per method over the Keras T
values, and which of the
issue's targets are met; writes a plot of peak vs T
(``--plot``, default experiments/figures/loops_peak_vs_T.png) and the
measurements (``--out``, JSON).

Usage::

    .venv/bin/python experiments/bench_loops.py               # everything (~25 min on 2 shared cores)
    .venv/bin/python experiments/bench_loops.py --quick       # Keras at T=128, hand-written loop and scan at T=200
    .venv/bin/python experiments/bench_loops.py --cases keras --T 128 512
    .venv/bin/python experiments/bench_loops.py --report a.json b.json  # the report of earlier runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
BATCH, FEATURES, UNITS = 1024, 64, 128
METHODS = ("plain", "per_step", "chunk", "chunk_store", "slots", "memory", "budget_0.5",
           "budget_0.25")
#: Methods planned by memsave (memsave.gradients' own loop choices).
PLANNED = {"memory": {"checkpoints": "memory"}, "budget_0.5": {"memory_budget": 0.5},
           "budget_0.25": {"memory_budget": 0.25}}
CASES = ("keras", "stacked", "bidirectional", "while", "scan")
#: Modes measured per case.
CASE_MODES = {"keras": ("function",), "stacked": ("function",), "bidirectional": ("function",),
              "while": ("session", "function"),
              "scan": ("session", "function")}
#: Sequence length of the stacked and bidirectional cases.
STACKED_T = 128
KERAS_T = (128, 512, 1024)
LOOP_T = 1000
#: Peaks within this fraction of the smallest count as the smallest (the
#: fastest of them is "the smallest peak's" step time).
SAME_PEAK = 0.02
#: Steps measured per memory process: the largest peak is reported (the
#: executor's order, and with it the peak, can vary from step to step).
PEAK_STEPS = 8
#: Seconds a fresh measuring process may take.
TIMEOUT_S = 1800


# -- building one step ----------------------------------------------------------

def _choice(method, body):
    """The LoopChoice of ``method`` for a loop whose body is ``body``."""
    from memsave import loopmodel
    from memsave.memory_model import MemoryModel

    if method == "plain":
        return loopmodel.LoopChoice.plain()
    if method == "per_step":
        return loopmodel.LoopChoice.per_step()
    if method == "slots":
        return loopmodel.LoopChoice.slots(loopmodel.slot_count(body.trips))
    inner = "store" if method == "chunk_store" else "per_step"
    return loopmodel.LoopChoice.chunk(loopmodel.chunk_size(body, MemoryModel(), inner=inner),
                                      inner=inner)


def _gradients(loss, weights, method, report):
    """Forecast ``method``'s step, prepare the loops, return the gradients
    (not converted by autograph: plain Python over the traced graph)."""
    import tensorflow as tf

    return tf.autograph.experimental.do_not_convert(_gradients_unconverted)(
        loss, weights, method, report)


def _gradients_unconverted(loss, weights, method, report):
    import tensorflow as tf

    import memsave
    from memsave import _tf_private, loops
    from memsave.api import device_model
    from memsave.extract import extract
    from memsave.problem import Problem
    from memsave.rewrite import differentiate

    if method in PLANNED:
        kwargs = PLANNED[method]
        plan = memsave.plan(loss, weights, **kwargs)
        report["forecast_above_bytes"] = plan.predicted_peak_bytes - plan.resident_bytes
        report["applied"] = {d.name: str(d.choice) for d in plan.loops}
        report["plan_recompute_flops"] = plan.recompute_cost
        report["budget_bytes"] = plan.budget_bytes
        return memsave.gradients(loss, weights, **kwargs)
    fg = extract([loss], _tf_private.convert_xs(weights)).fg
    choices = {node.index: _choice(method, node.body) for node in fg.ops
               if node.body is not None and node.body.loop}
    trace = Problem(fg, model=device_model()).with_loops(choices).forecast(None)
    report["forecast_above_bytes"] = trace.peak_bytes - trace.resident_bytes
    report["applied"] = {}
    by_name = {fg.ops[i].name: c for i, c in choices.items()}
    for op in loops.find_loops([loss]):
        if op.name in by_name:
            report["applied"][op.name] = str(loops.prepare(op, by_name[op.name], xs=weights).applied)
    if method == "plain":
        return tf.gradients(loss, weights)
    # What memsave.gradients builds for a plan that changes only loops.
    return differentiate([loss], weights, None, {"colocate_gradients_with_ops": True}, xla=False)


def _cell(W, U, b, x_t, h, c):
    import tensorflow as tf

    z = tf.matmul(x_t, W) + tf.matmul(h, U) + b
    i, f, o, g = tf.split(z, 4, axis=1)
    c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
    return tf.sigmoid(o) * tf.tanh(c), c


def _hand_loss(case, x, W, U, b, V):
    import tensorflow as tf

    steps = x.shape[0]
    h0 = tf.zeros([BATCH, UNITS])
    if case == "while":
        def body(t, h, c):
            h, c = _cell(W, U, b, x[t], h, c)
            return t + 1, h, c

        _, h, _ = tf.while_loop(lambda t, h, c: t < steps, body, [0, h0, h0],
                                maximum_iterations=steps)
    else:
        hs, _ = tf.scan(lambda hc, x_t: _cell(W, U, b, x_t, *hc), x, initializer=(h0, h0))
        h = hs[-1]
    return tf.reduce_mean(tf.square(tf.matmul(h, V)))


def build_step(case, mode, method, steps, seed=0):
    """(run, report): ``run()`` computes one step and returns the gradients as
    numpy arrays; ``report`` holds the forecast and the choices."""
    import numpy as np
    import tensorflow as tf

    report = {}
    rng = np.random.RandomState(seed)
    if case in ("keras", "stacked", "bidirectional"):
        import keras

        keras.utils.set_random_seed(seed)
        x = tf.constant(rng.randn(BATCH, steps, FEATURES).astype(np.float32))
        L = keras.layers
        if case == "keras":
            y = tf.constant(rng.randn(BATCH, 10).astype(np.float32))
            layers = [L.LSTM(UNITS)]
        elif case == "bidirectional":
            y = tf.constant(rng.randn(BATCH, 10).astype(np.float32))
            layers = [L.Bidirectional(L.LSTM(UNITS))]
        else:
            y = tf.constant(rng.randn(BATCH, steps, 10).astype(np.float32))
            layers = [L.LSTM(UNITS, return_sequences=True), L.GRU(UNITS, return_sequences=True)]
        model = keras.Sequential([keras.Input((steps, FEATURES)), *layers, L.Dense(10)])

        @tf.function
        def step(x, y):
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            return _gradients(loss, model.trainable_weights, method, report)

        step.get_concrete_function(x, y)
        return (lambda: [g.numpy() for g in step(x, y)]), report
    values = [rng.randn(steps, BATCH, FEATURES).astype(np.float32),
              rng.randn(FEATURES, 4 * UNITS).astype(np.float32) * 0.1,
              rng.randn(UNITS, 4 * UNITS).astype(np.float32) * 0.1,
              np.zeros(4 * UNITS, np.float32),
              rng.randn(UNITS, 10).astype(np.float32) * 0.1]
    if mode == "function":
        x = tf.constant(values[0])
        weights = [tf.Variable(v) for v in values[1:]]

        @tf.function
        def step(x):
            return _gradients(_hand_loss(case, x, *weights), weights, method, report)

        step.get_concrete_function(x)
        return (lambda: [g.numpy() for g in step(x)]), report
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(values[0])
        weights = [tf.Variable(v) for v in values[1:]]
        grads = _gradients(_hand_loss(case, x, *weights), weights, method, report)
        init = tf.compat.v1.global_variables_initializer()
    session = tf.compat.v1.Session(graph=graph)
    session.run(init)
    return (lambda: session.run(grads)), report


# -- measuring -------------------------------------------------------------------

def measure_memory(case, mode, method, steps, peak_steps) -> dict:
    """Run in a fresh process: the peak above resident of each of
    ``peak_steps`` steps after a warm-up."""
    import allocator

    allocator.presplit_cpu_pool()
    import numpy as np
    import tensorflow as tf

    run, report = build_step(case, mode, method, steps)
    grads = run()
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    peaks = []
    for _ in range(peak_steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        run()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - resident)
    np.savez(os.environ["BENCH_LOOPS_GRADS"], *grads)
    return dict(report, peak_above_bytes=max(peaks), median_peak_above_bytes=statistics.median(peaks),
                step_peaks_above_bytes=peaks, resident_bytes=resident)


def measure_time(case, mode, steps, methods, rounds) -> dict:
    """Wall and CPU seconds of one step per method, round-robin in this process."""
    from memsave.errors import MemoryBudgetError

    runs = {}
    for m in methods:
        try:
            runs[m] = build_step(case, mode, m, steps)[0]
        except MemoryBudgetError as e:  # a budget below every plan: a result, reported by --measure
            print(f"{m}: {e}", file=sys.stderr)
    for run in runs.values():
        run()
    wall = {m: [] for m in runs}
    cpu = {m: [] for m in runs}
    for _ in range(rounds):
        for m, run in runs.items():
            c0, t0 = time.process_time(), time.perf_counter()
            run()
            wall[m].append(time.perf_counter() - t0)
            cpu[m].append(time.process_time() - c0)
    return {m: {"wall_s": statistics.median(wall[m]), "cpu_s": statistics.median(cpu[m])}
            for m in runs}


def _in_fresh_process(args: list[str], grads_path: str | None = None) -> dict:
    env = dict(os.environ)
    if grads_path:
        env["BENCH_LOOPS_GRADS"] = grads_path
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=HERE)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_loops {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _grads_agree(a_path, b_path) -> bool:
    import numpy as np

    a, b = np.load(a_path), np.load(b_path)
    ok = True
    for key in a.files:
        scale = float(np.max(np.abs(a[key]))) or 1.0
        ok &= bool(np.allclose(b[key], a[key], rtol=1e-5, atol=1e-6 * scale))
    return ok


# -- the report ------------------------------------------------------------------

def _exponent(points) -> float | None:
    """Least-squares slope of log(peak) against log(T)."""
    if len(points) < 2:
        return None
    xs = [math.log(t) for t, _ in points]
    ys = [math.log(p) for _, p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = set()
    for method in METHODS:
        done = sorted((r["T"], r["peak_above_bytes"] / MiB, r["forecast_above_bytes"] / MiB) for r in rows
                      if r["case"] == "keras" and r["method"] == method and "peak_above_bytes" in r)
        if done:
            lengths.update(t for t, _, _ in done)
            line, = ax.plot([t for t, _, _ in done], [p for _, p, _ in done], marker="o",
                            label=f"{method} (measured)")
            ax.plot([t for t, _, _ in done], [f for _, _, f in done], linestyle="--",
                    color=line.get_color(), label=f"{method} (forecast)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sorted(lengths), [str(t) for t in sorted(lengths)])
    ax.minorticks_off()
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak above resident (MiB)")
    ax.set_title("Keras LSTM(128) + Dense(10), batch 1024, one step")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        case, mode, method, steps = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
        print(json.dumps(measure_memory(case, mode, method, steps, int(sys.argv[6]))))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--forecast":
        case, mode, method, steps = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
        print(json.dumps(build_step(case, mode, method, steps)[1]))  # traced, not run
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--time":
        case, mode, steps, rounds = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(measure_time(case, mode, steps, sys.argv[6:], rounds)))
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--T", nargs="+", type=int, default=list(KERAS_T), help="Keras sequence lengths")
    parser.add_argument("--loop-T", type=int, default=LOOP_T, help="hand-written loop and scan length")
    parser.add_argument("--time-repeats", type=int, default=5)
    parser.add_argument("--peak-steps", type=int, default=PEAK_STEPS,
                        help="measured steps per memory process (the largest peak is reported)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(HERE / "figures" / "bench_loops.json"))
    parser.add_argument("--plot", default=str(HERE / "figures" / "loops_peak_vs_T.png"))
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="measure nothing: print the report of these --out files (joined)")
    parser.add_argument("--refresh-forecasts", metavar="JSON",
                        help="measure nothing: forecast every row of this --out file again "
                             "(memsave's model changed since it was measured) and rewrite it")
    args = parser.parse_args()
    if args.refresh_forecasts:
        return _refresh_forecasts(Path(args.refresh_forecasts))
    if args.report:
        rows = [r for path in args.report for r in json.loads(Path(path).read_text())]
        args.methods = list(dict.fromkeys(r["method"] for r in rows))
        return 1 if report(rows, args) else 0
    if args.quick:
        args.T, args.loop_T, args.time_repeats = [128], 200, 3

    import tempfile

    rows, failed = [], False
    tmp = Path(tempfile.mkdtemp(prefix="bench_loops"))
    for case in args.cases:
        lengths = {"keras": args.T, "stacked": [STACKED_T],
                   "bidirectional": [STACKED_T]}.get(case, [args.loop_T])
        for mode in CASE_MODES[case]:
            for steps in lengths:
                print(f"[{case} {mode} T={steps}] timing", file=sys.stderr, flush=True)
                try:
                    times = _in_fresh_process(["--time", case, mode, str(steps),
                                               str(args.time_repeats), *args.methods])
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(e, file=sys.stderr)
                    times, failed = {}, True
                for method in args.methods:
                    print(f"[{case} {mode} T={steps}] memory {method}", file=sys.stderr, flush=True)
                    row = {"case": case, "mode": mode, "method": method, "T": steps}
                    grads = str(tmp / f"{case}_{mode}_{steps}_{method}.npz")
                    try:
                        row.update(_in_fresh_process(["--measure", case, mode, method, str(steps),
                                                      str(args.peak_steps)], grads))
                        row["grads_equal"] = _grads_agree(
                            str(tmp / f"{case}_{mode}_{steps}_plain.npz"), grads)
                    except (RuntimeError, subprocess.TimeoutExpired, FileNotFoundError) as e:
                        print(e, file=sys.stderr)
                        row["error"] = str(e)[-500:]
                        failed = True
                    row.update(times.get(method, {}))
                    rows.append(row)
                    # Written after every row: an interrupted run keeps what it measured.
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(rows, indent=1))
    failed |= report(rows, args)
    return 1 if failed else 0


def _refresh_forecasts(path: Path) -> int:
    """Forecast each row again in a fresh process; a row whose loop choices
    differ now keeps its forecast and gets ``refresh_error``."""
    rows = json.loads(path.read_text())
    for r in rows:
        if "peak_above_bytes" not in r:
            continue
        print(f"[{r['case']} {r['mode']} T={r['T']}] forecast {r['method']}", file=sys.stderr, flush=True)
        got = _in_fresh_process(["--forecast", r["case"], r["mode"], r["method"], str(r["T"])])
        if got.get("applied") != r.get("applied"):
            r["refresh_error"] = f"choices now {got.get('applied')}"
            continue
        r["forecast_above_bytes"] = got["forecast_above_bytes"]
        path.write_text(json.dumps(rows, indent=1))
    return 0


def report(rows, args) -> bool:
    """Print the table, the exponents and the targets; True if a gradient differs."""
    plain = {(r["case"], r["mode"], r["T"]): r for r in rows if r["method"] == "plain"}
    print("| case | mode | T | method | choice | peak above resident MiB | median step MiB | "
          "peak ratio | wall ratio | CPU ratio | forecast MiB | forecast error | grads equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    bad = False
    for r in rows:
        base = plain.get((r["case"], r["mode"], r["T"]))
        if "peak_above_bytes" not in r or base is None or "peak_above_bytes" not in base:
            print(f"| {r['case']} | {r['mode']} | {r['T']} | {r['method']} | failed | | | | | | | | |")
            continue
        r["peak_ratio"] = r["peak_above_bytes"] / base["peak_above_bytes"]
        r["wall_ratio"] = r["wall_s"] / base["wall_s"] if "wall_s" in r and "wall_s" in base else None
        r["cpu_ratio"] = r["cpu_s"] / base["cpu_s"] if "cpu_s" in r and "cpu_s" in base else None
        r["forecast_error"] = r["forecast_above_bytes"] / r["peak_above_bytes"] - 1
        bad |= not r.get("grads_equal", False)
        choice = ", ".join(sorted(set(r.get("applied", {}).values()))) or "plain"
        fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        # (rows measured before --peak-steps: one step)
        median = r.get("median_peak_above_bytes", r["peak_above_bytes"])
        print(f"| {r['case']} | {r['mode']} | {r['T']} | {r['method']} | {choice} | "
              f"{r['peak_above_bytes'] / MiB:.1f} | {median / MiB:.1f} | {r['peak_ratio']:.3f} | "
              f"{fmt(r['wall_ratio'])} | "
              f"{fmt(r['cpu_ratio'])} | {r['forecast_above_bytes'] / MiB:.1f} | "
              f"{100 * r['forecast_error']:+.1f}% | {r.get('grads_equal')} |")
    keras = [r for r in rows if r["case"] == "keras" and "peak_ratio" in r]
    print()
    print("| method | exponent of peak above resident in T (Keras) |")
    print("|---|---|")
    exponents = {}
    for method in args.methods:
        pts = sorted((r["T"], r["peak_above_bytes"]) for r in keras if r["method"] == method)
        exponents[method] = _exponent(pts)
        print(f"| {method} | {'' if exponents[method] is None else f'{exponents[method]:.2f}'} |")
    _targets(rows, keras, exponents)
    if args.plot and keras:
        _plot(rows, args.plot)
        print(f"\nplot: {args.plot}")
    return bad


def _by_T(rows) -> str:
    return ", ".join(f"T={r['T']}: {r['peak_ratio']:.3f}" for r in rows)


def _targets(rows, keras, exponents) -> None:
    """Print each target of the issue with the measured figures."""
    def line(ok, text):
        print(f"- [{'x' if ok else ' '}] {text}")

    print("\nTargets (CPU-time ratios; wall ratios in the table):")
    per_step = [r for r in keras if r["method"] == "per_step"]
    if per_step:
        worst = max(r["peak_ratio"] for r in per_step)
        line(worst <= 0.35, f"Keras per-step <= 0.35x plain's peak above resident at every T: "
             f"worst {worst:.3f} ({_by_T(per_step)})")
        slow = max((r["cpu_ratio"] for r in per_step if r["cpu_ratio"]), default=None)
        if slow is not None:
            line(slow <= 1.5, f"Keras per-step step time <= 1.5x: worst CPU ratio {slow:.2f}")
    longest = max((r["T"] for r in keras), default=None)
    if longest is not None:
        at = [r for r in keras if r["T"] == longest and r["method"] != "plain"]
        picked = [r for r in at if r["method"] == "memory"]
        if picked:
            best = picked[0]
            what = f"the plan memsave picks ('memory': {', '.join(best['applied'].values())})"
        else:
            smallest = min(r["peak_ratio"] for r in at)
            # Of the methods within SAME_PEAK of the smallest peak, the fastest.
            tied = [r for r in at if r["peak_ratio"] <= smallest * (1 + SAME_PEAK)]
            best = min(tied, key=lambda r: r["cpu_ratio"] if r["cpu_ratio"] is not None else math.inf)
            what = best["method"]
        line(best["peak_ratio"] <= 0.15, f"best <= 0.15x at T={longest}: {what} "
             f"{best['peak_ratio']:.3f}")
        if best["cpu_ratio"] is not None:
            line(best["cpu_ratio"] <= 1.6, f"step time <= 1.6x at the smallest peak ({what}, "
                 f"T={longest}): CPU ratio {best['cpu_ratio']:.2f}")
        budgets = sorted((r for r in at if r["method"].startswith("budget_")
                          and r.get("budget_bytes")), key=lambda r: r["budget_bytes"])
        for r in budgets:
            measured = r["peak_above_bytes"] + r["resident_bytes"]
            line(measured <= 1.1 * r["budget_bytes"],
                 f"{r['method']} at T={longest}: measured peak {measured / MiB:.0f} MiB within +10% "
                 f"of the budget {r['budget_bytes'] / MiB:.0f} MiB ({measured / r['budget_bytes']:.2f}x; "
                 f"{', '.join(r['applied'].values())})")
        if len(budgets) == 2 and all(r["cpu_ratio"] is not None for r in budgets):
            small, large = budgets
            line(small["cpu_ratio"] >= large["cpu_ratio"],
                 f"the smaller budget never the faster: CPU ratios {small['method']} "
                 f"{small['cpu_ratio']:.2f}, {large['method']} {large['cpu_ratio']:.2f}")
    for case in ("while", "scan"):
        for r in rows:
            if r["case"] == case and r["method"] != "plain" and "peak_ratio" in r:
                line(r["peak_ratio"] <= 0.2, f"{case} {r['mode']} T={r['T']} {r['method']} <= 0.2x: "
                     f"{r['peak_ratio']:.3f}")
    for method, e in exponents.items():
        if method != "plain" and e is not None:
            line(e <= 0.6, f"exponent <= 0.6 ({method}): {e:.2f}")
    errors = [abs(r["forecast_error"]) for r in rows if "forecast_error" in r]
    if errors:
        line(max(errors) <= 0.2, f"forecast within 20% on every row: worst {100 * max(errors):.1f}%")


if __name__ == "__main__":
    sys.exit(main())
