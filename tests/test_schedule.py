"""build_schedule on hand-built ForwardGraphs (no TF graphs).

Exact schedules for chains (with and without ops that must not be copied),
then seeded random DAGs with random checkpoint sets, checked two ways:

* structural invariants (every head's step runs after the steps that send
  gradients to it; a segment reads only kept, external or its own tensors;
  recomputable ops are all recomputed somewhere and stateful ones never);
* a brute-force oracle: make every op linear with random weights, run the
  schedule step by step (gradients of each step's heads sent to its
  boundary, summed per tensor), and compare the gradients that reach the xs
  with plain reverse-mode over the whole graph.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from memsave import planners
from memsave.problem import Problem
from memsave.schedule import Schedule, Step, build_schedule

import handgraphs as H
from handgraphs import Builder, names, op_names


def _ids(fg, *tensor_names):
    by_name = {t.name: t.id for t in fg.tensors}
    return tuple(by_name[n] for n in tensor_names)


def _steps(fg, schedule: Schedule):
    """Steps as (kind, head names, op names, boundary names), for exact asserts."""
    return [
        (s.kind, names(fg, s.heads), op_names(fg, s.ops), names(fg, s.boundary))
        for s in schedule.steps
    ]


# -- chains ----------------------------------------------------------------------


def test_chain_steps_run_back_to_front_one_segment_each():
    fg = H.chain(10)
    sched = build_schedule(fg, _ids(fg, "op2:0", "op5:0"))
    assert names(fg, sched.kept) == ["x", "op2:0", "op5:0"]
    assert names(fg, sched.checkpoints) == ["op2:0", "op5:0"]
    assert _steps(fg, sched) == [
        ("recompute", ["op9:0"], ["op6", "op7", "op8", "op9"], ["op5:0"]),
        ("recompute", ["op5:0"], ["op3", "op4", "op5"], ["op2:0"]),
        ("recompute", ["op2:0"], ["op0", "op1", "op2"], ["x"]),
    ]
    assert sched.recomputed_ops == 10


def test_chain_checkpoint_order_does_not_matter():
    fg = H.chain(10)
    assert build_schedule(fg, _ids(fg, "op5:0", "op2:0", "op5:0")) == build_schedule(
        fg, _ids(fg, "op2:0", "op5:0")
    )


@pytest.mark.parametrize("every", [1, 2, 3, 7])
def test_chain_segments_cover_exactly_the_ops_between_checkpoints(every):
    n = 20
    fg = H.chain(n)
    cps = [i for i in range(n - 1) if i % every == every - 1]  # op indices kept
    sched = build_schedule(fg, _ids(fg, *(f"op{i}:0" for i in cps)))
    bounds = [-1, *cps, n - 1]
    expected = [
        list(range(lo + 1, hi + 1)) for lo, hi in zip(bounds[-2::-1], bounds[:0:-1])
    ]
    assert [list(s.ops) for s in sched.steps] == expected
    assert all(s.kind == "recompute" for s in sched.steps)
    # Heads in decreasing order: backprop walks the chain from the end.
    heads = [fg.tensors[s.heads[0]].producer for s in sched.steps]
    assert heads == sorted(heads, reverse=True)
    # Each op recomputed exactly once.
    assert sched.recomputed_ops == n


def _dense_chain(layers: int):
    """Layers of ReadVariableOp(w_i) -> MatMul(h, read) -> Tanh; data is external."""
    b = Builder()
    h = b.external("data")
    ws = [b.source(f"w{i}") for i in range(layers)]
    for i in range(layers):
        r = b.op(f"read{i}", "ReadVariableOp", [ws[i]], recomputable=False)
        m = b.op(f"mm{i}", "MatMul", [h, r])
        h = b.op(f"tanh{i}", "Tanh", [m])
    return b.build(ws, [h])


def test_variable_reads_are_kept_and_differentiated_in_place():
    fg = _dense_chain(4)
    sched = build_schedule(fg, _ids(fg, "tanh1:0"))
    reads = [f"read{i}:0" for i in range(4)]
    assert set(names(fg, sched.kept)) == {"tanh1:0", *reads, "w0", "w1", "w2", "w3"}
    assert _steps(fg, sched) == [
        ("recompute", ["tanh3:0"], ["mm2", "tanh2", "mm3", "tanh3"],
         ["tanh1:0", "read2:0", "read3:0"]),
        ("recompute", ["tanh1:0"], ["mm0", "tanh0", "mm1", "tanh1"],
         ["read0:0", "read1:0"]),
        ("backprop", reads, ["read0", "read1", "read2", "read3"],
         ["w0", "w1", "w2", "w3"]),
    ]


def test_stateful_op_mid_chain_is_backpropagated_not_copied():
    b = Builder()
    h = b.source("x")
    for i in range(4):
        h = b.op(f"op{i}", "Tanh", [h])
    h = b.op("noise", "StatefulNoise", [h], recomputable=False)
    for i in range(5, 8):
        h = b.op(f"op{i}", "Tanh", [h])
    fg = b.build(["x"], [h])
    sched = build_schedule(fg, ())
    # Its input and output are kept although no checkpoint was asked for.
    assert names(fg, sched.kept) == ["x", "op3:0", "noise:0"]
    assert _steps(fg, sched) == [
        ("recompute", ["op7:0"], ["op5", "op6", "op7"], ["noise:0"]),
        ("backprop", ["noise:0"], ["noise"], ["op3:0"]),
        ("recompute", ["op3:0"], ["op0", "op1", "op2", "op3"], ["x"]),
    ]


def test_residual_block_with_the_block_output_kept():
    fg = H.residual_block()
    assert _steps(fg, build_schedule(fg, _ids(fg, "add:0"))) == [
        ("recompute", ["head:0"], ["post", "head"], ["add:0"]),
        ("recompute", ["add:0"], ["pre", "a", "b", "c", "add"], ["x"]),
    ]


def test_a_y_read_by_later_ops_is_kept_so_nothing_is_recomputed_twice():
    b = Builder()
    h = b.source("x")
    for i in range(6):
        h = b.op(f"op{i}", "Tanh", [h])
    fg = b.build(["x"], ["op2:0", "op5:0"])
    sched = build_schedule(fg, _ids(fg, "op3:0"))
    # op0..op2 feed both the y op2:0 and the checkpoint op3:0: rather than
    # recompute them in two steps, op2:0 is kept and becomes a head.
    assert _ids(fg, "op2:0")[0] in sched.kept
    assert _steps(fg, sched) == [
        ("recompute", ["op5:0"], ["op4", "op5"], ["op3:0"]),
        ("recompute", ["op3:0"], ["op3"], ["op2:0"]),
        ("recompute", ["op2:0"], ["op0", "op1", "op2"], ["x"]),
    ]


def test_residual_stream_off_the_checkpoints_is_kept_not_recomputed_per_block():
    # Checkpoints on the branches only ('speed' on a ResNet): without keeping
    # the stream, each block's step would walk back to x and recompute all.
    b = Builder()
    h = b.source("x")
    branch_outs = []
    for i in range(4):
        m = b.op(f"mm{i}", "MatMul", [h])
        branch_outs.append(f"mm{i}:0")
        r = b.op(f"relu{i}", "Relu", [m])
        h = b.op(f"add{i}", "AddV2", [r, h])
    y = b.op("loss", "Sum", [h])
    fg = b.build(["x"], [y])
    sched = build_schedule(fg, _ids(fg, *branch_outs))
    assert sched.recomputed_ops == sum(op.recomputable for op in fg.ops)
    kept_names = set(fg.describe(sched.kept))
    assert {"add0:0", "add1:0", "add2:0"} <= kept_names


# -- random DAGs -------------------------------------------------------------------


def _random_dag(rs: np.random.RandomState):
    """A random forward graph with random checkpoints.

    Two or three xs, one or two external inputs, 5-40 ops reading 1-3
    tensors (mostly recent ones: chains with skips), some with two outputs,
    some not recomputable, some outputs not trainable; the ys are the
    tensors nothing reads, made trainable (so every op leads to a y and
    every y carries a gradient), plus sometimes a
    repeated or an intermediate one; sometimes an intermediate tensor is an x.
    """
    b = Builder()
    n_x = int(rs.randint(2, 4))
    xs = [b.source(f"x{i}") for i in range(n_x)]
    ext = [b.external(f"e{i}", trainable=bool(rs.rand() < 0.5)) for i in range(rs.randint(1, 3))]
    live = list(xs)
    outs_of = []
    for i in range(int(rs.randint(5, 41))):
        k = int(rs.randint(1, 4))
        picks = {len(live) - min(int(rs.geometric(0.4)), len(live)) for _ in range(k)}
        inputs = [live[j] for j in sorted(picks)]
        if rs.rand() < 0.3:
            inputs.append(ext[int(rs.randint(len(ext)))])
        n_out = 2 if rs.rand() < 0.15 else 1
        out = b.op(
            f"op{i}", "Op", inputs, n_out=n_out,
            recomputable=bool(rs.rand() > 0.15),
            trainable=bool(rs.rand() > 0.08),
        )
        outs = [out] if n_out == 1 else out
        outs_of.append(outs)
        live.extend(outs)
    consumed = {t for op in b.ops for t in op.inputs}
    internal = [t for outs in outs_of for t in outs]
    ys = [t for t in internal if b.ids[t] not in consumed]
    for y in ys:  # a y carries a gradient
        b.tensors[b.ids[y]] = dataclasses.replace(b.tensors[b.ids[y]], trainable=True)
    if rs.rand() < 0.3:
        ys.append(ys[0])  # tf.gradients sums a repeated y twice
    if rs.rand() < 0.3:
        ys.append(internal[int(rs.randint(len(internal)))])
    if rs.rand() < 0.3:
        xs.append(internal[int(rs.randint(len(internal)))])
    fg = b.build(xs, ys)

    density = rs.choice([0.0, 0.1, 0.3, 0.7])
    pool = [
        t.id for t in fg.internal_tensors()
        if fg.ops[t.producer].recomputable and t.id not in fg.ys
    ]
    cps = tuple(int(t) for t in pool if rs.rand() < density)
    return fg, cps


def _check_invariants(fg, sched: Schedule, checkpoints) -> None:
    tensors = fg.tensors
    kept = set(sched.kept)

    # What is kept: checkpoints, xs, what stateful ops touch, and outputs of
    # recomputable ops that two steps would otherwise both recompute.
    expected = set(checkpoints) | set(fg.xs)
    for op in fg.ops:
        if not op.recomputable:
            expected |= set(op.outputs)
            expected |= {t for t in op.inputs if tensors[t].kind != "external"}
    assert expected <= kept
    for t in kept - expected:
        assert tensors[t].kind == "internal" and fg.ops[tensors[t].producer].recomputable
    assert list(sched.kept) == sorted(kept)

    def differentiable(t):
        return t in kept and tensors[t].trainable and tensors[t].kind != "external"

    head_step: dict[int, int] = {}
    recomputed: set[int] = set()
    backpropped: list[int] = []
    for k, step in enumerate(sched.steps):
        assert step.ops
        assert list(step.ops) == sorted(set(step.ops))
        assert all(differentiable(b) for b in step.boundary), "boundary must be kept"
        for h in step.heads:
            assert h not in head_step, f"{tensors[h].name} is a head of two steps"
            head_step[h] = k
        ops = set(step.ops)
        if step.kind == "recompute":
            assert all(fg.ops[o].recomputable for o in ops), "stateful op copied"
            assert all(tensors[h].producer in ops for h in step.heads)
            for o in ops:
                for t in fg.ops[o].inputs:
                    node = tensors[t]
                    assert t in kept or node.kind == "external" or node.producer in ops, (
                        f"step {k} reads {node.name}, neither kept, external nor recomputed"
                    )
            assert not ops & recomputed, "an op is recomputed by two steps"
            recomputed |= ops
        else:
            assert step.kind == "backprop"
            assert not any(fg.ops[o].recomputable for o in ops)
            backpropped.extend(ops)
            for o in ops:
                assert set(fg.ops[o].outputs) <= kept
            assert set(step.heads) == {
                t for o in ops for t in fg.ops[o].outputs if tensors[t].trainable
            }

    # Every head runs after all the steps that send it gradients.
    for k, step in enumerate(sched.steps):
        for b in step.boundary:
            if tensors[b].kind == "internal":
                assert b in head_step, f"{tensors[b].name} receives gradients but is never a head"
                assert head_step[b] > k, (
                    f"{tensors[b].name} is a head of step {head_step[b]} but receives "
                    f"gradients from step {k}"
                )

    # Every recomputable op is recomputed (each one leads to a y), every
    # stateful op is differentiated in place exactly once.
    assert recomputed == {op.index for op in fg.ops if op.recomputable}
    assert sorted(backpropped) == [op.index for op in fg.ops if not op.recomputable]
    assert sched.recomputed_ops == sum(len(s.ops) for s in sched.steps if s.kind == "recompute")


def _weights(fg, rs):
    """A random linear map per op: out_j = sum_i w[o][j][i] * in_i."""
    return [rs.uniform(-1.5, 1.5, size=(len(op.outputs), len(op.inputs))) for op in fg.ops]


def _oracle(fg, w) -> list[float]:
    """d sum(ys) / d xs by reverse mode over the whole graph."""
    adj = np.zeros(len(fg.tensors))
    for y in fg.ys:
        adj[y] += 1.0
    for op in reversed(fg.ops):
        for j, out in enumerate(op.outputs):
            if not fg.tensors[out].trainable or adj[out] == 0:
                continue
            for i, t in enumerate(op.inputs):
                if fg.tensors[t].trainable:
                    adj[t] += w[op.index][j, i] * adj[out]
    return [adj[x] for x in fg.xs]


def _run_schedule(fg, sched: Schedule, w) -> list[float]:
    """Run the schedule's steps on the linear model ``w``, as the schedule means them.

    A recompute step differentiates (copies of) its ops from its heads,
    reading its boundary tensors as independent inputs and sending their
    gradients to them; a backprop step does the same on the original ops.
    Each step starts from what earlier steps sent to its heads.

    (memsave.rewrite wires a boundary tensor to its copy instead when its
    producer is copied in the same step; see tests/test_regressions.py.)
    """
    tensors = fg.tensors
    received: dict[int, float] = collections.defaultdict(float)
    has: set[int] = set()
    for y in fg.ys:
        received[y] += 1.0
        has.add(y)
    for step in sched.steps:
        heads = [h for h in step.heads if h in has]
        if not heads or not step.boundary:
            continue
        ops = set(step.ops)
        boundary = set(step.boundary)
        local = collections.defaultdict(float)
        for h in heads:
            local[h] += received[h]
        sent = collections.defaultdict(float)
        for o in reversed(step.ops):
            op = fg.ops[o]
            for j, out in enumerate(op.outputs):
                g = local.get(out, 0.0)
                if not tensors[out].trainable or g == 0.0:
                    continue
                for i, t in enumerate(op.inputs):
                    if not tensors[t].trainable:
                        continue
                    contrib = w[o][j, i] * g
                    if t in boundary:
                        sent[t] += contrib
                    elif tensors[t].producer in ops:
                        local[t] += contrib
        for b, g in sent.items():
            received[b] += g
            has.add(b)
    return [received[x] for x in fg.xs]


SEEDS = range(150)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_dag_schedule(seed):
    rs = np.random.RandomState(seed)
    fg, cps = _random_dag(rs)
    sched = build_schedule(fg, cps)
    _check_invariants(fg, sched, cps)
    w = _weights(fg, rs)
    np.testing.assert_allclose(_run_schedule(fg, sched, w), _oracle(fg, w), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_random_dag_schedule_with_memory_strategy(seed):
    rs = np.random.RandomState(1000 + seed)
    fg, _ = _random_dag(rs)
    cps = planners.run("memory", Problem(fg)).checkpoint_ids
    sched = build_schedule(fg, cps)
    _check_invariants(fg, sched, cps)
    w = _weights(fg, rs)
    np.testing.assert_allclose(_run_schedule(fg, sched, w), _oracle(fg, w), rtol=1e-9, atol=1e-9)


def test_random_dags_exercise_the_interesting_cases():
    """Guard against a generator that stopped producing the hard cases."""
    seen = collections.Counter()
    for seed in SEEDS:
        rs = np.random.RandomState(seed)
        fg, cps = _random_dag(rs)
        sched = build_schedule(fg, cps)
        seen["checkpoints"] += bool(cps)
        seen["backprop step"] += any(s.kind == "backprop" for s in sched.steps)
        seen["multi-head step"] += any(len(s.heads) > 1 for s in sched.steps)
        seen["shared ops kept"] += len(sched.kept) > len(
            set(cps) | set(fg.xs)
            | {t for op in fg.ops if not op.recomputable for t in op.outputs + op.inputs
               if fg.tensors[t].kind != "external"}
        )
        seen["internal x"] += any(fg.tensors[x].kind == "internal" for x in fg.xs)
        seen["repeated y"] += len(set(fg.ys)) < len(fg.ys)
    assert min(seen.values()) >= 10, seen


def test_step_and_schedule_are_values():
    fg = H.chain(4)
    a = build_schedule(fg, _ids(fg, "op1:0"))
    b = build_schedule(fg, _ids(fg, "op1:0"))
    assert a == b and hash(a.steps) == hash(b.steps)
    assert isinstance(a.steps[0], Step)


def test_a_run_of_stored_ops_is_one_backprop_step():
    # mm0..tanh1 stored: one backprop step over the run (the variable reads
    # between them do not end it), not one step per op.
    fg = _dense_chain(4)
    ops = {op.name: op.index for op in fg.ops}
    stored = [ops[n] for n in ("mm0", "tanh0", "mm1", "tanh1")]
    sched = build_schedule(fg, (), in_place=stored)
    assert _steps(fg, sched) == [
        ("recompute", ["tanh3:0"], ["mm2", "tanh2", "mm3", "tanh3"],
         ["tanh1:0", "read2:0", "read3:0"]),
        ("backprop", ["mm0:0", "tanh0:0", "mm1:0", "tanh1:0"], ["mm0", "tanh0", "mm1", "tanh1"],
         ["read0:0", "read1:0"]),
        ("backprop", [f"read{i}:0" for i in range(4)], [f"read{i}" for i in range(4)],
         ["w0", "w1", "w2", "w3"]),
    ]
    # A recomputed op between two stored ones ends the run.
    stored = [ops[n] for n in ("tanh0", "tanh1")]
    steps = _steps(fg, build_schedule(fg, (), in_place=stored))
    assert [s[2] for s in steps if s[0] == "backprop"][:2] == [["tanh1"], ["tanh0"]]
