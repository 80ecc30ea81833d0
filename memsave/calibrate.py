"""Measure a :class:`~memsave.timemodel.DeviceProfile` on the current device.

:func:`calibrate` builds one ``tf.compat.v1`` graph of microbenchmarks (a
matrix product, a convolution, a batch norm, elementwise, transcendental,
reduction, data-movement, softmax and pooling ops on 2-4 MiB tensors, and
their gradients), runs it a few times in a Session with one kernel at a
time, reads each kernel's time from TensorFlow's step stats
(``RunOptions(trace_level=FULL_TRACE)``, ``RunMetadata.step_stats``) and
solves the time model's parameters from them: the peak FLOP/s from the
product, the bandwidth from the binary elementwise op, each class's
efficiency from its benchmark, each class's gradient correction from its
benchmark's gradient kernels, and the launch overhead from the wall time of
a chain of tiny ops. The forecasts it compares with are
:func:`memsave.timemodel.op_seconds`' own, on the benchmark graph read by
:mod:`memsave.extract`, so the two cannot drift apart.

:func:`device_profile` calibrates once per process and returns the cached
profile afterwards. :func:`kernel_seconds` and :func:`attribute` (read a
graph's kernel times, and assign them to the forward ops and gradients of a
ForwardGraph) are what ``experiments/time_model.py`` checks the model with.

This module imports TensorFlow; :mod:`memsave.timemodel` does not.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
import statistics
import time
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

from memsave import _tf_private
from memsave.costs import estimate_costs
from memsave.extract import extract
from memsave.graph import ForwardGraph
from memsave.timemodel import CPU_DEFAULT, DeviceProfile, Efficiency, op_class, op_seconds

__all__ = ["calibrate", "device_profile", "kernel_seconds", "attribute", "Attribution",
           "BENCHMARK_OPERAND_BYTES", "OVERHEAD_CHAIN_OPS",
           "OVERHEAD_CHAIN_ELEMENTS", "SAMPLES", "SMALL_OPERAND_BYTES", "median_profile",
           "CLASSES_MEASURED"]

#: Bytes of each operand of the memory-bound benchmarks: activations of the
#: study's models are 0.5-8 MiB, and the reference machine's 32 MiB L3
#: holds a benchmark's traffic at this size as it holds theirs. Tensors of
#: hundreds of MiB stream from DRAM, slower than the profile says.
BENCHMARK_OPERAND_BYTES = 2 << 20

#: Bytes of each operand of the memory-bound benchmarks' second, smaller copy:
#: an eighth, so that the line through the two sizes has its intercept (the
#: class's fixed cost) near the origin, at tensors models have (256 KiB).
SMALL_OPERAND_BYTES = BENCHMARK_OPERAND_BYTES // 8

#: Copies of each benchmark in the graph; each figure is the median of what
#: the copies give (on a shared machine one copy's kernels may all have been
#: disturbed).
SAMPLES = 3

#: Dependent ops in the chain whose wall time per op is the launch
#: overhead: enough that the Session call's own cost (subtracted, from a
#: chain of one op) is a small part.
OVERHEAD_CHAIN_OPS = 200

#: Elements of each op of that chain: small enough that the work is a
#: fraction of a microsecond (64 KiB, in L2), large enough that TensorFlow
#: runs the kernel as a real one (scalar kernels run inline in the
#: executor, about 0.1 us each, which no tensor op of a model does).
OVERHEAD_CHAIN_ELEMENTS = 16384

#: A kernel name in a step stats timeline label: "[...] name = OpType(inputs)".
_LABEL_OP = re.compile(r"^(?:\[[^\]]*\]\s*)?\S+ = ([A-Za-z0-9_]+)\(")


def kernel_seconds(session: tf.compat.v1.Session, fetches, *, repeats: int = 5,
                   feed_dict=None, warmup: bool = True) -> dict[str, tuple[str, float]]:
    """Per node of one Session step: (kernel type, seconds), the minimum over ``repeats`` traced runs.

    The kernel type is the one TensorFlow ran, read from the timeline label
    (Grappler's fused kernels show as ``_MklNativeFusedBatchNormEx``, named
    after the first node they replace). The minimum is the best estimate
    of a kernel's time on a machine whose load varies. With ``warmup``, one
    untraced step runs first (Grappler, oneDNN primitive caches).
    """
    if warmup:
        session.run(fetches, feed_dict=feed_dict)
    best: dict[str, tuple[str, float]] = {}
    for _ in range(repeats):
        meta = tf.compat.v1.RunMetadata()
        session.run(fetches, feed_dict=feed_dict, run_metadata=meta,
                    options=tf.compat.v1.RunOptions(
                        trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
        seen: dict[str, tuple[str, float]] = {}
        for dev in meta.step_stats.dev_stats:
            for ns in dev.node_stats:
                m = _LABEL_OP.match(ns.timeline_label)
                kind = m.group(1) if m else ns.node_name
                prev = seen.get(ns.node_name)
                us = ns.all_end_rel_micros + (prev[1] if prev else 0)  # a node run twice adds up
                seen[ns.node_name] = (kind, us)
        for name, (kind, us) in seen.items():
            if name not in best or us * 1e-6 < best[name][1]:
                best[name] = (kind, us * 1e-6)
    return best


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Measured kernel seconds assigned to the ops of a ForwardGraph.

    Attributes
    ----------
    forward : tuple of float or None
        Per op: the kernel named after it (None: no kernel ran under its
        name: a view elided, or an op fused into another's kernel).
    recompute : tuple of float
        Per op: the kernels of its copies in memsave's recompute steps
        (``.../recompute_<k>/<op name>``).
    gradient : tuple of float
        Per op: the kernels of its gradient (``..._grad/`` after the op's
        name, under any gradient or recompute name scope).
    kernels : tuple of str or None
        Per op: the kernel type that ran under its name.
    other : dict of str to float
        Seconds of the remaining kernels, by kernel type (the sums of
        gradients, AddN; the rewrite's gates; an optimizer's updates;
        constants).
    """

    forward: tuple[float | None, ...]
    recompute: tuple[float, ...]
    gradient: tuple[float, ...]
    kernels: tuple[str | None, ...]
    other: Mapping[str, float]


