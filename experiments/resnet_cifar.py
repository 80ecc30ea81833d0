"""Memory, step time and build time of memsave on a CIFAR-10-shaped ResNet.

Trains a small ResNet (He et al. 2016, the CIFAR variant: 3 stages of basic
residual blocks, 16/32/64 channels, depth 6n+2 for n blocks per stage) on a
fixed synthetic batch of 32x32x3 images with 10 classes, for a few SGD
steps inside a ``tf.function``, once per gradient method:

- ``tf.gradients``        the baseline every ratio is taken against
- ``memsave-memory``      ``memsave.gradients(..., checkpoints='memory')``
- ``memsave-speed``       ``memsave.gradients(..., checkpoints='speed')``
- ``memsave-collection``  ``memsave.gradients(..., checkpoints='collection')``
                          with every block output tagged while tracing
- ``GradientTape``        what Keras ``fit`` uses

Each method gets its own copy of the same initial weights and sees the same
batch. As a correctness check, each method's gradients at the initial
weights are compared with tf.gradients' (a difference beyond float32
round-off makes the run exit 1), and so are the losses along training.

Measured per method:

- peak memory: ``tf.config.experimental.reset_memory_stats('CPU:0')``, run
  ``--steps`` steps, read ``get_memory_info('CPU:0')['peak']`` (the
  allocator's real peak, including whatever it already held); median over
  rounds. The CSV also has ``idle`` (what the allocator held at the reset)
  and ``peak - idle`` (what the training steps added).
- step time: median over all timed steps; the methods run round-robin
  (``--rounds`` rounds, the order rotated each round), because step times on
  a shared machine drift far more between runs than within one.
- trace time: ``get_concrete_function`` on a fresh ``tf.function`` (Python
  tracing, including building the gradient graph, which is where memsave's
  rewrite happens), minimum over ``--build-repeats``; and the first call
  (graph optimisation by Grappler plus one step).

The model uses raw TF ops and ``tf.Variable`` (no Keras) so that it is small,
deterministic and shows exactly what is differentiated. Batch norm runs in
training mode without moving averages: only the gradient graph matters here.

Usage::

    ./experiments/run.sh                        # defaults: a few minutes on 2 cores
    ./experiments/run.sh --blocks-per-stage 9   # ResNet-56
    ./experiments/run.sh --methods tf.gradients GradientTape

Writes ``resnet_cifar.csv`` and ``resnet_cifar.png`` to ``--out`` (default
``results/`` in the repository) and prints a Markdown table to stdout;
progress goes to stderr. Exits 1 if any requested method failed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

log = logging.getLogger("resnet_cifar")

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINE = "tf.gradients"
MiB = 2**20
CHECKPOINT_COLLECTION = "checkpoints"
# Gradients of the same loss from different graphs differ by float32
# round-off (op fusion and summation order differ): a few 1e-6 relative to the
# largest gradient entry was seen here. Anything near this bound is a bug.
GRAD_RTOL = 1e-4


# --------------------------------------------------------------------------
# Model: CIFAR ResNet from raw ops
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    blocks_per_stage: int = 3
    widths: tuple[int, ...] = (16, 32, 64)
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3

    @property
    def depth(self) -> int:
        """Weighted layers: 2 per block, the stem conv and the classifier."""
        return 2 * self.blocks_per_stage * len(self.widths) + 2


def init_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Deterministic He-normal initial weights, in creation order."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}

    def conv(name: str, k: int, c_in: int, c_out: int) -> None:
        std = math.sqrt(2.0 / (k * k * c_in))
        params[name] = rng.normal(0.0, std, (k, k, c_in, c_out)).astype(np.float32)

    def bn(name: str, c: int) -> None:
        params[name + "/gamma"] = np.ones(c, np.float32)
        params[name + "/beta"] = np.zeros(c, np.float32)

    conv("stem/conv", 3, cfg.channels, cfg.widths[0])
    bn("stem/bn", cfg.widths[0])
    c_in = cfg.widths[0]
    for s, width in enumerate(cfg.widths):
        for b in range(cfg.blocks_per_stage):
            p = f"stage{s}/block{b}"
            conv(p + "/conv1", 3, c_in, width)
            bn(p + "/bn1", width)
            conv(p + "/conv2", 3, width, width)
            bn(p + "/bn2", width)
            if c_in != width:
                conv(p + "/proj", 1, c_in, width)
                bn(p + "/proj_bn", width)
            c_in = width
    std = math.sqrt(1.0 / c_in)
    params["head/w"] = rng.normal(0.0, std, (c_in, cfg.num_classes)).astype(np.float32)
    params["head/b"] = np.zeros(cfg.num_classes, np.float32)
    return params


def _conv(x: tf.Tensor, w: tf.Variable, stride: int) -> tf.Tensor:
    return tf.nn.conv2d(x, w, strides=stride, padding="SAME")


def _bn(x: tf.Tensor, p: dict[str, tf.Variable], name: str) -> tf.Tensor:
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(
        x, p[name + "/gamma"], p[name + "/beta"], epsilon=1e-5, is_training=True
    )
    return y


def forward_loss(
    cfg: ModelConfig, p: dict[str, tf.Variable], x: tf.Tensor, y: tf.Tensor
) -> tf.Tensor:
    """Mean softmax cross-entropy of the ResNet on (x, y).

    Every block output (and the stem output) is added to the 'checkpoints'
    collection of the graph being traced, which is what
    ``checkpoints='collection'`` reads; the other methods ignore it.
    """
    h = tf.nn.relu(_bn(_conv(x, p["stem/conv"], 1), p, "stem/bn"))
    tf.compat.v1.add_to_collection(CHECKPOINT_COLLECTION, h)
    c_in = cfg.widths[0]
    for s, width in enumerate(cfg.widths):
        for b in range(cfg.blocks_per_stage):
            pre = f"stage{s}/block{b}"
            stride = 2 if (s > 0 and b == 0) else 1
            r = tf.nn.relu(_bn(_conv(h, p[pre + "/conv1"], stride), p, pre + "/bn1"))
            r = _bn(_conv(r, p[pre + "/conv2"], 1), p, pre + "/bn2")
            if c_in != width:
                shortcut = _bn(_conv(h, p[pre + "/proj"], stride), p, pre + "/proj_bn")
            else:
                shortcut = h
            h = tf.nn.relu(r + shortcut)
            tf.compat.v1.add_to_collection(CHECKPOINT_COLLECTION, h)
            c_in = width
    pooled = tf.reduce_mean(h, axis=[1, 2])
    logits = tf.matmul(pooled, p["head/w"]) + p["head/b"]
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    )


# --------------------------------------------------------------------------
# Gradient methods: name -> (loss_fn, variables) -> (loss, grads)
# --------------------------------------------------------------------------

GradMethod = Callable[[Callable[[], tf.Tensor], list], tuple]


def _symbolic(gradients_fn: Callable) -> GradMethod:
    def method(loss_fn, variables):
        loss = loss_fn()
        return loss, gradients_fn(loss, variables)

    return method


def _tape(loss_fn, variables):
    with tf.GradientTape() as tape:
        loss = loss_fn()
    return loss, tape.gradient(loss, variables)


def _memsave(checkpoints: str) -> GradMethod:
    def method(loss_fn, variables):
        import memsave  # imported late: the baseline runs even while it is broken

        loss = loss_fn()
        return loss, memsave.gradients(loss, variables, checkpoints=checkpoints)

    return method


METHODS: dict[str, GradMethod] = {
    BASELINE: _symbolic(tf.gradients),
    "memsave-memory": _memsave("memory"),
    "memsave-speed": _memsave("speed"),
    "memsave-collection": _memsave("collection"),
    "GradientTape": _tape,
}


# --------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    method: str
    error: str | None = None
    trace_s: list[float] = dataclasses.field(default_factory=list)
    first_call_s: float = math.nan
    step_s: list[float] = dataclasses.field(default_factory=list)
    peak_B: list[int] = dataclasses.field(default_factory=list)
    idle_B: list[int] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    init_grads: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    def summary(self) -> dict[str, float]:
        peak = statistics.median(self.peak_B)
        idle = statistics.median(self.idle_B)
        return {
            "peak_MiB": peak / MiB,
            "idle_MiB": idle / MiB,
            "step_peak_MiB": (peak - idle) / MiB,
            "step_ms": 1e3 * statistics.median(self.step_s),
            "trace_s": min(self.trace_s),
            "first_call_s": self.first_call_s,
        }


class Trainer:
    """One method's copy of the weights and its traced SGD step."""

    def __init__(self, method: str, cfg: ModelConfig, init: dict[str, np.ndarray], lr: float):
        self.method = method
        self.cfg = cfg
        self.lr = lr
        with tf.name_scope(method.replace(".", "_")):
            self.params = {k: tf.Variable(v, name=k.replace("/", "_")) for k, v in init.items()}
        self.variables = list(self.params.values())
        self.step = self.new_function()

    def new_function(self):
        grad_method = METHODS[self.method]

        def train_step(x, y):
            loss, grads = grad_method(
                lambda: forward_loss(self.cfg, self.params, x, y), self.variables
            )
            for v, g in zip(self.variables, grads):
                v.assign_sub(self.lr * g)
            return loss

        return tf.function(train_step)

    def gradients(self, x: tf.Tensor, y: tf.Tensor) -> list[np.ndarray]:
        """The method's gradients at the current weights, without a step."""
        grad_method = METHODS[self.method]
        fn = tf.function(lambda: grad_method(
            lambda: forward_loss(self.cfg, self.params, x, y), self.variables)[1])
        return [g.numpy() for g in fn()]


