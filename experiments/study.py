"""The memory/speed study: does memsave save memory, and what does it cost?

For four models (see ``models.py``): a CIFAR-10-shaped ResNet, a deep MLP
chain, a U-Net-like net whose long skips leave no articulation point and an
LSTM run by a ``tf.while_loop`` (swept over sequence length), each at a
sweep of depths, on a fixed synthetic batch, this trains a few SGD
steps inside a ``tf.function`` with each gradient method:

- ``GradientTape``        the baseline every ratio is taken against
- ``tf.gradients``        the symbolic gradients memsave is a drop-in for
- ``memsave-memory``      ``memsave.gradients(..., checkpoints='memory')``
- ``memsave-speed``       ``memsave.gradients(..., checkpoints='speed')``
- ``memsave-collection``  ``checkpoints='collection'`` with the tensors a
                          user would tag (ResNet: every block output)
- ``recompute_grad``      ``tf.recompute_grad`` on hand-made groups of
                          about sqrt(n) blocks, differentiated by
                          GradientTape: the built-in alternative

and measures, in one fresh process per (model, depth):

- peak memory: ``tf.config.experimental.reset_memory_stats('CPU:0')``, a
  method's ``--steps`` steps, then ``get_memory_info('CPU:0')['peak']``
  (the allocator's real peak, bytes in use, including the weights and the
  batch, which all methods share: one set of variables in the process);
  median over rounds. ``step_peak`` is peak minus what was in use at the
  reset, i.e. what the step itself added;
- step time: median over all timed steps, the methods run round-robin
  (``--rounds`` rounds, the order rotated each round) so that the ratios
  hold on a shared machine where absolute times drift;
- build time: tracing the step (``get_concrete_function``: Python tracing
  and building the gradient graph, where memsave's rewrite runs) plus the
  first call (Grappler and one step);
- correctness: the first call runs at the initial weights with a learning
  rate of 0; each method's gradients are reduced to two numbers per
  variable (sum of squares, and the dot product with the weights) and
  compared with GradientTape's. A difference beyond float32 round-off is an
  error (exit status 1), not a footnote.

Then the largest ResNet (blocks per stage) each method can train under a
memory cap, by search over depth: each probe is a fresh process that builds
the model, takes two steps and reports the allocator's peak; the search
starts from a prediction interpolated from the sweep, gallops, then
bisects (peak is taken to grow with depth), bounded by
``--search-max-blocks``.

Writes to ``--out`` (default ``results/``): ``study.csv`` (one row per
model, depth and method), ``max_depth.csv``, ``fits.csv`` and the plots
``memory_vs_depth.png``, ``time_vs_depth.png``, ``max_depth.png``; prints
Markdown tables to stdout and progress to stderr.

Usage::

    ./experiments/run.sh                      # the default study, about 8-9 min on 2 cores
    ./experiments/run.sh --models resnet --blocks-per-stage 1 3 --no-search  # a quick look
    ./experiments/run.sh --blocks-per-stage 1 3 9 18 27 --search-max-blocks 96
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import platform
import statistics
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # the CPU allocator's stats: see allocator.py

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
MiB = 2**20
sys.path.insert(0, str(HERE))  # registry and models live next to this script
import registry  # noqa: E402  (imports no TensorFlow)

BASELINE = registry.BASELINE
#: Gradients of one loss from different graphs differ by float32 round-off
#: (op fusion, summation order); on these models the digests agree to about
#: 1e-6 relative. A wrong gradient is off by orders of magnitude more.
GRAD_RTOL = 1e-4

log = logging.getLogger("study")
#: TensorFlow's C++ info lines at start-up (absl logging ignores TF_CPP_MIN_LOG_LEVEL for them)
CHATTER = re.compile(r"^(I0000 |WARNING: All log messages before absl|To enable the following "
                     r"instructions|.*cpu_feature_guard)")


# ======================================================================================
# Child process: one (model, depth), all methods; or one max-depth probe
# ======================================================================================


class _Capture(logging.Handler):
    """Collects memsave's log messages (what it kept, or why it fell back)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _make_step(model, size, params, method, lr, ctx=None):
    """tf.function: one SGD step; returns the loss and a [num_vars, 2] gradient digest.

    ``ctx``: what other methods measured first (see registry.Method.after).
    """
    import tensorflow as tf

    m = registry.METHODS[method]
    arch = m.arch()
    variables = list(params.values())
    ctx = ctx if ctx is not None else {"peak_bytes": {}}

    def step(x, y):
        loss, grads = m.gradients(lambda: model.loss(size, params, x, y, arch), variables, ctx)
        digest = []
        for v, g in zip(variables, grads):
            # v is read before its update (automatic control dependencies keep program order)
            digest.append(tf.stack([tf.reduce_sum(g * g), tf.reduce_sum(g * v)]))
            v.assign_sub(lr * g)
        return loss, tf.stack(digest)

    return tf.function(step)


def _setup(model_name, size, batch, seed):
    import numpy as np
    import tensorflow as tf

    import models

    model = models.MODELS[model_name]
    init = model.init(size, seed)
    x_np, y_np = model.batch(batch, seed)
    params = {k: tf.Variable(v, name=k.replace("/", "_")) for k, v in init.items()}
    w_norms = np.array([float(np.linalg.norm(v)) for v in init.values()])
    return model, params, tf.constant(x_np), tf.constant(y_np), w_norms, init


