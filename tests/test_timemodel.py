"""The time model: roofline arithmetic on hand-built graphs, monotonicity,
views and fused ops, step forecasts, and one calibration on this machine."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import random
import sys

import pytest

import memsave
from handgraphs import MiB, Builder, chain, random_dag, residual_block
from memsave.costs import estimate_costs
from memsave.errors import DeviceProfileError, MemsaveError
from memsave.graph import Body, ForwardGraph
from memsave.schedule import build_schedule
from memsave.timemodel import (
    CPU_DEFAULT,
    DeviceProfile,
    Efficiency,
    GATE_OPS,
    fused_into_producer,
    head_gate_seconds,
    op_class,
    op_seconds,
    step_time,
)

#: A profile with round figures, so that expected seconds are written by hand:
#: 1 GFLOP/s, 100 MB/s, 1 us per launch, no product penalty.
P = DeviceProfile(
    name="test", peak_flops_per_s=1e9, bytes_per_s=1e8, overhead_s=1e-6, gemm_half_k=0.0,
    efficiency={
        "conv": Efficiency(compute=0.5, gradient=1.5),
        "elementwise": Efficiency(memory=0.5),
        "normalization": Efficiency(memory=0.25, fixed_s=1e-3),
        "transcendental": Efficiency(compute=0.01, gradient=2.0),
    },
)
US = 1e-6


def _seconds(fg: ForwardGraph, profile=P):
    return op_seconds(fg, estimate_costs(fg), profile)


def _index(fg: ForwardGraph, name: str) -> int:
    return next(op.index for op in fg.ops if op.name == name)


def test_roofline_of_a_product_and_an_elementwise_op():
    b = Builder()
    b.source("x", size_bytes=2 * MiB)
    b.source("w", size_bytes=MiB)
    m = b.op("m", "MatMul", ["x", "w"], size_bytes=MiB, flops=3 * 10**9)
    b.op("r", "Relu", [m], size_bytes=MiB)
    fg = b.build(["x", "w"], ["r:0"])
    s = _seconds(fg)
    mm, relu = _index(fg, "m"), _index(fg, "r")
    # MatMul: compute-bound, 3e9 FLOP at 1e9 FLOP/s, plus the launch.
    assert s.forward[mm] == pytest.approx(US + 3.0)
    # Its gradient: one product per operand (x and w both take one): 6e9 FLOP.
    assert s.gradient[mm] == pytest.approx(2 * US + 6.0)
    # Relu: memory-bound, reads 1 MiB and writes 1 MiB at 0.5 * 100 MB/s.
    assert s.forward[relu] == pytest.approx(US + 2 * MiB / 5e7)
    # ReluGrad reads dy and y, writes dx: 3 MiB.
    assert s.gradient[relu] == pytest.approx(US + 3 * MiB / 5e7)
    assert s.forward_s == pytest.approx(s.forward[mm] + s.forward[relu])
    assert s.backward_s == pytest.approx(s.gradient[mm] + s.gradient[relu])


def test_class_efficiency_fixed_cost_and_gradient_correction():
    b = Builder()
    b.source("x", size_bytes=4 * MiB)
    c = b.op("c", "Conv2D", ["x"], size_bytes=4 * MiB, flops=10**8)
    n = b.op("n", "FusedBatchNormV3", [c], size_bytes=4 * MiB)
    b.op("t", "Tanh", [n], size_bytes=4 * MiB, flops=10**6)
    fg = b.build(["x"], ["t:0"])
    s = _seconds(fg)
    conv, bn, tanh = _index(fg, "c"), _index(fg, "n"), _index(fg, "t")
    # Conv2D at half of peak: 1e8 / 5e8 = 0.2 s, above its 8 MiB / 1e8 B/s = 0.084 s.
    assert s.forward[conv] == pytest.approx(US + 0.2)
    # Its gradient (x takes one; Conv2D's hand-built gradient reads its input):
    # one product, 0.2 s, times the class's correction 1.5.
    assert s.gradient[conv] == pytest.approx(US + 1.5 * 0.2)
    # FusedBatchNormV3: 8 MiB at a quarter of the bandwidth, plus its fixed 1 ms.
    assert s.forward[bn] == pytest.approx(US + 1e-3 + 8 * MiB / 2.5e7)
    # Its gradient reads nothing (hand-built default): dy in, dx out, 8 MiB.
    assert s.gradient[bn] == pytest.approx(US + 1e-3 + 8 * MiB / 2.5e7)
    # Tanh: 1e6 FLOP at 1% of peak = 0.1 s, above its 8 MiB / 1e8 = 0.084 s.
    assert s.forward[tanh] == pytest.approx(US + 0.1)
    # TanhGrad is elementwise arithmetic (dy, y in; dx out: 12 MiB at 0.5 * 1e8),
    # times the transcendental class's correction 2.
    assert s.gradient[tanh] == pytest.approx(US + 2.0 * 12 * MiB / 5e7)


def test_short_reductions_run_below_peak():
    """gemm(k) = k / (k + gemm_half_k), k = FLOPs / (2 * output elements)."""
    b = Builder()
    b.source("x", size_bytes=MiB)
    b.op("m", "MatMul", ["x"], size_bytes=MiB, flops=2 * 64 * 4096)
    fg = b.build(["x"], ["m:0"])
    fg = dataclasses.replace(fg, tensors=tuple(dataclasses.replace(t, itemsize=256)
                                               for t in fg.tensors))  # 4096 elements
    profile = P.replace(gemm_half_k=64.0, bytes_per_s=1e30)
    s = op_seconds(fg, estimate_costs(fg), profile)
    # k = 2 * 64 * 4096 / (2 * 4096) = 64: half the rate.
    assert s.forward[0] == pytest.approx(US + 2 * 64 * 4096 / (1e9 * 0.5))


def test_views_cost_nothing():
    b = Builder()
    b.source("x", size_bytes=8 * MiB)
    i = b.op("i", "Identity", ["x"], size_bytes=8 * MiB)
    r = b.op("r", "Reshape", [i], size_bytes=8 * MiB)
    b.op("v", "ReadVariableOp", [r], size_bytes=8 * MiB)
    fg = b.build(["x"], ["v:0"])
    s = _seconds(fg)
    assert s.forward == (0.0, 0.0, 0.0)
    assert s.recompute == (0.0, 0.0, 0.0)
    assert s.gradient == (0.0, 0.0, 0.0)
    assert {op_class(op.type) for op in fg.ops} == {"view"}


def test_a_pass_through_gradient_and_an_input_without_gradient_cost_nothing():
    b = Builder()
    b.source("x", size_bytes=MiB)
    b.external("data", size_bytes=MiB)
    a = b.op("a", "AddV2", ["x", "data"], size_bytes=MiB)
    b.op("m", "Mul", [a, "data"], size_bytes=MiB)
    fg = b.build(["x"], ["m:0"])
    s = _seconds(fg)
    add, mul = _index(fg, "a"), _index(fg, "m")
    assert s.forward[add] > 0
    # AddV2's gradient is the incoming buffer itself; the data takes none.
    assert s.gradient[add] == 0.0
    # Mul: only a's gradient, dy * data (reads dy, both inputs; writes one).
    assert s.gradient[mul] == pytest.approx(US + 4 * MiB / 5e7)


def test_gradient_sums_of_a_tensor_read_twice():
    fg = residual_block()
    s = _seconds(fg)
    a = fg.ops[_index(fg, "a")].outputs[0]  # read by b (Conv2D) and add (AddV2)
    # AddN of two gradients: reads 2 MiB, writes 1 MiB.
    assert s.accumulate[a] == pytest.approx(US + 3 * MiB / 5e7)
    assert sum(1 for v in s.accumulate if v > 0) == 1
    assert s.backward_s == pytest.approx(math.fsum(s.gradient) + s.accumulate[a])


def _bn_relu(extra_reader: bool):
    b = Builder()
    b.source("x", size_bytes=MiB)
    n = b.op("n", "FusedBatchNormV3", ["x"], size_bytes=MiB)
    r = b.op("r", "Relu", [n], size_bytes=MiB)
    ys = [r]
    if extra_reader:
        ys.append(b.op("e", "Tanh", [n], size_bytes=MiB))
    return b.build(["x"], ys)


def test_an_activation_fused_into_a_batch_norm_costs_nothing_forward():
    fg = _bn_relu(extra_reader=False)
    relu = fg.ops[_index(fg, "r")]
    assert fused_into_producer(fg, relu)
    s = _seconds(fg)
    assert s.forward[relu.index] == 0.0
    # Its copy, recomputed behind a control dependency, is not fused; its
    # gradient still runs.
    assert s.recompute[relu.index] == pytest.approx(US + 2 * MiB / 5e7)
    assert s.gradient[relu.index] > 0
    # A second reader of the batch norm's output prevents the fusion.
    fg2 = _bn_relu(extra_reader=True)
    relu2 = fg2.ops[_index(fg2, "r")]
    assert not fused_into_producer(fg2, relu2)
    assert _seconds(fg2).forward[relu2.index] == pytest.approx(US + 2 * MiB / 5e7)


def test_bias_and_activation_fused_into_a_product():
    b = Builder()
    b.source("x", size_bytes=MiB)
    m = b.op("m", "MatMul", ["x"], size_bytes=MiB, flops=10**6)
    a = b.op("a", "BiasAdd", [m], size_bytes=MiB)
    b.op("r", "Relu", [a], size_bytes=MiB)
    fg = b.build(["x"], ["r:0"])
    assert [fused_into_producer(fg, op) for op in fg.ops] == [False, True, True]
    s = _seconds(fg)
    assert s.forward[1] == s.forward[2] == 0.0
    # A Relu of a MatMul with no bias add between is its own kernel.
    fg2 = chain(2, type="MatMul")
    assert not any(fused_into_producer(fg2, op) for op in fg2.ops)


def test_a_call_costs_its_body_times_its_trips():
    inner = chain(3, type="Relu", size_bytes=MiB)
    body = Body(fg=inner, trips=5, trips_known=True, saved=())
    b = Builder()
    b.source("x", size_bytes=MiB)
    b.op("loop", "While", ["x"], size_bytes=MiB)
    outer = b.build(["x"], ["loop:0"])
    outer = dataclasses.replace(outer, ops=(dataclasses.replace(outer.ops[0], body=body),))
    s = _seconds(outer)
    body_s = _seconds(inner)
    assert s.forward[0] == pytest.approx(5 * body_s.forward_s)
    assert s.gradient[0] == pytest.approx(5 * body_s.backward_s)


def test_step_time_plain_and_checkpointed():
    fg = chain(4, type="Relu", size_bytes=MiB)
    costs = estimate_costs(fg)
    s = op_seconds(fg, costs, P)
    plain = step_time(fg, costs, profile=P)
    assert plain.ratio == 1.0
    assert plain.total_s == pytest.approx(s.forward_s + s.backward_s)
    mid = fg.ops[1].outputs[0]
    schedule = build_schedule(fg, (mid,))
    t = step_time(fg, costs, schedule, profile=P)
    # Every op but the last is recomputed (op1's copy because its gradient reads
    # its output, op0's because op1 reads it), and the y-step's op2 and op3.
    ops = [i for st in schedule.steps if st.kind == "recompute" for i in st.ops]
    assert t.recomputed_ops == len(ops)
    assert t.recompute_s == pytest.approx(s.recompute_s(ops))
    # Two recompute steps with a floating head each: a gate, and a gated read
    # (a select, one launch: memsave.gates.select) of the head's gradient and
    # of each boundary tensor the schedule gates (the checkpoint in the
    # y-step; x, the smallest floating one, in op1's step).
    recompute = [st for st in schedule.steps if st.kind == "recompute"]
    heads = len(recompute)
    assert [len(st.gated) for st in recompute] == [1, 1]
    reads = heads + sum(len(st.gated) for st in recompute)
    assert t.rewrite_s == pytest.approx(heads * GATE_OPS * US + reads * US)
    assert t.total_s == pytest.approx(plain.total_s + t.recompute_s + t.rewrite_s)
    assert t.ratio == pytest.approx(t.total_s / plain.total_s)


def test_each_recompute_step_adds_the_profiles_step_seconds():
    fg = chain(4, type="Relu", size_bytes=MiB)
    costs = estimate_costs(fg)
    schedule = build_schedule(fg, (fg.ops[1].outputs[0],))
    steps = sum(st.kind == "recompute" for st in schedule.steps)
    assert steps == 2
    base = step_time(fg, costs, schedule, profile=P)
    more = step_time(fg, costs, schedule, profile=P.replace(step_s=1e-3))
    assert more.rewrite_s - base.rewrite_s == pytest.approx(steps * 1e-3)
    assert more.recompute_s == base.recompute_s


def test_a_gated_read_is_a_launch_outside_xla_and_a_pass_under_it():
    """Outside XLA a recompute step reads a gated tensor through a select
    that passes its buffer on; under XLA through ``t + gate``, a pass that
    reads and writes it (elementwise: 100 MB/s at efficiency 0.5)."""
    fg = chain(2, type="Relu", size_bytes=MiB)
    costs = estimate_costs(fg)
    t = fg.ops[0].outputs[0]
    assert head_gate_seconds(fg, costs, t, P) == pytest.approx(US)
    xla = dataclasses.replace(fg, xla=True)
    assert head_gate_seconds(xla, costs, t, P) == pytest.approx(US + 2 * MiB / 5e7)


def test_copies_whose_values_no_gradient_reads_are_not_counted():
    """A kept MatMul output is a head: its gradient reads its inputs, not its
    output, so TensorFlow never runs the MatMul's copy (only the Relu's)."""
    b = Builder()
    b.source("x", size_bytes=MiB)
    r = b.op("r", "Relu", ["x"], size_bytes=MiB)
    m = b.op("m", "MatMul", [r], size_bytes=MiB, flops=10**9)
    b.op("t", "Tanh", [m], size_bytes=MiB)
    fg = b.build(["x"], ["t:0"])
    costs = estimate_costs(fg)
    kept = fg.ops[_index(fg, "m")].outputs[0]
    schedule = build_schedule(fg, (kept,))
    step = next(st for st in schedule.steps if kept in st.heads)
    assert set(step.ops) == {_index(fg, "r"), _index(fg, "m")}
    t = step_time(fg, costs, schedule, profile=P)
    s = op_seconds(fg, costs, P)
    relu, tanh = _index(fg, "r"), _index(fg, "t")
    assert t.recompute_s == pytest.approx(s.recompute[relu] + s.recompute[tanh])
    assert t.recompute_s < s.recompute[_index(fg, "m")]


def _grow(costs, *, tensor=None, op=None, factor=2):
    if tensor is not None:
        tb = list(costs.tensor_bytes)
        tb[tensor] = tb[tensor] * factor + 1
        return dataclasses.replace(costs, tensor_bytes=tuple(tb))
    flops = list(costs.op_flops)
    flops[op] = flops[op] * factor + 1000
    return dataclasses.replace(costs, op_flops=tuple(flops))


@pytest.mark.parametrize("seed", range(5))
def test_more_bytes_or_flops_is_never_faster(seed):
    rs = random.Random(seed)
    fg = random_dag(rs, 30)
    costs = estimate_costs(fg)
    flops = list(costs.op_flops)
    for i in range(len(flops)):
        flops[i] = rs.randint(0, 10**7)
    costs = dataclasses.replace(costs, op_flops=tuple(flops))
    profile = CPU_DEFAULT.replace(gemm_half_k=48.0)
    base = op_seconds(fg, costs, profile)
    for _ in range(10):
        if rs.random() < 0.5:
            grown = _grow(costs, tensor=rs.randrange(len(fg.tensors)))
        else:
            grown = _grow(costs, op=rs.randrange(len(fg.ops)))
        more = op_seconds(fg, grown, profile)
        for field in ("forward", "recompute", "gradient", "accumulate"):
            assert all(m >= a - 1e-15 for m, a in zip(getattr(more, field), getattr(base, field)))
    # A slower device is never faster.
    slower = op_seconds(fg, costs, profile.replace(peak_flops_per_s=1e9, bytes_per_s=1e9))
    assert slower.forward_s >= base.forward_s and slower.backward_s >= base.backward_s


def test_bad_profiles_are_refused_with_the_value():
    with pytest.raises(DeviceProfileError, match="bytes_per_s=0"):
        P.replace(bytes_per_s=0)
    with pytest.raises(DeviceProfileError, match="overhead_s=-1"):
        P.replace(overhead_s=-1)
    with pytest.raises(DeviceProfileError, match="step_s=nan"):
        P.replace(step_s=float("nan"))
    with pytest.raises(DeviceProfileError, match="'convolution'"):
        P.replace(efficiency={"convolution": Efficiency()})
    with pytest.raises(DeviceProfileError, match="compute=0"):
        Efficiency(compute=0)
    with pytest.raises(MemsaveError, match="fixed_s=nan"):
        Efficiency(fixed_s=float("nan"))


def test_replace_merges_efficiency():
    p = P.replace(efficiency={"conv": Efficiency(compute=0.25)})
    assert p.of("conv").compute == 0.25
    assert p.of("normalization") == P.of("normalization")
    assert p.of("pooling") == Efficiency()


def test_calibration_measures_sane_figures():
    """One calibration on this machine: every figure positive and finite, in
    the range any CPU that runs TensorFlow has, and usable by the model."""
    from memsave.calibrate import CLASSES_MEASURED, calibrate

    p = calibrate(repeats=3, samples=1)
    assert 1e9 < p.peak_flops_per_s < 1e14
    assert 1e8 < p.bytes_per_s < 1e13
    assert 0 <= p.overhead_s < 1e-3
    for cls in CLASSES_MEASURED:
        e = p.of(cls)
        for v in (e.compute, e.memory, e.gradient):
            assert 0 < v < 1e3 and math.isfinite(v)
        assert 0 <= e.fixed_s < 1e-2
    s = op_seconds(residual_block(), estimate_costs(residual_block()), p)
    assert all(math.isfinite(v) and v >= 0 for v in s.forward + s.gradient)
    assert s.forward_s > 0 and s.backward_s > 0


def test_the_time_model_imports_no_tensorflow(fresh):
    """memsave.timemodel (and what it reads) loads without TensorFlow; only
    memsave.calibrate needs it. The package's __init__, which checks for
    TensorFlow, is bypassed."""
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('memsave')\n"
        f"pkg.__path__ = [{str(pathlib.Path(memsave.__file__).parent)!r}]\n"
        "sys.modules['memsave'] = pkg\n"
        "import memsave.timemodel\n"
        "print('tensorflow' in sys.modules, 'memsave.calibrate' in sys.modules)\n"
    )
    out = fresh.run([sys.executable, "-c", code], timeout_s=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