def _short_error(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [""]
    # AutoGraph wraps errors raised while tracing as "in user code: <stack>
    # <original message>": the original message is the last line.
    line = lines[-1] if lines[0].startswith("in user code") else lines[0]
    prefix = f"{type(exc).__name__}: "
    return prefix + line.removeprefix(prefix)[:200]


def run(args: argparse.Namespace) -> list[Result]:
    cfg = ModelConfig(blocks_per_stage=args.blocks_per_stage)
    init = init_params(cfg, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    x = tf.constant(
        rng.normal(size=(args.batch_size, cfg.image_size, cfg.image_size, cfg.channels)),
        tf.float32,
    )
    y = tf.constant(rng.integers(0, cfg.num_classes, size=args.batch_size), tf.int32)
    n_params = sum(v.size for v in init.values())
    log.info(
        "ResNet-%d (%d blocks/stage, %d parameters), batch %d, %d steps x %d rounds, methods: %s",
        cfg.depth, cfg.blocks_per_stage, n_params, args.batch_size, args.steps, args.rounds,
        ", ".join(args.methods),
    )

    # The first trace in a process pays one-off costs (imports, op
    # registrations); pay them on a throwaway trainer so no method does.
    t0 = time.perf_counter()
    warm = Trainer(BASELINE, cfg, init, args.lr)
    warm.step.get_concrete_function(x, y)
    warm.step(x, y).numpy()
    del warm
    log.info("warm-up trace and step: %.1f s", time.perf_counter() - t0)

    results = {m: Result(m) for m in args.methods}
    trainers: dict[str, Trainer] = {}
    for m in args.methods:
        try:
            trainers[m] = Trainer(m, cfg, init, args.lr)
        except Exception as exc:  # report, keep measuring the other methods
            log.exception("%s: creating variables failed", m)
            results[m].error = _short_error(exc)

    # Build: fresh tf.function per repeat, interleaved across methods; the
    # last one traced is the one that trains.
    for rep in range(args.build_repeats):
        for m in [m for m in args.methods if results[m].ok]:
            tr = trainers[m]
            tr.step = tr.new_function()
            try:
                t0 = time.perf_counter()
                tr.step.get_concrete_function(x, y)
                results[m].trace_s.append(time.perf_counter() - t0)
            except Exception as exc:
                log.exception("%s: tracing failed", m)
                results[m].error = _short_error(exc)
                continue
            log.info("%-20s trace %d/%d: %.2f s", m, rep + 1, args.build_repeats,
                     results[m].trace_s[-1])

    # Correctness: every method's gradients at the (shared) initial weights,
    # compared with tf.gradients' in the report. Directly, because after a few
    # SGD steps round-off differences between graphs have grown.
    for m in [m for m in args.methods if results[m].ok]:
        try:
            results[m].init_grads = trainers[m].gradients(x, y)
        except Exception as exc:
            log.exception("%s: computing gradients failed", m)
            results[m].error = _short_error(exc)

    # First call (Grappler + one step): every method takes this step, so all
    # loss trajectories stay aligned.
    for m in [m for m in args.methods if results[m].ok]:
        try:
            t0 = time.perf_counter()
            loss = float(trainers[m].step(x, y).numpy())
            results[m].first_call_s = time.perf_counter() - t0
            results[m].losses.append(loss)
        except Exception as exc:
            log.exception("%s: first call failed", m)
            results[m].error = _short_error(exc)
            continue
        log.info("%-20s first call: %.2f s, loss %.4f", m, results[m].first_call_s, loss)

    ok = [m for m in args.methods if results[m].ok]
    for r in range(args.rounds):
        order = ok[r % len(ok):] + ok[: r % len(ok)] if ok else []
        for m in order:
            res, step = results[m], trainers[m].step
            if not res.ok:
                continue
            try:
                tf.config.experimental.reset_memory_stats("CPU:0")
                res.idle_B.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    loss = float(step(x, y).numpy())
                    res.step_s.append(time.perf_counter() - t0)
                    res.losses.append(loss)
                res.peak_B.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            except Exception as exc:
                log.exception("%s: training step failed", m)
                res.error = _short_error(exc)
                continue
        log.info(
            "round %d/%d: %s", r + 1, args.rounds,
            ", ".join(
                f"{m} {results[m].peak_B[-1] / MiB:.0f} MiB {1e3 * statistics.median(results[m].step_s[-args.steps:]):.0f} ms"
                for m in order if results[m].ok
            ),
        )
    return [results[m] for m in args.methods]


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------

COLUMNS = [
    # (key, header, format); ratio columns are added after their value.
    ("peak_MiB", "peak MiB", "{:.1f}"),
    ("step_ms", "step ms", "{:.0f}"),
    ("trace_s", "trace s", "{:.2f}"),
    ("first_call_s", "1st call s", "{:.2f}"),
]
RATIO_KEYS = ("peak_MiB", "step_ms", "trace_s")
CSV_RATIO_KEYS = RATIO_KEYS + ("step_peak_MiB",)


def tabulate(results: list[Result]) -> tuple[list[dict], str]:
    """Rows (for the CSV) and a Markdown table (for stdout and the README)."""
    base = next((r for r in results if r.method == BASELINE and r.ok), None)
    base_sum = base.summary() if base else None
    rows = []
    for r in results:
        row: dict = {"method": r.method, "status": "ok" if r.ok else "failed",
                     "error": r.error or ""}
        if r.ok:
            s = r.summary()
            row.update(s)
            for k in CSV_RATIO_KEYS:
                row[k + "_ratio"] = s[k] / base_sum[k] if base_sum and base_sum[k] else math.nan
            if base is not None:
                n = min(len(base.losses), len(r.losses))
                row["loss_max_abs_diff"] = max(
                    abs(a - b) for a, b in zip(base.losses[:n], r.losses[:n])
                )
                row["grad_max_rel_err"] = max(
                    float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))
                    for a, b in zip(base.init_grads, r.init_grads)
                )
            row["final_loss"] = r.losses[-1]
        rows.append(row)

    header = ["method"]
    for key, title, _ in COLUMNS:
        header.append(title)
        if key in RATIO_KEYS:
            header.append("x")
    header += ["grad rel err", "max abs dloss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if row["status"] != "ok":
            cells = [row["method"], "FAILED: " + row["error"].replace("|", "/")]
            cells += [""] * (len(header) - len(cells))
        else:
            cells = [row["method"]]
            for key, _, fmt in COLUMNS:
                cells.append(fmt.format(row[key]))
                if key in RATIO_KEYS:
                    cells.append(f"{row[key + '_ratio']:.2f}")
            cells.append(f"{row.get('grad_max_rel_err', math.nan):.1e}")
            cells.append(f"{row.get('loss_max_abs_diff', math.nan):.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    return rows, "\n".join(lines)


def write_csv(path: Path, rows: list[dict], meta: dict) -> None:
    keys = list(meta)
    for row in rows:
        keys += [k for k in row if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for row in rows:
            w.writerow({**meta, **row})


def plot(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    metrics = [("peak_MiB_ratio", "peak memory"), ("step_ms_ratio", "median step time"),
               ("trace_s_ratio", "trace time")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(ok), 1)
    for i, row in enumerate(ok):
        xs = [j + (i - (len(ok) - 1) / 2) * width for j in range(len(metrics))]
        vals = [row[k] for k, _ in metrics]
        bars = ax.bar(xs, vals, width, label=row["method"])
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in vals], fontsize=7, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(metrics)), [t for _, t in metrics])
    ax.set_ylabel(f"ratio to {BASELINE} (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--blocks-per-stage", type=int, default=3,
                        help="residual blocks per stage; depth is 6n+2 (3 -> ResNet-20)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3,
                        help="SGD steps per method per round (timed; one peak reading)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="round-robin rounds over the methods")
    parser.add_argument("--build-repeats", type=int, default=2,
                        help="fresh traces per method; the minimum is reported")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        metavar="METHOD", help=f"any of: {', '.join(METHODS)}")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results",
                        help="folder for resnet_cifar.csv and resnet_cifar.png")
    args = parser.parse_args(argv)
    for name in ("blocks_per_stage", "batch_size", "steps", "rounds", "build_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.methods = list(dict.fromkeys(args.methods))  # keep order, drop repeats

    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    uses_memsave = [m for m in args.methods if m.startswith("memsave")]
    if uses_memsave:
        try:
            import memsave

            memsave.gradients  # noqa: B018  (an empty package imports fine)
        except Exception as exc:
            log.error("import memsave failed (%s); %s will be reported as failed",
                      _short_error(exc), ", ".join(uses_memsave))

    t0 = time.perf_counter()
    results = run(args)
    cfg = ModelConfig(blocks_per_stage=args.blocks_per_stage)
    rows, table = tabulate(results)

    meta = {
        "model": f"ResNet-{cfg.depth}",
        "blocks_per_stage": args.blocks_per_stage,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "rounds": args.rounds,
        "tensorflow": tf.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    title = (f"ResNet-{cfg.depth} ({args.blocks_per_stage} blocks/stage), batch {args.batch_size}, "
             f"32x32x3, TF {tf.__version__}, {os.cpu_count()} CPUs; "
             f"medians of {args.rounds} rounds x {args.steps} steps")
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out / "resnet_cifar.csv", args.out / "resnet_cifar.png"
    write_csv(csv_path, rows, meta)
    if any(r["status"] == "ok" for r in rows) and any(r.method == BASELINE and r.ok for r in results):
        plot(png_path, rows, title)
    else:
        log.warning("no baseline result, so no ratios to plot")
        png_path = None

    print(title)
    print()
    print(table)
    print()
    print(f"x: ratio to {BASELINE}. peak: CPU allocator peak over {args.steps} steps "
          f"(median of rounds). trace: building the step's graph (min of "
          f"{args.build_repeats}); 1st call: Grappler plus one step. grad rel err: largest difference "
          f"from {BASELINE}'s gradients at the initial weights, relative to the largest entry "
          f"of each; max abs dloss: largest difference from its loss at the same step "
          f"(round-off grows over training steps).")
    log.info("wrote %s%s in %.0f s total", csv_path, f" and {png_path}" if png_path else "",
             time.perf_counter() - t0)

    status = 0
    for row in rows:
        if row["status"] != "ok":
            log.error("%s failed: %s", row["method"], row["error"])
            status = 1
        elif not row.get("grad_max_rel_err", 0.0) <= GRAD_RTOL:  # NaN fails too
            log.error("%s: gradients differ from %s's by %.2e relative (> %.0e): they are wrong",
                      row["method"], BASELINE, row["grad_max_rel_err"], GRAD_RTOL)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