def child_measure(a) -> dict:
    import numpy as np
    import tensorflow as tf

    model, params, x, y, w_norms, init = _setup(a.model, a.size, a.batch, a.seed)
    lr = tf.Variable(0.0, trainable=False)
    n_params = int(sum(v.size for v in init.values()))
    del init
    label = model.label(a.size)
    log.info("%s (%s %d, %d parameters), batch %d: building %d methods",
             label, model.size_name, a.size, n_params, a.batch, len(a.methods))

    # One-off costs of the first trace in a process (imports, registrations) are
    # paid on a throwaway model of size 1, so no method pays them.
    wm, wp, wx, wy, _, _ = _setup(a.model, 1, a.batch, a.seed)
    _make_step(wm, 1, wp, "GradientTape", tf.Variable(0.0))(wx, wy)[0].numpy()
    del wm, wp, wx, wy

    capture = _Capture()
    mlog = logging.getLogger("memsave")
    mlog.addHandler(capture)
    mlog.setLevel(logging.INFO)
    mlog.propagate = False  # shown once, in the line below
    res = {m: {"method": m, "error": "", "notes": "", "step_s": [], "cpu_s": [], "peak_bytes": [],
               "idle_bytes": [], "expected_error": False} for m in a.methods}
    steps = {}
    ctx = {"peak_bytes": {}}
    for m in a.methods:
        r = res[m]
        capture.messages.clear()
        try:
            for dep in registry.METHODS[m].after:  # measured first: their peaks reach ctx
                if dep in steps and dep not in ctx["peak_bytes"]:
                    steps[dep](x, y)[0].numpy()
                    tf.config.experimental.reset_memory_stats("CPU:0")
                    steps[dep](x, y)[0].numpy()
                    ctx["peak_bytes"][dep] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            ctx.pop("plan", None)
            fn = _make_step(model, a.size, params, m, lr, ctx)
            t0 = time.perf_counter()
            fn.get_concrete_function(x, y)
            r["plan"] = ctx.pop("plan", None)
            # memsave's methods plan once more for the report (registry.memsave_gradients)
            r["trace_s"] = time.perf_counter() - t0 - (r["plan"] or {}).pop("plan_s", 0.0)
            t0 = time.perf_counter()
            loss, digest = fn(x, y)  # at the initial weights: lr is 0
            r["loss0"] = float(loss.numpy())
            r["digest"] = digest.numpy()
            r["first_call_s"] = time.perf_counter() - t0
            steps[m] = fn
        except Exception as exc:  # report, go on with the other methods
            r["expected_error"] = registry.METHODS[m].expects(exc)
            if r["expected_error"]:
                log.info("%s %s: %s", label, m, str(exc).strip().splitlines()[-1][:300])
            else:
                log.exception("%s %s failed", label, m)
            r["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        r["notes"] = " | ".join(dict.fromkeys(
            msg.split(": ", 1)[-1] if "nothing to checkpoint" not in msg else
            "nothing to checkpoint: fell back to tf.gradients" for msg in capture.messages))
        if not r["error"]:
            log.info("%-12s %-19s trace %.2f s, first call %.2f s%s", label, m, r["trace_s"],
                     r["first_call_s"], f"  [memsave: {r['notes']}]" if r["notes"] else "")
    mlog.removeHandler(capture)
    mlog.propagate = True

    lr.assign(a.lr)
    ok = [m for m in a.methods if m in steps]
    for rnd in range(a.rounds):
        order = ok[rnd % len(ok):] + ok[:rnd % len(ok)] if ok else []
        for m in order:
            r = res[m]
            try:
                tf.config.experimental.reset_memory_stats("CPU:0")
                r["idle_bytes"].append(tf.config.experimental.get_memory_info("CPU:0")["current"])
                for _ in range(a.steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    steps[m](x, y)[0].numpy()
                    r["step_s"].append(time.perf_counter() - t0)
                    r["cpu_s"].append(time.process_time() - c0)
                r["peak_bytes"].append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            except Exception as exc:
                log.exception("%s %s failed", label, m)
                r["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
                ok.remove(m)
        log.info("%-12s round %d/%d: %s", label, rnd + 1, a.rounds, ", ".join(
            f"{m} {res[m]['peak_bytes'][-1] / MiB:.0f} MiB {1e3 * res[m]['step_s'][-1]:.0f} ms"
            for m in order if res[m]["peak_bytes"]))

    # Correctness, against the baseline's digest at the same initial weights.
    base = res.get(BASELINE, {}).get("digest")
    for m in a.methods:
        r = res[m]
        d = r.pop("digest", None)
        if base is None or d is None:
            continue
        ss_b, ss = base[:, 0], d[:, 0]
        ss_err = np.abs(ss - ss_b) / np.maximum(ss_b, 1e-30)
        # dot(g, w): error relative to |g| |w|, its largest possible size
        dot_err = np.abs(d[:, 1] - base[:, 1]) / np.maximum(np.sqrt(ss_b) * w_norms, 1e-30)
        dot_err[w_norms == 0] = 0.0
        r["grad_err"] = float(max(ss_err.max(), dot_err.max()))
        r["loss0_diff"] = abs(r["loss0"] - res[BASELINE]["loss0"])

    out = []
    for m in a.methods:
        r = res[m]
        row = {"method": m, "error": r["error"], "notes": r["notes"],
               "expected_error": r["expected_error"], **(r.get("plan") or {})}
        if not r["error"]:
            peak, idle = statistics.median(r["peak_bytes"]), statistics.median(r["idle_bytes"])
            row.update(
                peak_MiB=peak / MiB, idle_MiB=idle / MiB, step_peak_MiB=(peak - idle) / MiB,
                step_ms=1e3 * statistics.median(r["step_s"]),
                step_min_ms=1e3 * min(r["step_s"]),
                step_cpu_ms=1e3 * statistics.median(r["cpu_s"]),
                trace_s=r["trace_s"], first_call_s=r["first_call_s"],
                build_s=r["trace_s"] + r["first_call_s"],
                grad_err=r.get("grad_err", math.nan), loss0=r["loss0"],
                peaks_MiB=" ".join(f"{b / MiB:.1f}" for b in r["peak_bytes"]),
            )
        out.append(row)
    return {"model": a.model, "size": a.size, "depth": model.depth(a.size), "label": label,
            "batch": a.batch, "params": n_params, "rows": out, "tensorflow": tf.__version__}


def child_probe(a) -> dict:
    """Peak of one method's second training step at one depth (a max-depth probe)."""
    import tensorflow as tf

    model, params, x, y, _, _ = _setup(a.model, a.size, a.batch, a.seed)
    logging.getLogger("memsave").setLevel(logging.ERROR)
    fn = _make_step(model, a.size, params, a.methods[0], tf.Variable(a.lr))
    t0 = time.perf_counter()
    fn(x, y)[0].numpy()  # trace, Grappler, one step
    build_s = time.perf_counter() - t0
    tf.config.experimental.reset_memory_stats("CPU:0")
    t0 = time.perf_counter()
    fn(x, y)[0].numpy()
    step_s = time.perf_counter() - t0
    return {"peak_bytes": tf.config.experimental.get_memory_info("CPU:0")["peak"],
            "build_s": build_s, "step_s": step_s}


def _run_child(kind: str, model: str, size: int, batch: int, methods, args) -> dict | None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind,
           "--models", model, "--size", str(size), "--batch-size", str(batch),
           "--steps", str(args.steps), "--rounds", str(args.rounds), "--lr", str(args.lr),
           "--seed", str(args.seed), "--threads", str(args.threads), "--methods", *methods]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    # The child's progress goes to our stderr, without TensorFlow's C++ start-up
    # chatter; the last line of its stdout is the result.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        for line in proc.stderr:
            if not CHATTER.match(line):
                sys.stderr.write(line)
        proc.wait()
        out.seek(0)
        lines = out.read().strip().splitlines()
    if proc.returncode != 0 or not lines:
        log.error("%s %s size %d (%s) failed with exit status %d", kind, model, size,
                  ", ".join(methods), proc.returncode)
        return None
    return json.loads(lines[-1])


# ======================================================================================
# Parent: sweep, max-depth search, fits, report
# ======================================================================================


def sweep(args) -> list[dict]:
    rows = []
    for model in args.models:
        sizes = getattr(args, f"{model}_sizes")
        batch = _batch(args, model)
        for size in sizes:
            methods = registry.methods_for(model, args.methods, largest=size == max(sizes))
            t0 = time.perf_counter()
            res = _run_child("measure", model, size, batch, methods, args)
            if res is None:
                rows += [{"model": model, "size": size, "method": m, "error": "process failed"}
                         for m in methods]
                continue
            base = next((r for r in res["rows"] if r["method"] == BASELINE and not r["error"]), None)
            for r in res["rows"]:
                row = {k: res[k] for k in ("model", "size", "depth", "label", "batch", "params",
                                           "tensorflow")}
                row.update(r)
                if base and not r["error"]:
                    for k in ("peak_MiB", "step_peak_MiB", "step_ms", "step_min_ms", "step_cpu_ms",
                              "build_s"):
                        row[k + "_ratio"] = r[k] / base[k] if base[k] else math.nan
                rows.append(row)
            log.info("%s done in %.0f s", res["label"], time.perf_counter() - t0)
    return rows


def _batch(args, model: str) -> int:
    """The batch of ``model``: ``--batch MODEL=N``, else ``--batch-size``, else the model's own."""
    return args.batch.get(model) or args.batch_size or registry.MODELS[model].batch_size


def _predict_size(sweep_rows, method, cap_bytes, batch) -> int | None:
    """Blocks per stage at which the sweep's peaks (interpolated in n) reach the cap."""
    pts = sorted((r["size"], r["peak_MiB"] * MiB) for r in sweep_rows
                 if r["model"] == "resnet" and r["method"] == method and not r.get("error")
                 and r.get("batch") == batch)
    if len(pts) < 2:
        return None
    for (n0, p0), (n1, p1) in zip(pts, pts[1:]):
        if p1 >= cap_bytes:
            break
    if p1 <= p0:
        return None
    return max(1, int(n0 + (cap_bytes - p0) * (n1 - n0) / (p1 - p0)))


def max_depth_search(args, sweep_rows) -> list[dict]:
    cap_bytes = args.cap_mib * MiB
    bound = args.search_max_blocks
    batch = _batch(args, "resnet")
    out = []
    for method in [m for m in args.methods if registry.METHODS[m].search]:
        probes: dict[int, float] = {}

        def fits_cap(n: int) -> bool:
            if n not in probes:
                t0 = time.perf_counter()
                res = _run_child("probe", "resnet", n, batch, [method], args)
                if res is None:
                    raise RuntimeError(f"probe {method} at {n} blocks/stage failed")
                probes[n] = res["peak_bytes"]
                log.info("max depth %-19s ResNet-%d: peak %.1f MiB %s cap %.0f MiB (%.0f s)",
                         method, 6 * n + 2, res["peak_bytes"] / MiB,
                         "<=" if res["peak_bytes"] <= cap_bytes else ">", args.cap_mib,
                         time.perf_counter() - t0)
            return probes[n] <= cap_bytes

        start = _predict_size(sweep_rows, method, cap_bytes, batch) or 1
        start = min(max(start, 1), bound)
        lo, hi = 0, bound + 1  # largest size known to fit, smallest known not to
        try:
            if fits_cap(start):
                lo, step = start, 1
                while lo < bound:
                    n = min(lo + step, bound)
                    if fits_cap(n):
                        lo, step = n, 2 * step
                    else:
                        hi = n
                        break
            else:
                hi, step = start, 1
                while hi > 1:
                    n = max(hi - step, 1)
                    if fits_cap(n):
                        lo = n
                        break
                    hi, step = n, 2 * step
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits_cap(mid):
                    lo = mid
                else:
                    hi = mid
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        out.append({
            "method": method, "cap_MiB": args.cap_mib, "batch": batch,
            "max_blocks_per_stage": lo, "max_depth": 6 * lo + 2 if lo else 0,
            "at_bound": lo >= bound, "bound_blocks_per_stage": bound,
            "peak_at_max_MiB": probes[lo] / MiB if lo in probes else math.nan,
            "probes": " ".join(f"{n}:{probes[n] / MiB:.1f}" for n in sorted(probes)),
            "error": error,
        })
    base = next((r for r in out if r["method"] == BASELINE), None)
    for r in out:
        r["depth_ratio"] = (r["max_depth"] / base["max_depth"]
                            if base and base["max_depth"] else math.nan)
    return out


def fit_peaks(rows) -> list[dict]:
    """Per model and method: peak = a + b sqrt(depth), and step_peak = c depth^k."""
    import numpy as np

    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["depth"], r["peak_MiB"], r["step_peak_MiB"]) for r in rows
                         if r["model"] == model and r["method"] == method and not r.get("error"))
            if len(pts) < 2:
                continue
            d, peak, step_peak = (np.array(v, float) for v in zip(*pts))
            A = np.stack([np.ones_like(d), np.sqrt(d)], axis=1)
            (a, b), *_ = np.linalg.lstsq(A, peak, rcond=None)
            rel = float(np.max(np.abs(A @ [a, b] - peak) / peak))
            L = np.stack([np.ones_like(d), d], axis=1)
            (la, lb), *_ = np.linalg.lstsq(L, peak, rcond=None)
            lin_rel = float(np.max(np.abs(L @ [la, lb] - peak) / peak))
            k, logc = np.polyfit(np.log(d), np.log(np.maximum(step_peak, 1e-3)), 1)
            out.append({"model": model, "method": method, "depths": " ".join(f"{v:g}" for v in d),
                        "sqrt_a_MiB": a, "sqrt_b_MiB": b, "sqrt_fit_max_rel_err": rel,
                        "linear_a_MiB": la, "linear_b_MiB": lb, "linear_fit_max_rel_err": lin_rel,
                        "power_k": k, "power_c_MiB": math.exp(logc)})
    return out