_RECOMPUTE_SCOPE = re.compile(r"(?:^|/)recompute_\d+/")


def attribute(fg: ForwardGraph, times: Mapping[str, tuple[str, float]]) -> Attribution:
    """Assign ``kernel_seconds`` output to ``fg``'s ops, their copies and their gradients,
    by node name (the names tf.gradients and memsave's rewrite give them)."""
    index = {op.name: op.index for op in fg.ops}
    forward: list[float | None] = [None] * len(fg.ops)
    kernels: list[str | None] = [None] * len(fg.ops)
    recompute = [0.0] * len(fg.ops)
    gradient = [0.0] * len(fg.ops)
    other: dict[str, float] = collections.defaultdict(float)

    def op_at_end(path: str) -> int | None:
        """The op whose name is the longest '/'-separated suffix of ``path``."""
        parts = path.split("/")
        for k in range(len(parts)):
            i = index.get("/".join(parts[k:]))
            if i is not None:
                return i
        return None

    for name, (kind, s) in times.items():
        i = index.get(name)
        if i is not None:
            forward[i] = s
            kernels[i] = kind
            continue
        cut = name.rfind("_grad/")
        while cut > 0:
            i = op_at_end(name[:cut])
            if i is not None:
                gradient[i] += s
                break
            cut = name.rfind("_grad/", 0, cut)
        if cut > 0:
            continue
        m = None
        for m in _RECOMPUTE_SCOPE.finditer(name):
            pass
        i = index.get(name[m.end():]) if m is not None else None
        if i is not None:
            recompute[i] += s
        else:
            other[kind] += s
    return Attribution(tuple(forward), tuple(recompute), tuple(gradient), tuple(kernels),
                       dict(other))


# -- the benchmarks -----------------------------------------------------------------------


#: The benchmark of each class whose kernels are compute-bound: one size.
_COMPUTE_BOUND = ("matmul", "conv", "transcendental")
#: Memory-bound classes, benchmarked at two sizes (the fixed cost is the intercept).
_MEMORY_BOUND = ("elementwise", "normalization", "reduction", "movement", "softmax", "pooling")
#: Scope suffix of the small copy of a memory-bound benchmark.
_SMALL = "_small"


