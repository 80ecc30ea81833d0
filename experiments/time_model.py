"""How good is memsave's time model (``memsave.timemodel``)?

Three checks, on the study's models (``models.py``):

1. **Per op type** (``--models``): the model's plain SGD step in a
   ``tf.compat.v1`` Session, one kernel at a time (inter-op threads 1),
   each kernel's time read from TensorFlow's step stats (minimum over
   ``--repeats`` traced runs, ``memsave.calibrate.kernel_seconds``) and
   assigned to the forward op it is named after or to the op whose
   gradient name scope it is in (``memsave.calibrate.attribute``). Table:
   op type, count, measured and forecast milliseconds of the forward
   kernels and of the gradients, their ratio; the gradient sums (AddN),
   what the model does not cover (the optimizer's updates, constants), and
   totals for the forward pass, the backward pass and the step.
2. **Kernel-time ratios** (``--plans``, Session as above): for each plan
   (``checkpoints='memory'``, ``'speed'``, ``memory_budget=`` fractions),
   the sum of the checkpointed step's kernel times over the plain step's
   (``tf.gradients``), next to the forecast ``StepTime.ratio``, and the
   measured kernel seconds of the recomputed copies next to the forecast
   ``recompute_s``. Kernel sums are the executor's work without its
   overlap of independent kernels: the cleanest measure of what the model
   forecasts.
3. **Step-time ratios** (``--plans``, as ``study.py`` times them): each
   method a ``tf.function`` SGD step, default threads, methods interleaved
   round-robin (``--rounds``, order rotated each round), median step time;
   the ratio to ``tf.gradients``' step (and GradientTape's) next to the
   forecast ratio.

Forecasts are printed for the default profile (``timemodel.CPU_DEFAULT``)
and for a profile calibrated in the same process just before measuring
(``memsave.calibrate.calibrate``, median of ``--calibrations`` runs).
The plan's forward graph, costs and schedule are the Plan's own
(``plan.problem.fg``, ``plan.problem.costs``, ``plan.schedule``).

Usage::

    .venv/bin/python experiments/time_model.py           # everything: 15-20 min on 2 loaded cores
    .venv/bin/python experiments/time_model.py --models resnet --plans none    # check 1 only
    .venv/bin/python experiments/time_model.py --models none --plans memory speed budget-0.5
    .venv/bin/python experiments/time_model.py --models none --no-kernel-sums --threads 1

Results
-------
2-core AMD EPYC (Zen 5) VM, TensorFlow 2.21 (oneDNN), shared with other
engineers' jobs: load average 5-12 during every run below, which is why
each figure was measured more than once. Forecasts: ``CPU_DEFAULT`` (the
calibrated profiles of the same runs gave forecasts within 1% of it).

Per op type, ResNet-110 (batch 32) plain step, kernels one at a time
(``--repeats 10``; forecast / measured in the x columns):

| op type | n | fwd measured ms | fwd forecast ms | x | grad measured ms | grad forecast ms | x |
|---|---|---|---|---|---|---|---|
| Conv2D | 111 | 86.30 | 83.78 | 0.97 | 166.54 | 177.24 | 1.06 |
| FusedBatchNormV3 | 111 | 18.25 | 19.82 | 1.09 | 19.51 | 21.18 | 1.09 |
| Relu (55 fused into the batch norm) | 109 | 1.42 | 2.68 | 1.88 | 6.33 | 5.96 | 0.94 |
| AddV2 | 55 | 3.27 | 4.00 | 1.22 | 0.02 | 0.00 | - |
| gradient sums (AddN) | | | | | 2.89 | 4.10 | 1.42 |
| **forward / backward / step** | | 109.7 / 195.4 / 306.9 | 110.4 / 208.5 / 318.9 | 1.01 / 1.07 / 1.04 | | | |

Totals of the same run, forecast / measured: U-Net-64 forward 1.40,
backward 1.33, step 1.34; MLP-128 (batch 1024) 0.95, 1.06, 1.00. Between
processes the same kernels differ more than that: ResNet-110's 111
forward convolutions took 55.7, 86.3, 91.8, 91.9 and 92.0 ms in five
processes, U-Net-64's 28.1, 31.3, 42.4, 50.4 and 51.2 ms (oneDNN runs them at
about 180 or about 290 GFLOP/s), which no constant per op class follows.
What a recompute ratio scales with, the forward pass's share of the
step, is steadier: ResNet-110 measured 0.325-0.364, forecast 0.320-0.346;
U-Net-64 0.324-0.368 vs 0.314-0.344; MLP-128 0.341-0.361 vs 0.334-0.375.

Checkpointed over plain, ResNet-110 (batch 32). Kernel sums: three runs
of check 2 (``--repeats 6`` and ``10``, Sessions interleaved), median in
brackets. Step time: check 3, default threads (20 rounds, load 7) and one
thread (15 rounds). The last column is issue 19's table (``run.sh``, ratio
to GradientTape, measured by others at an earlier commit with the same
planner), for comparison:

| plan | copies run | forecast | kernel sums (median) | step, default threads | step, 1 thread | issue 19 |
|---|---|---|---|---|---|---|
| memory | 386 | 1.362 | 1.196, 1.449, 1.355 (1.355) | 1.465 | 1.363 | 1.35 |
| speed | 277 | 1.155 | 1.137, 1.232, 1.036 (1.137) | 1.344 | 0.988 | 1.14 |
| budget 0.2 | 272 | 1.271 | 1.236, 1.379, 1.088 (1.236) | 1.438 | 1.169 | 1.27 |
| budget 0.35 | 236 | 1.231 | 1.165, 1.308, 1.119 (1.165) | 1.375 | 1.220 | 1.25 |
| budget 0.5 | 188 | 1.189 | 0.888, 1.280, 1.194 (1.194) | 1.440 | 1.166 | 1.17 |
| budget 0.75 | 134 | 1.132 | 1.093, 1.156, 1.060 (1.093) | 1.300 | 1.124 | 1.13 |

Against the medians of the kernel sums the forecast is within +6% (memory
+0.5%, speed +1.6%, 0.2 +2.8%, 0.35 +5.7%, 0.5 -0.4%, 0.75 +3.6%), and
within 2% of issue 19's figures; single runs scatter by +-10-15% around
it. The recomputed copies themselves are forecast closely in every run
(ResNet-110 'memory': 103.1, 112.2, 113.0 ms measured vs 113.0; budget
0.5: 45.1, 59.1, 58.5 vs 57.7; 'speed': 24.7, 21.1, 18.8 vs 29.3, the one
class of copies over-forecast). What moves the measured ratios is the
gradients: in a checkpointed step they ran 0.74-1.05x as long as in the
plain one (median 0.98), with no trend a plan explains on ResNet-110.
Step times with default threads under load ran 7-17% above the forecast
(more kernels: 'speed' runs twice plain's 2413, each a dispatch the
loaded machine makes slow); with one thread, within 9% except 'speed'
(which measured no slower than plain).

U-Net-64 (batch 32; budget 0.2 is infeasible, memsave refuses it), one run:

| plan | copies run | forecast | kernel sums | step, default threads |
|---|---|---|---|---|
| memory | 196 | 1.343 | 1.212 | 1.270 |
| speed | 144 | 1.126 | 0.992 | 1.057 |
| budget 0.35 | 203 | 1.359 | 1.130 | 1.185 |
| budget 0.5 | 104 | 1.206 | 1.068 | 1.152 |
| budget 0.75 | 80 | 1.157 | 1.109 | 1.120 |

Here the forecast is high by 3-15% (step times) and 4-20% (kernel sums):
the checkpointed steps' gradients ran 0.84-0.98x as long as plain's (a
tensor recomputed just before its gradient reads it is still in cache;
the model counts every read at one bandwidth), and the copies of its
16-channel convolutions ran faster than forecast. Budget 0.35 forecasts
more recomputation than 'memory' (1.359 vs 1.343): a plan the FLOP-based
planner chose that seconds would not.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tensorflow as tf  # noqa: E402

import memsave  # noqa: E402
import models  # noqa: E402
from memsave import calibrate, timemodel  # noqa: E402

log = logging.getLogger("time_model")

#: (model, size, batch) of each model checked: the study's ResNet-110 and
#: U-Net-64 at batch 32, and its deepest MLP at its batch.
CASES = {"resnet": ("resnet", 18, 32), "unet": ("unet", 8, 32), "mlp": ("mlp", 128, 1024)}

#: Plans of checks 2 and 3: name -> gradients() keywords.
PLANS = {
    "memory": dict(checkpoints="memory"),
    "speed": dict(checkpoints="speed"),
    "budget-0.2": dict(memory_budget=0.2),
    "budget-0.35": dict(memory_budget=0.35),
    "budget-0.5": dict(memory_budget=0.5),
    "budget-0.75": dict(memory_budget=0.75),
}

MS = 1e3


@tf.autograph.experimental.do_not_convert
def _plan_parts(loss, variables, plan):
    """The forward graph, costs and schedule memsave plans for ``loss`` (schedule None: plain)."""
    kw = PLANS.get(plan, {})
    p = memsave.plan([loss], variables, checkpoints=kw.get("checkpoints", "memory"),
                     memory_budget=kw.get("memory_budget"))
    return p.problem.fg, p.problem.costs, (p.schedule if plan else None)


def _gradients(loss, variables, plan):
    if plan is None:
        return tf.gradients(loss, variables)
    return memsave.gradients(loss, variables, **PLANS[plan])


def _session_step(case, plan, lr=0.0):
    """A tf.compat.v1 graph of one SGD step; returns (graph, fetches, fg, costs, schedule)."""
    name, size, batch = case
    model = models.MODELS[name]
    init = model.init(size, 0)
    x_np, y_np = model.batch(batch, 0)
    g = tf.Graph()
    with g.as_default():
        params = {k: tf.Variable(v, name=k.replace("/", "_")) for k, v in init.items()}
        variables = list(params.values())
        loss = model.loss(size, params, tf.constant(x_np), tf.constant(y_np), models.Arch())
        fg, costs, schedule = _plan_parts(loss, variables, plan)
        grads = _gradients(loss, variables, plan)
        train = tf.group([v.assign_sub(lr * d) for v, d in zip(variables, grads)])
        init_op = tf.compat.v1.global_variables_initializer()
    return g, init_op, [train, loss], fg, costs, schedule


def _kernels(case, plans, repeats):
    """Per plan (None: plain): (kernel times, fg, costs, schedule).

    The Sessions' traced runs are interleaved round-robin (order rotated
    each round) and each kernel's minimum is kept, so that a burst of load
    from other jobs does not fall on one plan only.
    """
    built = {}
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
    for plan in list(plans):
        try:
            g, init_op, fetches, fg, costs, schedule = _session_step(case, plan)
        except memsave.MemoryBudgetError as e:
            _infeasible(case, plan, e)
            plans = [p for p in plans if p != plan]
            continue
        s = tf.compat.v1.Session(graph=g, config=config)
        s.run(init_op)
        s.run(fetches)
        built[plan] = (s, fetches, fg, costs, schedule)
    best = {plan: {} for plan in plans}
    wall = {plan: [] for plan in plans}
    for r in range(repeats):
        order = plans[r % len(plans):] + plans[:r % len(plans)]
        for plan in order:
            s, fetches = built[plan][:2]
            for name, (kind, sec) in calibrate.kernel_seconds(
                    s, fetches, repeats=1, warmup=False).items():
                if name not in best[plan] or sec < best[plan][name][1]:
                    best[plan][name] = (kind, sec)
            t0 = time.perf_counter()
            s.run(fetches)
            wall[plan].append(time.perf_counter() - t0)
    out = {}
    for plan, (s, _, fg, costs, schedule) in built.items():
        s.close()
        out[plan] = (best[plan], fg, costs, schedule, min(wall[plan]))
    return out


def _profiles(n: int):
    out = {"default": timemodel.CPU_DEFAULT}
    if n:
        runs = [calibrate.calibrate() for _ in range(n)]
        out["calibrated"] = calibrate.median_profile(runs) if n > 1 else runs[0]
    return out


def _describe(p: timemodel.DeviceProfile) -> str:
    effs = ", ".join(f"{c} {e.compute:.3g}/{e.memory:.3g}/{e.gradient:.3g}"
                     for c, e in sorted(p.efficiency.items()))
    return (f"{p.name}: peak {p.peak_flops_per_s / 1e9:.0f} GFLOP/s, {p.bytes_per_s / 1e9:.0f} GB/s, "
            f"overhead {p.overhead_s * 1e6:.2f} us, gemm_half_k {p.gemm_half_k:g}; "
            f"efficiency compute/memory/gradient: {effs}")


# -- check 1: per op type -----------------------------------------------------------------


def op_table(case, profiles, repeats):
    times, fg, costs, _, _ = _kernels(case, [None], repeats)[None]
    measured = calibrate.attribute(fg, times)
    label = models.MODELS[case[0]].label(case[1])
    print(f"\n### {label}, batch {case[2]}: plain step, kernels by forward op type\n")
    for pname, profile in profiles.items():
        sec = timemodel.op_seconds(fg, costs, profile)
        rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
        for op in fg.ops:
            r = rows[op.type]
            r[0] += 1
            r[1] += measured.forward[op.index] or 0.0
            r[2] += sec.forward[op.index]
            r[3] += measured.gradient[op.index]
            r[4] += sec.gradient[op.index]
        print(f"Forecast: {pname} profile.\n")
        print("| op type | n | fwd measured ms | fwd forecast ms | x | grad measured ms | "
              "grad forecast ms | x |")
        print("|---|---|---|---|---|---|---|---|")
        for t, (n, mf, ff, mg, fgr) in sorted(rows.items(), key=lambda kv: -(kv[1][1] + kv[1][3])):
            if mf + ff + mg + fgr < 1e-5:
                continue
            print(f"| {t} | {n} | {mf * MS:.2f} | {ff * MS:.2f} | {_x(ff, mf)} | {mg * MS:.2f} | "
                  f"{fgr * MS:.2f} | {_x(fgr, mg)} |")
        sums_m = measured.other.get("AddN", 0.0)
        sums_f = sum(sec.accumulate)
        rest = sum(v for k, v in measured.other.items() if k != "AddN")
        fw_m = sum(v or 0.0 for v in measured.forward)
        bw_m = sum(measured.gradient) + sums_m
        print(f"| gradient sums (AddN) | | | | | {sums_m * MS:.2f} | {sums_f * MS:.2f} | "
              f"{_x(sums_f, sums_m)} |")
        print(f"| not modelled (optimizer update, constants: "
              f"{', '.join(k for k, _ in collections.Counter(measured.other).most_common(3) if k != 'AddN')}) "
              f"| | {rest * MS:.2f} | | | | | |")
        print(f"| **forward** | | {fw_m * MS:.1f} | {sec.forward_s * MS:.1f} | "
              f"{_x(sec.forward_s, fw_m)} | | | |")
        print(f"| **backward** | | | | | {bw_m * MS:.1f} | {sec.backward_s * MS:.1f} | "
              f"{_x(sec.backward_s, bw_m)} |")
        step_f = sec.forward_s + sec.backward_s
        print(f"| **step (kernel sum)** | | {(fw_m + bw_m + rest) * MS:.1f} | {step_f * MS:.1f} | "
              f"{_x(step_f, fw_m + bw_m + rest)} | | | |")
        print(f"\nforward / step: measured {fw_m / (fw_m + bw_m):.3f}, forecast "
              f"{sec.forward_s / step_f:.3f}\n")


def _x(forecast, measured):
    return f"{forecast / measured:.2f}" if measured > 0 else "-"


# -- check 2: kernel-time ratios ----------------------------------------------------------


def kernel_ratios(case, plans, profiles, repeats):
    label = models.MODELS[case[0]].label(case[1])
    runs = _kernels(case, [None] + list(plans), repeats)
    base_times, fg, costs, _, base_wall = runs[None]
    base = _split(calibrate.attribute(fg, base_times))
    names = list(profiles)
    print(f"\n### {label}, batch {case[2]}: kernel-time sums (one kernel at a time), "
          f"checkpointed over plain tf.gradients\n")
    print(f"Plain: forward {base['forward'] * MS:.1f} ms, gradients {base['gradient'] * MS:.1f} ms, "
          f"other kernels (sums, optimizer) {base['other'] * MS:.1f} ms, total "
          f"{base['total'] * MS:.1f} ms in {len(base_times)} kernels; untraced step (fastest "
          f"of {repeats}) {base_wall * MS:.1f} ms. Copies: the recomputed ops' kernels; gates: "
          f"the other kernels beyond plain's (the rewrite's gates and proxies, extra sums).\n")
    print("| plan | copies run | measured ratio | "
          + " | ".join(f"forecast ({n}) | err" for n in names)
          + " | copies ms: measured | " + " | ".join(f"({n})" for n in names)
          + " | gates ms: measured | " + " | ".join(f"({n})" for n in names)
          + " | gradients ms (x plain) | kernels (x plain) | untraced wall x plain |")
    print("|---|---|---|" + "---|---|" * len(names) + "---|" + "---|" * len(names)
          + "---|" + "---|" * len(names) + "---|---|---|")
    rows = []
    for plan in [p for p in plans if p in runs]:
        times, pfg, pcosts, schedule, plan_wall = runs[plan]
        parts = _split(calibrate.attribute(pfg, times))
        fc = {n: timemodel.step_time(pfg, pcosts, schedule, profile=p) for n, p in profiles.items()}
        ratio = parts["total"] / base["total"]
        cells = " | ".join(f"{fc[n].ratio:.3f} | {fc[n].ratio / ratio - 1:+.1%}" for n in names)
        rec = " | ".join(f"{fc[n].recompute_s * MS:.1f}" for n in names)
        gates = " | ".join(f"{fc[n].rewrite_s * MS:.1f}" for n in names)
        print(f"| {plan} | {fc[names[0]].recomputed_ops} | {ratio:.3f} | {cells} | "
              f"{parts['recompute'] * MS:.1f} | {rec} | {(parts['other'] - base['other']) * MS:.1f} "
              f"| {gates} | {parts['gradient'] * MS:.1f} ({parts['gradient'] / base['gradient']:.2f}) "
              f"| {len(times)} ({len(times) / len(base_times):.2f}) | {plan_wall / base_wall:.3f} |")
        rows.append((plan, ratio, fc))
    return rows


def _infeasible(case, plan, e):
    label = models.MODELS[case[0]].label(case[1])
    print(f"\n{label} {plan}: not run: {str(e).split(': ', 1)[-1]}")


def _split(a: "calibrate.Attribution") -> dict:
    out = {"forward": sum(v or 0.0 for v in a.forward), "recompute": sum(a.recompute),
           "gradient": sum(a.gradient), "other": sum(a.other.values())}
    out["total"] = sum(out.values())
    return out


# -- check 3: step-time ratios (as study.py times them) -----------------------------------


def wall_ratios(case, plans, profiles, rounds, steps, threads=0):
    name, size, batch = case
    model = models.MODELS[name]
    init = model.init(size, 0)
    x_np, y_np = model.batch(batch, 0)
    params = {k: tf.Variable(v, name=k.replace("/", "_")) for k, v in init.items()}
    variables = list(params.values())
    x, y = tf.constant(x_np), tf.constant(y_np)
    lr = tf.Variable(0.0, trainable=False)
    forecasts = {}

    def make(method):
        def step(x, y):
            if method == "GradientTape":
                with tf.GradientTape() as tape:
                    loss = model.loss(size, params, x, y, models.Arch())
                grads = tape.gradient(loss, variables)
            else:
                loss = model.loss(size, params, x, y, models.Arch())
                plan = None if method == "tf.gradients" else method
                if plan is not None:
                    fg, costs, schedule = _plan_parts(loss, variables, plan)
                    forecasts[method] = {n: timemodel.step_time(fg, costs, schedule, profile=p)
                                         for n, p in profiles.items()}
                grads = _gradients(loss, variables, plan)
            for v, d in zip(variables, grads):
                v.assign_sub(lr * d)
            return loss
        return tf.function(step)

    methods = ["GradientTape", "tf.gradients"] + list(plans)
    fns = {}
    for m in list(methods):
        t0 = time.perf_counter()
        try:
            fns[m] = make(m)
            fns[m](x, y).numpy()
        except memsave.MemoryBudgetError as e:
            _infeasible(case, m, e)
            methods.remove(m)
            continue
        log.info("%s: built and ran in %.1f s", m, time.perf_counter() - t0)
    plans = [p for p in plans if p in methods]
    times = {m: [] for m in methods}
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            for _ in range(steps):
                t0 = time.perf_counter()
                fns[m](x, y).numpy()
                times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    label = model.label(size)
    names = list(profiles)
    print(f"\n### {label}, batch {batch}: step time (tf.function, "
          f"{threads or 'default'} threads, {rounds} interleaved rounds x {steps} steps, median)\n")
    print(f"tf.gradients {med['tf.gradients'] * MS:.0f} ms, GradientTape "
          f"{med['GradientTape'] * MS:.0f} ms\n")
    print("The forecast ratio is to plain tf.gradients; err: forecast / measured - 1, to "
          "tf.gradients' step and to GradientTape's.\n")
    print("| plan | step ms | x tf.gradients | x GradientTape | "
          + " | ".join(f"forecast ({n}) | err | err (tape)" for n in names) + " |")
    print("|---|---|---|---|" + "---|---|---|" * len(names))
    out = []
    for m in plans:
        ratio = med[m] / med["tf.gradients"]
        tape = med[m] / med["GradientTape"]
        cells = " | ".join(f"{forecasts[m][n].ratio:.3f} | {forecasts[m][n].ratio / ratio - 1:+.1%} | "
                           f"{forecasts[m][n].ratio / tape - 1:+.1%}" for n in names)
        print(f"| {m} | {med[m] * MS:.0f} | {ratio:.3f} | {tape:.3f} | {cells} |")
        out.append((m, ratio, forecasts[m]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(CASES), help="check 1: 'none' to skip")
    p.add_argument("--plans", nargs="+", default=list(PLANS), help="checks 2, 3: 'none' to skip")
    p.add_argument("--plan-models", nargs="+", default=["resnet"], choices=list(CASES))
    p.add_argument("--size", type=int, help="override the models' size (a quick look)")
    p.add_argument("--repeats", type=int, default=5, help="traced runs per Session step")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=2, help="timed steps per method per round")
    p.add_argument("--calibrations", type=int, default=3,
                   help="calibration runs (median); 0: default profile only")
    p.add_argument("--no-kernel-sums", action="store_true", help="skip check 2")
    p.add_argument("--no-wall", action="store_true", help="skip check 3")
    p.add_argument("--threads", type=int, default=0,
                   help="check 3's intra- and inter-op threads (0: TensorFlow's default); "
                        "1 is far less sensitive to other jobs on the machine")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if a.threads:
        # Before TensorFlow runs anything; the Sessions of checks 1-2 set their own.
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
        tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    logging.getLogger("memsave").setLevel(logging.WARNING)
    plans = [] if a.plans == ["none"] else a.plans
    if a.size:
        for k, (m, _, b) in list(CASES.items()):
            CASES[k] = (m, a.size, b)
    cases = [] if a.models == ["none"] else a.models

    t0 = time.perf_counter()
    profiles = _profiles(a.calibrations)
    log.info("calibrated in %.1f s", time.perf_counter() - t0)
    print("## memsave time model: forecast vs measured\n")
    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start.\n")
    for n, prof in profiles.items():
        print(f"- profile {n}: {_describe(prof)}")
    for c in cases:
        op_table(CASES[c], profiles, a.repeats)
    for c in a.plan_models if plans else []:
        if not a.no_kernel_sums:
            kernel_ratios(CASES[c], plans, profiles, a.repeats)
        if not a.no_wall:
            wall_ratios(CASES[c], plans, profiles, a.rounds, a.steps, a.threads)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end; {time.perf_counter() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