# -- reporting --------------------------------------------------------------------------


def _f(v, fmt):
    return fmt.format(v) if isinstance(v, (int, float)) and not math.isnan(v) else "-"


def sweep_table(rows, model) -> str:
    head = ["model", "method", "peak MiB", "x", "step peak MiB", "x", "step ms", "x",
            "build s", "x", "grad err", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["model"] != model:
            continue
        if r.get("error"):
            what = "not run" if r.get("expected_error") else "FAILED"
            lines.append(f"| {r.get('label', r['size'])} | {r['method']} | {what}: "
                         f"{r['error'].replace('|', '/')} |" + " |" * (len(head) - 3))
            continue
        notes = r["notes"]
        if "fell back" in notes:
            notes = "no checkpoint: tf.gradients"
        elif "not expected to save" in notes:
            notes = "plan saves nothing (warned)"
        elif notes.startswith("keeping"):
            notes = notes.split(",")[0].replace("keeping ", "kept ")
        lines.append("| " + " | ".join([
            r["label"], r["method"], _f(r["peak_MiB"], "{:.1f}"), _f(r.get("peak_MiB_ratio"), "{:.2f}"),
            _f(r["step_peak_MiB"], "{:.1f}"), _f(r.get("step_peak_MiB_ratio"), "{:.2f}"),
            _f(r["step_ms"], "{:.0f}"), _f(r.get("step_ms_ratio"), "{:.2f}"),
            _f(r["build_s"], "{:.2f}"), _f(r.get("build_s_ratio"), "{:.2f}"),
            _f(r["grad_err"], "{:.0e}"), notes]) + " |")
    return "\n".join(lines)


def max_depth_table(md) -> str:
    lines = ["| method | max blocks/stage | max depth | x GradientTape | peak there MiB | probes (n:MiB) |",
             "|---|---|---|---|---|---|"]
    for r in md:
        if r["error"]:
            lines.append(f"| {r['method']} | FAILED: {r['error']} | | | | {r['probes']} |")
            continue
        ge = "≥ " if r["at_bound"] else ""
        lines.append(f"| {r['method']} | {ge}{r['max_blocks_per_stage']} | {ge}ResNet-{r['max_depth']} | "
                     f"{ge}{_f(r['depth_ratio'], '{:.1f}')} | {_f(r['peak_at_max_MiB'], '{:.1f}')} | "
                     f"{r['probes']} |")
    return "\n".join(lines)


def fit_table(ft) -> str:
    lines = ["| model | method | depths | peak ≈ a + b·sqrt(d) MiB | max rel err | "
             "peak ≈ a + b·d MiB | max rel err | step peak ∝ d^k: k |", "|---|---|---|---|---|---|---|---|"]
    for r in ft:
        lines.append(f"| {r['model']} | {r['method']} | {r['depths']} | {r['sqrt_a_MiB']:.1f} + "
                     f"{r['sqrt_b_MiB']:.2f}·sqrt(d) | {r['sqrt_fit_max_rel_err']:.2f} | "
                     f"{r['linear_a_MiB']:.1f} + {r['linear_b_MiB']:.2f}·d | "
                     f"{r['linear_fit_max_rel_err']:.2f} | {r['power_k']:.2f} |")
    return "\n".join(lines)


def targets(rows, md, ft) -> list[tuple[str, bool | None, str]]:
    """The issue's acceptance targets, checked on this run's numbers."""
    def row(method, size=18):
        return next((r for r in rows if r["model"] == "resnet" and r["size"] == size
                     and r["method"] == method and not r.get("error")
                     and r.get("batch") == 32), None)

    out = []
    mem, spd, rg = row("memsave-memory"), row("memsave-speed"), row("recompute_grad")
    if mem:
        out.append(("ResNet-110 b32: memory peak <= 0.2x tape", mem["peak_MiB_ratio"] <= 0.2,
                    f"{mem['peak_MiB_ratio']:.3f}x"))
        out.append(("ResNet-110 b32: memory step <= 1.35x tape", mem["step_ms_ratio"] <= 1.35,
                    f"{mem['step_ms_ratio']:.2f}x"))
        if rg:
            out.append(("ResNet-110 b32: memory beats recompute_grad on peak",
                        mem["peak_MiB"] < rg["peak_MiB"],
                        f"{mem['peak_MiB']:.1f} vs {rg['peak_MiB']:.1f} MiB"))
            out.append(("ResNet-110 b32: memory beats recompute_grad on step time",
                        mem["step_ms"] < rg["step_ms"],
                        f"{mem['step_ms_ratio']:.2f}x vs {rg['step_ms_ratio']:.2f}x"))
    else:
        out.append(("ResNet-110 b32 (memory targets)", None, "not in this run"))
    if spd:
        out.append(("ResNet-110 b32: speed peak <= 0.85x", spd["peak_MiB_ratio"] <= 0.85,
                    f"{spd['peak_MiB_ratio']:.3f}x"))
        out.append(("ResNet-110 b32: speed step <= 1.2x", spd["step_ms_ratio"] <= 1.2,
                    f"{spd['step_ms_ratio']:.2f}x"))
    bm = {r["method"]: r for r in md}
    if "memsave-memory" in bm and BASELINE in bm and not bm["memsave-memory"]["error"]:
        r = bm["memsave-memory"]
        ok = r["depth_ratio"] >= 5
        if r["at_bound"] and not ok:
            ok = None  # inconclusive: the search stopped at its bound
        out.append(("max depth under cap: memory >= 5x tape", ok,
                    f"{'≥ ' if r['at_bound'] else ''}{r['depth_ratio']:.1f}x "
                    f"(ResNet-{r['max_depth']} vs ResNet-{bm[BASELINE]['max_depth']})"
                    + (" (bound reached: raise --search-max-blocks)" if ok is None else "")))
    fm = next((r for r in ft if r["model"] == "resnet" and r["method"] == "memsave-memory"), None)
    if fm:
        out.append(("memory peak sublinear in depth (k < 1)", fm["power_k"] < 1,
                    f"k = {fm['power_k']:.2f} over depths {fm['depths']}"))
    return out


def _largest(rows, model) -> dict[str, dict]:
    """The rows (by method) of ``model``'s largest size in this run."""
    sizes = [r["size"] for r in rows if r["model"] == model]
    if not sizes:
        return {}
    return {r["method"]: r for r in rows if r["model"] == model and r["size"] == max(sizes)}


def targets_issue9(rows) -> list[tuple[str, bool | None, str]]:
    """Issue 9's targets: budgets met, the Pareto comparison, and 'memory' on the U-Net."""
    out = []
    res = _largest(rows, "resnet")
    ok = {m: r for m, r in res.items() if not r.get("error")}
    label = next((r["label"] for r in res.values() if r.get("label")), "ResNet")
    for f in registry.BUDGET_FRACTIONS:
        name = f"memsave-budget-{f:g}"
        r = res.get(name)
        if r is None:
            continue
        if r.get("error"):
            out.append((f"{label}: budget {f:g} measured peak <= 1.10 budget",
                        None if r.get("expected_error") else False, r["error"][-160:]))
            continue
        ratio = r["peak_MiB"] * MiB / r["budget_bytes"]
        out.append((f"{label}: budget {f:g} measured peak <= 1.10 budget", ratio <= 1.10,
                    f"{r['peak_MiB']:.1f} MiB / {r['budget_bytes'] / MiB:.1f} MiB = {ratio:.2f} "
                    f"({r['step_ms_ratio']:.2f}x step, {r['build_s']:.0f} s build)"))
    half, mem = ok.get("memsave-budget-0.5"), ok.get("memsave-memory")
    if half and mem:
        out.append((f"{label}: budget 0.5 step faster than 'memory'", half["step_ms"] < mem["step_ms"],
                    f"{half['step_ms_ratio']:.2f}x vs {mem['step_ms_ratio']:.2f}x "
                    f"(peaks {half['peak_MiB']:.1f} vs {mem['peak_MiB']:.1f} MiB)"))
    at_rg, rg = ok.get("memsave-budget=recompute_grad"), ok.get("recompute_grad")
    if at_rg and rg:
        out.append((f"{label}: memsave at recompute_grad's measured peak is faster than it",
                    at_rg["step_ms"] < rg["step_ms"],
                    f"{at_rg['step_ms_ratio']:.2f}x vs {rg['step_ms_ratio']:.2f}x step; peaks "
                    f"{at_rg['peak_MiB']:.1f} vs {rg['peak_MiB']:.1f} MiB"))
    un = {m: r for m, r in _largest(rows, "unet").items() if not r.get("error")}
    mem, tg = un.get("memsave-memory"), un.get("tf.gradients")
    if mem and tg:
        peak, step = mem["peak_MiB"] / tg["peak_MiB"], mem["step_ms"] / tg["step_ms"]
        out.append((f"{mem['label']}: 'memory' peak <= 0.5x tf.gradients'", peak <= 0.5, f"{peak:.2f}x"))
        out.append((f"{mem['label']}: 'memory' step <= 1.4x tf.gradients'", step <= 1.4, f"{step:.2f}x"))
    return out


#: Issue 19's step targets for ResNet-110 (batch 32): budget fraction -> largest step ratio
#: to the tape; and U-Net-64's budget 0.5.
STEP_TARGETS = {0.35: 1.15, 0.5: 1.08, 0.75: 1.03}
UNET_HALF_STEP = 1.10


def _forecast_vs_measured(r: dict, plain: dict | None) -> str:
    """A memsave row's forecast step ratio (to tf.gradients) beside the measured one."""
    if r.get("forecast_step_ratio") is None:
        return "no forecast"
    text = f"forecast {r['forecast_step_ratio']:.2f}x"
    if plain:
        text += f", measured {r['step_ms'] / plain['step_ms']:.2f}x tf.gradients'"
    return text


def targets_issue19(rows) -> list[tuple[str, bool | None, str]]:
    """Issue 19's targets: a budget buys speed; 'memory' below recompute_grad's step; the
    forecast step ratio beside the measured one (ratios to the tape in the same run)."""
    out = []
    res = {m: r for m, r in _largest(rows, "resnet").items() if not r.get("error")}
    label = next((r["label"] for r in res.values()), "ResNet")
    plain = res.get("tf.gradients") or res.get(BASELINE)
    steps = []
    for f in registry.BUDGET_FRACTIONS:
        r = res.get(f"memsave-budget-{f:g}")
        if r is None:
            continue
        steps.append((f, r["step_ms"]))
        if f in STEP_TARGETS:
            out.append((f"{label}: budget {f:g} step <= {STEP_TARGETS[f]:.2f}x tape",
                        r["step_ms_ratio"] <= STEP_TARGETS[f],
                        f"{r['step_ms_ratio']:.3f}x, peak {r['peak_MiB_ratio']:.3f}x "
                        f"({_forecast_vs_measured(r, plain)})"))
        if r.get("forecast_step_ratio") is not None and plain:
            measured = r["step_ms"] / plain["step_ms"]
            err = r["forecast_step_ratio"] / measured - 1
            out.append((f"{label}: budget {f:g} forecast step ratio within 10% of measured",
                        abs(err) <= 0.10, f"{err:+.1%} ({_forecast_vs_measured(r, plain)})"))
    if len(steps) > 1:
        # "never measurably slower": 3% of the step, about the run-to-run spread here
        worse = [(a, b) for (a, ta), (b, tb) in zip(steps, steps[1:]) if tb > 1.03 * ta]
        out.append((f"{label}: a larger budget never measurably slower (> 3%)", not worse,
                    ", ".join(f"{f:g}: {t:.0f} ms" for f, t in steps)))
    mem, rg = res.get("memsave-memory"), res.get("recompute_grad")
    if mem:
        out.append((f"{label}: 'memory' peak <= 0.15x tape", mem["peak_MiB_ratio"] <= 0.15,
                    f"{mem['peak_MiB_ratio']:.3f}x"))
        out.append((f"{label}: 'memory' step <= 1.28x tape", mem["step_ms_ratio"] <= 1.28,
                    f"{mem['step_ms_ratio']:.3f}x ({_forecast_vs_measured(mem, plain)})"))
        if rg:
            out.append((f"{label}: 'memory' step below recompute_grad's", mem["step_ms"] < rg["step_ms"],
                        f"{mem['step_ms_ratio']:.3f}x vs {rg['step_ms_ratio']:.3f}x; peaks "
                        f"{mem['peak_MiB_ratio']:.3f}x vs {rg['peak_MiB_ratio']:.3f}x"))
    at_rg = res.get("memsave-budget=recompute_grad")
    if at_rg and rg:
        out.append((f"{label}: at recompute_grad's measured peak, memsave >= 10% faster",
                    at_rg["step_ms"] <= rg["step_ms"] / 1.10,
                    f"{at_rg['step_ms_ratio']:.3f}x vs {rg['step_ms_ratio']:.3f}x; peaks "
                    f"{at_rg['peak_MiB_ratio']:.3f}x vs {rg['peak_MiB_ratio']:.3f}x"))
    un = {m: r for m, r in _largest(rows, "unet").items() if not r.get("error")}
    half = un.get("memsave-budget-0.5")
    if half:
        uplain = un.get("tf.gradients") or un.get(BASELINE)
        out.append((f"{half['label']}: budget 0.5 step <= {UNET_HALF_STEP:.2f}x tape",
                    half["step_ms_ratio"] <= UNET_HALF_STEP,
                    f"{half['step_ms_ratio']:.3f}x, peak {half['peak_MiB_ratio']:.3f}x "
                    f"({_forecast_vs_measured(half, uplain)})"))
    return out


def pareto_table(rows, model) -> str:
    """Peak vs step (ratios to the tape) at ``model``'s largest size, every method, fastest
    first; ``front`` marks the points no other method beats on both (memsave's own front
    joins the pareto.png plot)."""
    pts = [r for r in _largest(rows, model).values() if not r.get("error") and "peak_MiB_ratio" in r]
    if not pts:
        return ""
    plain = next((r for r in pts if r["method"] == "tf.gradients"), None) or next(
        (r for r in pts if r["method"] == BASELINE), None)
    head = ["method", "peak x", "step x", "front", "forecast step x (tf.gradients)",
            "measured step x (tf.gradients)", "forecast peak x"]
    lines = [f"{pts[0]['label']}, batch {pts[0]['batch']}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(pts, key=lambda r: (r["step_ms_ratio"], r["peak_MiB_ratio"])):
        front = not any(o is not r and o["step_ms_ratio"] <= r["step_ms_ratio"]
                        and o["peak_MiB_ratio"] <= r["peak_MiB_ratio"]
                        and (o["step_ms_ratio"], o["peak_MiB_ratio"])
                        != (r["step_ms_ratio"], r["peak_MiB_ratio"]) for o in pts)
        fc = r.get("forecast_step_ratio")
        fp = (r["forecast_peak_bytes"] / r["forecast_plain_peak_bytes"]
              if r.get("forecast_peak_bytes") and r.get("forecast_plain_peak_bytes") else None)
        lines.append("| " + " | ".join([
            r["method"], _f(r["peak_MiB_ratio"], "{:.3f}"), _f(r["step_ms_ratio"], "{:.3f}"),
            "*" if front else "", _f(fc, "{:.3f}"),
            _f(r["step_ms"] / plain["step_ms"] if plain else None, "{:.3f}"),
            _f(fp, "{:.3f}")]) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict], meta: dict) -> None:
    keys = list(meta)
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({**meta, **{k: (f"{v:.6g}" if isinstance(v, float) else v)
                                   for k, v in r.items()}})


# -- plots ------------------------------------------------------------------------------

def _style(method: str) -> dict:
    return registry.METHODS[method].style


def _title(model: str, batch) -> str:
    return registry.MODELS[model].title.format(b=batch)


def plots(out: Path, rows, md, ft, subtitle: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    models = list(dict.fromkeys(r["model"] for r in rows if not r.get("error")))
    if models:
        for fname, panels in (
            ("memory_vs_depth.png", [("peak_MiB", "peak memory (MiB)"),
                                     ("peak_MiB_ratio", f"peak / {BASELINE} peak")]),
            ("time_vs_depth.png", [("step_ms_ratio", f"median step time / {BASELINE}'s"),
                                   ("build_s_ratio", f"build time / {BASELINE}'s")]),
        ):
            fig, axes = plt.subplots(len(panels), len(models), figsize=(5 * len(models), 7.5),
                                     squeeze=False)
            for j, model in enumerate(models):
                mrows = [r for r in rows if r["model"] == model and not r.get("error")]
                for i, (key, ylabel) in enumerate(panels):
                    ax = axes[i][j]
                    for method in registry.METHODS:
                        style = _style(method)
                        pts = sorted((r["depth"], r.get(key, math.nan)) for r in mrows
                                     if r["method"] == method)
                        if pts:
                            ax.plot(*zip(*pts), label=method, markersize=4, **style)
                    if key == "peak_MiB":
                        for r in ft:
                            if r["model"] == model and r["method"] in ("memsave-memory", BASELINE):
                                d = np.linspace(min(float(v) for v in r["depths"].split()),
                                                max(float(v) for v in r["depths"].split()), 100)
                                if r["method"] == BASELINE:
                                    fit = r["linear_a_MiB"] + r["linear_b_MiB"] * d
                                    text = f"{r['linear_a_MiB']:.0f}+{r['linear_b_MiB']:.2f}d"
                                else:
                                    fit = r["sqrt_a_MiB"] + r["sqrt_b_MiB"] * np.sqrt(d)
                                    text = f"{r['sqrt_a_MiB']:.0f}+{r['sqrt_b_MiB']:.1f}√d"
                                ax.plot(d, fit, color=_style(r["method"])["color"], linewidth=0.8,
                                        linestyle="--", label=f"{r['method']} fit {text} "
                                                              f"(step peak ∝ d^{r['power_k']:.2f})")
                    else:
                        ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
                    if i == 0:
                        ax.set_title(_title(model, mrows[0]["batch"]), fontsize=10)
                    ax.set_xlabel("depth (weighted layers)")
                    ax.set_ylabel(ylabel)
                    ax.grid(alpha=0.3)
                    if j == 0 or key == "peak_MiB":
                        ax.legend(fontsize=6)
            fig.suptitle(subtitle, fontsize=9)
            fig.tight_layout()
            fig.savefig(out / fname, dpi=110)
            plt.close(fig)
            written.append(out / fname)
    pareto_models = [m for m in models if any(
        registry.METHODS[r["method"]].largest_only for r in rows if r["model"] == m)]
    if pareto_models:
        written.append(pareto_plot(out, rows, pareto_models, subtitle))
    good = [r for r in md if not r["error"]]
    if good:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        bars = ax.bar(range(len(good)), [r["max_depth"] for r in good],
                      color=[_style(r["method"])["color"] for r in good],
                      hatch=["//" if r["at_bound"] else "" for r in good], edgecolor="white")
        ax.bar_label(bars, labels=[("≥" if r["at_bound"] else "") + f"ResNet-{r['max_depth']}"
                                   for r in good], fontsize=8)
        ax.set_xticks(range(len(good)), [r["method"] for r in good], rotation=20, fontsize=8)
        ax.set_ylabel("largest trainable depth")
        ax.set_title(f"Deepest CIFAR ResNet trainable under {good[0]['cap_MiB']:g} MiB "
                     f"(batch {good[0]['batch']}; search bound ResNet-"
                     f"{6 * good[0]['bound_blocks_per_stage'] + 2})", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "max_depth.png", dpi=110)
        plt.close(fig)
        written.append(out / "max_depth.png")
    return written


def pareto_plot(out: Path, rows, models, subtitle: str) -> Path:
    """Peak vs step time (ratios to the baseline) at each model's largest size, every method;
    the line joins the Pareto front of memsave's points."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(8 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        pts = {m: r for m, r in _largest(rows, model).items() if not r.get("error")
               and "peak_MiB_ratio" in r}
        for method, r in pts.items():
            st = _style(method)
            ax.scatter(r["step_ms_ratio"], r["peak_MiB_ratio"], color=st["color"],
                       marker=st.get("marker", "o"), s=60 if method.startswith("memsave") else 40,
                       label=method, zorder=3, edgecolors="black", linewidths=0.4)
        ms = sorted((r["step_ms_ratio"], r["peak_MiB_ratio"]) for m, r in pts.items()
                    if m.startswith("memsave"))
        front, best = [], math.inf
        for t, p in ms:
            if p < best:
                front.append((t, p))
                best = p
        if len(front) > 1:
            ax.step(*zip(*front), where="post", color="tab:blue", linewidth=0.8, alpha=0.6,
                    label="memsave Pareto front")
        label = next((r["label"] for r in pts.values()), model)
        batch = next((r["batch"] for r in pts.values()), "?")
        ax.set_title(f"{label}, batch {batch}", fontsize=10)
        ax.set_xlabel(f"median step time / {BASELINE}'s")
        ax.set_ylabel(f"peak / {BASELINE}'s peak")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the points
    fig.suptitle("Peak memory vs step time, largest size of each sweep\n" + subtitle, fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    plt.close(fig)
    return out / "pareto.png"


# ======================================================================================


def _model_batch(text: str) -> tuple[str, int]:
    model, _, n = text.partition("=")
    if model not in registry.MODELS or not n.isdigit():
        raise argparse.ArgumentTypeError(
            f"--batch takes MODEL=N with MODEL one of {', '.join(registry.MODELS)}, got {text!r}")
    return model, int(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(registry.MODELS),
                   choices=list(registry.MODELS))
    for name, m in registry.MODELS.items():
        p.add_argument(m.size_flag, dest=f"{name}_sizes", type=int, nargs="+", metavar="N",
                       default=list(m.sizes), help=m.size_help)
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch of every model (default: each model's own: "
                        + ", ".join(f"{n} {m.batch_size}" for n, m in registry.MODELS.items()) + ")")
    p.add_argument("--batch", type=_model_batch, nargs="+", default=[], metavar="MODEL=N",
                   help="batch of one model, e.g. --batch mlp=512")
    p.add_argument("--methods", nargs="+", default=registry.default_methods(),
                   choices=list(registry.METHODS), metavar="METHOD",
                   help=f"any of: {', '.join(registry.METHODS)}; each runs on the models its "
                        f"registry entry names; ratios are to {BASELINE}, which must be included")
    p.add_argument("--steps", type=int, default=1, help="timed steps per method per round")
    p.add_argument("--rounds", type=int, default=10, help="round-robin rounds over the methods")
    p.add_argument("--cap-mib", type=float, default=56.0,
                   help="memory cap (allocator peak, MiB) for the max-depth search")
    p.add_argument("--search-max-blocks", type=int, default=32,
                   help="max-depth search bound, in ResNet blocks per stage")
    p.add_argument("--no-search", action="store_true", help="skip the max-depth search")
    p.add_argument("--threads", type=int, default=0,
                   help="TensorFlow intra- and inter-op threads in the measuring processes "
                        "(0: TensorFlow's default, all cores). 1 makes step times far less "
                        "sensitive to other load on a shared machine")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    p.add_argument("--child", choices=["measure", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.methods = list(dict.fromkeys(a.methods))
    a.batch = dict(a.batch)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    if a.child:
        a.model, a.batch = a.models[0], a.batch_size
        if a.threads:
            import tensorflow as tf

            tf.config.threading.set_intra_op_parallelism_threads(a.threads)
            tf.config.threading.set_inter_op_parallelism_threads(a.threads)
        res = child_measure(a) if a.child == "measure" else child_probe(a)
        print(json.dumps(res))
        return 0

    if BASELINE not in a.methods:
        p.error(f"--methods must include {BASELINE}: every ratio is taken against it")
    for name in ("steps", "rounds", "batch_size", "search_max_blocks"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")

    t_start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    log.info("study: models %s, methods %s; results to %s", ", ".join(a.models),
             ", ".join(a.methods), a.out)
    rows = sweep(a)
    ft = fit_peaks(rows)
    md = []
    if not a.no_search:
        log.info("max-depth search: ResNet, batch %d, cap %g MiB, bound %d blocks/stage",
                 _batch(a, "resnet"), a.cap_mib, a.search_max_blocks)
        md = max_depth_search(a, rows)

    tf_version = next((r["tensorflow"] for r in rows if r.get("tensorflow")), "?")
    meta = {"tensorflow": tf_version, "python": platform.python_version(),
            "cpus": os.cpu_count(), "threads": a.threads or "default", "steps": a.steps,
            "rounds": a.rounds}
    write_csv(a.out / "study.csv", rows, meta)
    write_csv(a.out / "fits.csv", ft, meta)
    if md:
        write_csv(a.out / "max_depth.csv", md, meta)
    subtitle = (f"TF {tf_version}, {os.cpu_count()} CPUs; peak = allocator peak; "
                f"times are medians of {a.rounds} rounds x {a.steps} steps, methods interleaved")
    written = plots(a.out, rows, md, ft, subtitle)

    print(f"# memsave study: TF {tf_version}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}\n")
    for model in a.models:
        print(f"## {_title(model, _batch(a, model))}\n")
        print(sweep_table(rows, model) + "\n")
    print(f"x: ratio to {BASELINE} in the same process. peak: allocator peak over {a.steps} steps "
          f"(median of {a.rounds} rounds), weights and batch included; step peak: peak minus what "
          f"was in use before the step. build: trace + first call. grad err: largest relative "
          f"difference of the gradient digests from {BASELINE}'s at the initial weights.\n")
    if ft:
        print("## Peak memory vs depth: fits\n")
        print(fit_table(ft) + "\n")
    if md:
        print(f"## Deepest ResNet under {a.cap_mib:g} MiB (batch {_batch(a, 'resnet')})\n")
        print(max_depth_table(md) + "\n")
    tg = targets(rows, md, ft)
    print("## Targets (issue 3)\n")
    for name, ok, value in tg:
        print(f"- {'MET ' if ok else 'MISSED' if ok is False else 'n/a '} {name}: {value}")
    print()
    t9 = targets_issue9(rows)
    if t9:
        print("## Targets (issue 9: budgets, Pareto, 'memory' without articulation points)\n")
        for name, ok, value in t9:
            print(f"- {'MET ' if ok else 'MISSED' if ok is False else 'n/a '} {name}: {value}")
        print()
    fronts = [t for t in (pareto_table(rows, m) for m in a.models) if t]
    if fronts:
        print("## Pareto front: peak vs step at each model's largest size\n")
        print("x: ratios to " + BASELINE + "'s in the same run (forecast: memsave.plan's, to "
              "tf.gradients'); front: no other method is both faster and smaller.\n")
        for t in fronts:
            print(t + "\n")
    t19 = targets_issue19(rows)
    if t19:
        print("## Targets (issue 19: a budget buys speed)\n")
        for name, ok, value in t19:
            print(f"- {'MET ' if ok else 'MISSED' if ok is False else 'n/a '} {name}: {value}")
        print()
    log.info("wrote %s in %.0f s", ", ".join(str(x) for x in
             [a.out / "study.csv", a.out / "fits.csv"] + ([a.out / "max_depth.csv"] if md else [])
             + written), time.perf_counter() - t_start)

    status = 0
    for r in rows:
        if r.get("error") and r.get("expected_error"):
            log.info("%s %s: %s", r.get("label", r["size"]), r["method"], r["error"])
        elif r.get("error"):
            log.error("%s %s failed: %s", r.get("label", r["size"]), r["method"], r["error"])
            status = 1
        elif not r.get("grad_err", 0.0) <= GRAD_RTOL:
            log.error("%s %s: gradients differ from %s's by %.1e relative (> %.0e): wrong",
                      r["label"], r["method"], BASELINE, r["grad_err"], GRAD_RTOL)
            status = 1
    for r in md:
        if r["error"]:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