def _benchmark(cls: str, n: int, var):
    """Build class ``cls``'s benchmark on operands of ``n`` float32 elements in the
    current graph; return (output, variables)."""
    if cls == "matmul":
        a, b = var([512, 512]), var([512, 512], 1 / 23)  # square: gradients reduce as long
        return tf.matmul(a, b), [a, b]
    if cls == "conv":  # the 3x3 convolutions of a CIFAR ResNet's three stages, chained
        x = var([32, 32, 32, 16])
        ws = [var([3, 3, c, c], 1 / (3 * c ** 0.5)) for c in (16, 32, 64)]
        h = tf.nn.conv2d(x, ws[0], 1, "SAME")
        h = tf.nn.conv2d(tf.reshape(h, [32, 16, 16, 64])[..., :32], ws[1], 1, "SAME")
        h = tf.nn.conv2d(tf.reshape(h, [32, 8, 8, 128])[..., :64], ws[2], 1, "SAME")
        return h, [x] + ws
    if cls == "elementwise":  # the add and ReLU set the bandwidth; ReluGrad, the correction
        a, b = var([n]), var([n])
        return tf.nn.relu(a + b), [a, b]
    if cls == "transcendental":
        a = var([n])
        return tf.tanh(a), [a]
    if cls == "normalization":
        x = var([n // (16 * 16 * 32), 16, 16, 32])
        g, b = var([32]), var([32])
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, g, b, epsilon=1e-5, is_training=True)
        return y, [x, g, b]
    x = var([n // (16 * 16 * 32), 16, 16, 32])
    if cls == "reduction":
        return tf.reduce_sum(x, axis=[1, 2]), [x]
    if cls == "movement":
        return tf.transpose(x, [0, 3, 1, 2]), [x]
    if cls == "softmax":
        return tf.nn.softmax(tf.reshape(x, [-1, 512])), [x]
    if cls == "pooling":
        return tf.nn.max_pool2d(x, 2, 2, "VALID"), [x]
    raise ValueError(f"memsave.calibrate: no benchmark for op class {cls!r}; this is a bug in memsave")


def _measure_overhead(repeats: int) -> float:
    """Wall seconds per op of a chain of small dependent elementwise ops, beyond a
    one-op chain's (the Session call's own cost)."""
    values = np.ones(OVERHEAD_CHAIN_ELEMENTS, np.float32)

    def wall(n_ops: int) -> float:
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, values.shape)
            y = x
            for _ in range(n_ops):
                y = tf.nn.relu(y + 1.0)
            out = tf.reduce_sum(y[:1])
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
        # No Grappler: it would fold the chain's constants together.
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        with tf.compat.v1.Session(graph=g, config=config) as s:
            s.run(out, {x: values})
            best = float("inf")
            for _ in range(max(repeats, 5)):
                t0 = time.perf_counter()
                s.run(out, {x: values})
                best = min(best, time.perf_counter() - t0)
        return best

    n = OVERHEAD_CHAIN_OPS
    return max(0.0, (wall(n) - wall(1)) / (2 * (n - 1)))


def calibrate(*, repeats: int = 20, samples: int = SAMPLES, base: DeviceProfile = CPU_DEFAULT,
              seed: int = 0) -> DeviceProfile:
    """Measure the time model's parameters on this process's default device.

    Parameters
    ----------
    repeats : int
        Traced runs of the benchmark graph; each kernel's minimum is used.
    samples : int
        Copies of each benchmark in the graph (see :data:`SAMPLES`).
    base : DeviceProfile
        Where the figures not measured come from (``gemm_half_k``, and the
        efficiency of classes without a benchmark).
    seed : int
        Seed of the benchmarks' random operands.

    Returns
    -------
    DeviceProfile
        Named ``"calibrated on <device>"``. Takes 1-3 s (2 cores).

    Notes
    -----
    Each benchmark is one op on operands of :data:`BENCHMARK_OPERAND_BYTES`
    (the memory-bound ones also at an eighth of that, for their fixed
    cost), differentiated by ``tf.gradients``. Kernels run one at a time
    (``inter_op_parallelism_threads=1``) with the default intra-op
    threads, as a training step's large kernels do. The figures are solved
    in this order, each from :func:`memsave.timemodel.op_seconds`' own
    arithmetic on the benchmark graph at unit peaks (so that measured /
    modelled is the factor the model needs):

    1. ``peak_flops_per_s``: the product; a class's ``compute``: its
       benchmark's rate over that peak (convolution, tanh).
    2. ``bytes_per_s`` and the elementwise ``fixed_s``: the slope and the
       intercept of the add + ReLU pair's time against its bytes, over the
       two sizes; a memory-bound class's ``memory`` and ``fixed_s``: the
       same for its benchmark, relative to that bandwidth.
    3. A class's ``gradient``: its benchmark's gradient kernels over their
       modelled roofline (fixed costs taken off).
    4. ``overhead_s``: the wall time per op of a chain of small ops.

    On a loaded machine the minimum over runs is an unloaded kernel's time
    only if some run was not disturbed: repeat more, or take the
    :func:`median_profile` of several calibrations.
    """
    for name, v in (("repeats", repeats), ("samples", samples)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"memsave.calibrate.calibrate: {name}={v!r}; pass an int >= 1")
    made = [0]

    def var(shape, scale=1.0):  # initialized in the graph: no large constants to build
        made[0] += 1
        return tf.Variable(tf.random.stateless_normal(shape, (seed, made[0]), stddev=scale))

    big = BENCHMARK_OPERAND_BYTES // 4  # float32 elements
    scopes = [(c, c, big) for c in _COMPUTE_BOUND + _MEMORY_BOUND]
    scopes += [(c + _SMALL, c, SMALL_OPERAND_BYTES // 4) for c in _MEMORY_BOUND]
    g = tf.Graph()
    with g.as_default():
        outs, variables = [], []
        for scope, cls, n in scopes:
            with tf.name_scope(scope):
                for k in range(samples):
                    with tf.name_scope(f"s{k}"):
                        y, vs = _benchmark(cls, n, var)
                    outs.append(y)
                    variables += vs
        # Incoming gradients Grappler cannot fold (it would fold a Sum's or a
        # Transpose's gradient of constant ones into a constant).
        grad_ys = [tf.Variable(tf.ones(y.shape)).read_value() for y in outs]
        ex = extract(outs, _tf_private.convert_xs(variables))
        grads = tf.gradients(outs, variables, grad_ys=grad_ys)
        init = tf.compat.v1.global_variables_initializer()
        fetches = [tf.reduce_sum(y[:1]) for y in outs] + [tf.reduce_sum(d[:1]) for d in grads]
    fg = ex.fg
    costs = estimate_costs(fg)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
    with tf.compat.v1.Session(graph=g, config=config) as s:
        s.run(init)
        measured = attribute(fg, kernel_seconds(s, fetches, repeats=repeats))
    overhead = _measure_overhead(repeats)

    # Per (scope, sample): the benchmark's ops of its class (the ReLU too, for
    # elementwise; not the slices between the convolutions).
    ops: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    for op in fg.ops:
        scope, sample = op.name.split("/", 2)[:2]
        cls = scope[:-len(_SMALL)] if scope.endswith(_SMALL) else scope
        if op_class(op.type) == cls and measured.forward[op.index]:
            ops[scope, int(sample[1:])].append(op.index)

    # Seconds at unit efficiency, unit peaks and no fixed costs: FLOPs
    # (gemm-weighted) at 1 FLOP/s, bytes at 1 byte/s.
    unit = DeviceProfile(name="unit", peak_flops_per_s=1.0, bytes_per_s=1.0, overhead_s=0.0,
                         gemm_half_k=base.gemm_half_k)
    flops = op_seconds(fg, costs, unit.replace(bytes_per_s=1e30)).forward
    bytes_ = op_seconds(fg, costs, unit.replace(peak_flops_per_s=1e30)).forward

    def total(values, scope, k):
        return sum(values[i] for i in ops[scope, k])

    def seconds(scope, k):
        return max(sum(measured.forward[i] for i in ops[scope, k]), 1e-9)

    def median(f):
        return statistics.median(f(k) for k in range(samples))

    def line(cls, k):
        """(seconds per byte, fixed seconds per kernel) of ``cls`` over its two sizes."""
        b1, b2 = total(bytes_, cls, k), total(bytes_, cls + _SMALL, k)
        t1, t2 = seconds(cls, k), seconds(cls + _SMALL, k)
        if t1 > t2 and b1 > b2:
            slope = (t1 - t2) / (b1 - b2)
            return slope, max(0.0, (t1 - slope * b1) / len(ops[cls, k]))
        return t1 / b1, 0.0  # noise reversed the two: no intercept

    peak = median(lambda k: total(flops, "matmul", k) / seconds("matmul", k))
    per_byte = median(lambda k: line("elementwise", k)[0])
    efficiency = {c: base.of(c) for c in CLASSES_MEASURED}
    efficiency["matmul"] = dataclasses.replace(efficiency["matmul"], compute=1.0)
    efficiency["elementwise"] = dataclasses.replace(
        efficiency["elementwise"], memory=1.0, fixed_s=median(lambda k: line("elementwise", k)[1]))
    for cls in ("conv", "transcendental"):
        efficiency[cls] = dataclasses.replace(efficiency[cls], compute=median(
            lambda k: total(flops, cls, k) / seconds(cls, k)) / peak)
    for cls in _MEMORY_BOUND[1:]:
        efficiency[cls] = dataclasses.replace(
            efficiency[cls], memory=per_byte / median(lambda k: line(cls, k)[0]),
            fixed_s=median(lambda k: line(cls, k)[1]))
    profile = base.replace(name=f"calibrated on {_device_name()}", peak_flops_per_s=peak,
                           bytes_per_s=1.0 / per_byte, overhead_s=overhead, efficiency=efficiency)

    # Gradient corrections: the gradient kernels measured in a benchmark's
    # scope over the modelled roofline of the same ops (fixed costs and
    # launches taken off the measured side).
    neutral = profile.replace(efficiency={
        c: dataclasses.replace(e, gradient=1.0) for c, e in profile.efficiency.items()})
    roof = op_seconds(fg, costs, neutral.replace(overhead_s=0.0, efficiency={
        c: dataclasses.replace(e, fixed_s=0.0) for c, e in neutral.efficiency.items()})).gradient
    launch = op_seconds(fg, costs, neutral.replace(
        peak_flops_per_s=1e30, bytes_per_s=1e30)).gradient

    def correction(cls, k):
        idx = [i for i in ops[cls, k] if roof[i] > 0]
        modelled = sum(roof[i] for i in idx)
        got = sum(measured.gradient[i] - launch[i] for i in idx)
        return got / modelled if modelled > 0 and got > 0 else float("nan")

    for cls in CLASSES_MEASURED:
        found = [c for c in (correction(cls, k) for k in range(samples)) if math.isfinite(c)]
        if found:
            efficiency[cls] = dataclasses.replace(efficiency[cls],
                                                  gradient=statistics.median(found))
    return profile.replace(efficiency=efficiency)


#: The classes :func:`calibrate` measures.
CLASSES_MEASURED = _COMPUTE_BOUND + _MEMORY_BOUND


def _device_name() -> str:
    cpus = tf.config.list_physical_devices("CPU")
    return f"{len(cpus)} CPU device(s), {_cores()} cores, TensorFlow {tf.__version__}"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def device_profile() -> DeviceProfile:
    """:func:`calibrate` once per process; the same profile on every later call."""
    return calibrate()


def median_profile(profiles: Sequence[DeviceProfile]) -> DeviceProfile:
    """Field-by-field median of several calibrations (steadier on a loaded machine)."""
    first = profiles[0]
    med = statistics.median
    classes = set().union(*(p.efficiency for p in profiles))
    return first.replace(
        name=f"median of {len(profiles)} calibrations",
        peak_flops_per_s=med(p.peak_flops_per_s for p in profiles),
        bytes_per_s=med(p.bytes_per_s for p in profiles),
        overhead_s=med(p.overhead_s for p in profiles),
        efficiency={c: Efficiency(**{f.name: med(getattr(p.of(c), f.name) for p in profiles)
                                     for f in dataclasses.fields(Efficiency)})
                    for c in classes})
