"""Checkpoint selection strategies on hand-built ForwardGraphs (no TF graphs).

Each graph is small enough to work out the answer by hand; the expected
checkpoints are written as tensor names. The last test checks, on seeded
random DAGs, the articulation search against a brute-force oracle (remove
each op and count connected components).
"""

from __future__ import annotations

import dataclasses
import math

import networkx as nx
import numpy as np
import pytest

import memsave
from memsave import candidates, planners, strategies
from memsave.candidates import articulation_points as articulation_candidates
from memsave.candidates import topological_cuts
from memsave.costs import estimate_costs
from memsave.memory_model import BFC, MemoryModel
from memsave.problem import Problem
from memsave.schedule import build_schedule
from memsave.simulate import simulate
from memsave.strategies import Selection

import handgraphs as H
from handgraphs import MiB, Builder, names


def plan(name, fg, **options):
    """The Plan of planner ``name`` on ``fg`` (a fresh Problem), with these options."""
    return planners.run(name, Problem(fg), options=options)


@pytest.fixture
def registry():
    """Unregister whatever the test registers, so nothing leaks into other tests."""
    before = set(strategies.available())
    yield
    for name in set(strategies.available()) - before:
        strategies.unregister(name)
    assert set(strategies.available()) == before


# -- articulation candidates ---------------------------------------------------


def test_chain_candidates_are_every_inner_op_output():
    fg = H.chain(6)
    # op0 touches only x (not part of the undirected op graph) and op1, so
    # removing it disconnects nothing; op5's output is the y, never a candidate.
    assert names(fg, articulation_candidates(fg)) == ["op1:0", "op2:0", "op3:0", "op4:0"]


def test_residual_block_keeps_block_boundaries_not_bypassed_ops():
    fg = H.residual_block()
    cands = names(fg, articulation_candidates(fg))
    assert cands == ["a:0", "add:0", "post:0"]
    # b and c lie on a cycle with the skip connection: keeping either would
    # still leave a's output needed by add, so neither cuts the graph.
    assert "b:0" not in cands and "c:0" not in cands


def test_unet_long_skip_leaves_no_candidate_in_the_bypassed_region():
    fg = H.unet()
    cands = names(fg, articulation_candidates(fg))
    assert cands == ["e1:0", "d1:0", "out:0"]
    bypassed = {"e2:0", "e3:0", "mid:0", "d2:0", "up:0"}
    assert not bypassed & set(cands)


def test_candidates_skip_non_trainable_multi_output_and_stateful_ops():
    b = Builder()
    x = b.source("x")
    h = b.op("h0", "Tanh", [x])
    h = b.op("h1", "Tanh", [h])
    idx = b.op("argmax", "ArgMax", [h], trainable=False)  # int output: no gradient
    g = b.op("gather", "GatherV2", [h, idx])
    s1, s2 = b.op("split", "Split", [g], n_out=2)  # two used outputs: not a single cut
    c = b.op("concat", "ConcatV2", [s1, s2])
    r = b.op("rand", "StatefulOp", [c], recomputable=False)
    h = b.op("h2", "Tanh", [r])
    h = b.op("h3", "Tanh", [h])
    y = b.op("h4", "Tanh", [h])
    fg = b.build(["x"], [y])
    cands = names(fg, articulation_candidates(fg))
    assert "argmax:0" not in cands  # not trainable
    assert "split:0" not in cands and "split:1" not in cands  # op has two used outputs
    assert "rand:0" not in cands  # not recomputable (kept anyway)
    # h1 feeds argmax and gather, which meet again: h1 is the cut before them.
    assert cands == ["h1:0", "gather:0", "h3:0"]


def _normalised_chain(n_blocks=3, *, head_bytes=H.MiB):
    """Conv -> batch-norm-like normalisation -> Relu blocks, then a head.

    ::

        x -> a -> c0 -> n0 = c0 * rs0 -> r0 -> c1 ... -> r{n-1} -> pool -> head = y
                  |-> sq0 -> var0 (64 B) -> rs0 (64 B) --^

    ``sq``'s only consumer is the variance ``var``, which rejoins the chain
    through channel-sized (small) tensors only: ``sq`` is an articulation
    point of the undirected op graph, but keeping it bounds no segment.
    ``pool`` and ``head`` produce ``head_bytes`` bytes each.
    """
    b = Builder()
    h = b.op("a", "Tanh", [b.source("x")])
    for i in range(n_blocks):
        c = b.op(f"c{i}", "Conv2D", [h])
        sq = b.op(f"sq{i}", "SquaredDifference", [c])
        var = b.op(f"var{i}", "Mean", [sq], size_bytes=64)
        rs = b.op(f"rs{i}", "Rsqrt", [var], size_bytes=64)
        h = b.op(f"n{i}", "Mul", [c, rs])
        h = b.op(f"r{i}", "Relu", [h])
    h = b.op("pool", "Mean", [h], size_bytes=head_bytes)
    y = b.op("head", "MatMul", [h], size_bytes=head_bytes)
    return b.build(["x"], [y]), b


_BLOCK_CUTS = ["c0:0", "n0:0", "r0:0", "c1:0", "n1:0", "r1:0", "c2:0", "n2:0", "r2:0"]


def test_a_statistics_branch_is_not_a_candidate():
    fg, _ = _normalised_chain()
    # Every op of the chain separates x from the y; sq only cuts var off.
    # (pool:0 too: head reads it.)
    assert names(fg, articulation_candidates(fg)) == [*_BLOCK_CUTS, "pool:0"]


def test_a_small_head_keeps_the_body_cut_points():
    # pool and head are 1 KiB, below 1/64 of the 1 MiB activations: the y is
    # cut off from the body. The body's last op (pool) stands for the end,
    # so the chain's cut points remain and the statistics branches do not.
    fg, _ = _normalised_chain(head_bytes=1024)
    assert names(fg, articulation_candidates(fg)) == _BLOCK_CUTS
    chosen = names(fg, plan("memory", fg, min_saving_fraction=0.0).checkpoint_ids)
    assert chosen and set(chosen) <= set(_BLOCK_CUTS)


def test_small_means_small_against_activations_not_variables():
    # A 64 MiB weight read (not recomputable, kept anyway) must not make the
    # 1 MiB activations "small": they still tie the chain together.
    b = Builder()
    w = b.op("read", "ReadVariableOp", [b.source("w")], recomputable=False, size_bytes=64 * H.MiB)
    h = b.op("c0", "Conv2D", [b.external("image", trainable=True), w])
    for i in range(1, 5):
        h = b.op(f"c{i}", "Relu", [h])
    fg = b.build(["w"], [h])
    assert names(fg, articulation_candidates(fg)) == ["c1:0", "c2:0", "c3:0"]


def test_a_reshaped_weight_does_not_make_its_matmul_a_cut():
    # Keras's EinsumDense reshapes the kernel read by a constant shape: the
    # Reshape hangs off the MatMul and reads no input data, so the MatMuls
    # (bypassed by the skip connection) stay off the path.
    b = Builder()
    h = b.op("embed", "GatherV2", [b.external("ids", trainable=False),
                                   b.op("table", "ReadVariableOp", [b.source("t")], recomputable=False)])
    shape = b.external("shape", trainable=False)
    b.tensors[b.ids[shape]] = dataclasses.replace(b.tensors[b.ids[shape]], constant=True)
    for i in range(2):
        w = b.op(f"read{i}", "ReadVariableOp", [b.source(f"w{i}")], recomputable=False, size_bytes=64 * 1024)
        k = b.op(f"kernel{i}", "Reshape", [w, shape], size_bytes=64 * 1024)
        q = b.op(f"mm{i}", "MatMul", [h, k])
        q = b.op(f"relu{i}", "Relu", [q])
        h = b.op(f"add{i}", "AddV2", [h, q])
    y = b.op("head", "Tanh", [h])
    fg = b.build(["t", "w0", "w1"], [y])
    assert names(fg, articulation_candidates(fg)) == ["add0:0", "add1:0"]


# -- 'speed' and 'collection' ---------------------------------------------------


def _mixed_graph(tag=()):
    """MatMul/Conv2D interleaved with cheap ops; ``tag`` names tensors to tag."""
    b = Builder()
    x = b.source("x")
    data = b.external("data", trainable=True)
    tagged = set(tag)

    def op(name, type, inputs, **kw):
        return b.op(name, type, inputs, tagged=f"{name}:0" in tagged, **kw)

    h = op("mm1", "MatMul", [data, x])
    h = op("bias1", "BiasAdd", [h])
    h = op("tanh1", "Tanh", [h])
    h = op("conv", "Conv2D", [h])
    h = op("relu", "Relu", [h])
    n = op("shape", "Shape", [h], trainable=False)
    h = op("reshape", "Reshape", [h, n])
    h = op("mm2", "MatMul", [h])
    h = op("add", "AddV2", [h])
    y = op("mm3", "MatMul", [h])  # the y: never a checkpoint
    return b.build(["x"], [y])


def test_speed_by_rule_keeps_matmul_and_conv2d_outputs_only():
    fg = _mixed_graph()
    sel = plan("speed", fg, op_types=strategies.EXPENSIVE_OP_TYPES, min_saving_fraction=0.0)
    assert names(fg, sel.checkpoint_ids) == ["mm1:0", "conv:0", "mm2:0"]
    assert [sel.reason_of[t] for t in sel.checkpoint_ids] == [
        "output of MatMul", "output of Conv2D", "output of MatMul",
    ]
    assert sel.note == ""


def test_speed_by_rule_with_no_expensive_op_says_so():
    sel = plan("speed", H.chain(5, type="Relu"), op_types=strategies.EXPENSIVE_OP_TYPES)
    assert sel.checkpoint_ids == ()
    assert "checkpoints='memory'" in sel.note


def test_speed_op_types_option():
    fg = _mixed_graph()
    sel = plan("speed", fg, op_types=frozenset({"Relu", "Tanh"}), min_saving_fraction=0.0)
    assert names(fg, sel.checkpoint_ids) == ["tanh1:0", "relu:0"]


@pytest.mark.parametrize("op_types", ["MatMul", 3, [3]])
def test_speed_op_types_must_be_a_set_of_names(op_types):
    """A string was matched as a substring ('Mul' in 'MatMul': Mul outputs
    kept), a number raised a bare TypeError."""
    with pytest.raises(memsave.OptionsError, match="op_types must be a set of op type names"):
        plan("speed", _mixed_graph(), op_types=op_types)


def test_collection_keeps_tagged_tensors_only():
    fg = _mixed_graph(tag=("bias1:0", "relu:0", "add:0"))
    sel = plan("collection", fg)
    assert names(fg, sel.checkpoint_ids) == ["bias1:0", "relu:0", "add:0"]
    assert set(sel.reason_of.values()) == {"tagged"}
    assert sel.note == ""


def test_collection_ignores_tagged_ys_and_untrainable_tensors():
    fg = _mixed_graph(tag=("shape:0", "mm3:0", "tanh1:0"))
    assert names(fg, plan("collection", fg).checkpoint_ids) == ["tanh1:0"]


def test_collection_with_nothing_tagged_says_how_to_tag():
    sel = plan("collection", _mixed_graph())
    assert sel.checkpoint_ids == ()
    assert "add_to_collection('checkpoints'" in sel.note


# -- 'memory' ------------------------------------------------------------------


def _producers(fg, sel) -> list[int]:
    return [fg.tensors[t].producer for t in sel.checkpoint_ids]


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """'memory''s first stage (strategies.candidate_plan), as the tests read it."""

    checkpoint_ids: tuple[int, ...]
    reason_of: dict
    limit_bytes: int


def candidate(fg, *, peak_tolerance=0.0, check_memory=True) -> _Candidate:
    """The lowest-peak candidate plan 'memory' weighs (with ``peak_tolerance``
    0: its structure, which the tests below pin); and, with
    ``check_memory``, the contract of 'memory' itself on the same graph: its
    forecast peak (every byte counted) within the default tolerance of the
    lowest candidate peak, its forecast step no slower than the candidate's."""
    from memsave.planners.strategies import MEMORY_PEAK_TOLERANCE, candidate_plan

    problem = Problem(fg)
    ids, limit, _ = candidate_plan(problem, peak_tolerance=peak_tolerance)
    points = set(problem.articulation_points())
    reasons = {t: "articulation point" if t in points else candidates.CUT_REASON for t in ids}
    if check_memory:
        sel = planners.run("memory", problem, options={"min_saving_fraction": 0.0})
        _, default_limit, _ = candidate_plan(problem, peak_tolerance=MEMORY_PEAK_TOLERANCE)
        assert problem.peak(sel.schedule, model=problem.judge) <= default_limit
        assert default_limit <= int(problem.peak(problem.schedule(ids), model=problem.judge)
                                    * (1 + MEMORY_PEAK_TOLERANCE))
        assert sel.step_seconds <= problem.step_time(problem.schedule(ids)).total_s
    return _Candidate(ids, reasons, limit)


class _FiguresProblem:
    """What strategies.candidate_plan reads of a Problem, with set figures:
    per plan, its peak with the gradients kept and its working memory."""

    judge = None

    def __init__(self, figures, *, xla):
        self.figures = figures
        self.fg = dataclasses.make_dataclass("Fg", [("xla", bool)])(xla)

    def memory_plans(self, **_):
        return list(self.figures)

    def schedule(self, c):
        return c

    def peak_floor(self, schedule, *, model=None):
        return 0

    def peak(self, schedule, *, model=None, gradients_kept=True):
        return self.figures[schedule][0 if gradients_kept else 1]


def test_under_xla_peaks_within_the_tie_go_to_the_least_working_memory_then_fewest_checkpoints():
    """Under XLA a forecast peak a few bytes lower says nothing (a loss
    scale's held gradients make plans' peaks differ by 512 bytes on
    MobileNetV2 where the measured peaks differ by 12 MiB the other way):
    peaks within XLA_PEAK_TIE are tied."""
    from memsave.planners.strategies import XLA_PEAK_TIE, candidate_plan

    seven, six, nine = tuple(range(7)), tuple(range(6)), tuple(range(9))
    figures = {seven: (1_000_000, 900_000), six: (1_000_512, 900_000),
               nine: (int(1_000_000 * (1 + 2 * XLA_PEAK_TIE)), 800_000)}
    chosen, _, within = candidate_plan(_FiguresProblem(figures, xla=True),
                                       peak_tolerance=XLA_PEAK_TIE)
    assert chosen == six and set(within) == {six, seven}
    eight = tuple(range(8))
    figures[eight] = (int(1_000_000 * (1 + XLA_PEAK_TIE / 2)), 850_000)
    chosen, _, _ = candidate_plan(_FiguresProblem(figures, xla=True), peak_tolerance=XLA_PEAK_TIE)
    assert chosen == eight


@pytest.mark.parametrize("n", [16, 36, 100, 400])
def test_memory_spreads_about_sqrt_n_checkpoints_along_a_uniform_chain(n):
    fg = H.chain(n)
    sel = candidate(fg, check_memory=n <= 100)
    k = len(sel.checkpoint_ids)
    # Chen et al.'s balance: about sqrt(n) segments of about sqrt(n) ops.
    # (The simulator picks among greedy and evenly spread plans, so a few
    # more than sqrt(n) may win: each costs 1 MiB, each saves segment bytes.)
    assert math.sqrt(n) - 2 <= k <= 1.25 * math.sqrt(n) + 1, (n, k)
    pos = _producers(fg, sel)
    assert pos == sorted(set(pos)), "checkpoints must be distinct and in topological order"
    assert set(sel.checkpoint_ids) <= set(articulation_candidates(fg))
    assert set(sel.reason_of.values()) == {"articulation point"}
    # Segment lengths (ops recomputed per segment) never grow toward the end:
    # more checkpoints are alive when the later segments run backprop first.
    seg = np.diff([-1, *pos, n - 1])
    assert seg.sum() == n
    assert all(a >= b for a, b in zip(seg, seg[1:])), seg
    assert seg[0] >= seg[-1]
    # No segment is longer than a few sqrt(n) ops, so the estimated peak
    # (kept checkpoints + half the largest segment) is O(sqrt(n)), not O(n).
    assert seg.max() <= 2 * math.sqrt(n) + 1, seg
    peak = k + 0.5 * seg.max()
    assert peak <= 2.5 * math.sqrt(n), peak


def test_memory_on_a_short_chain_is_exact():
    fg = H.chain(16)
    # Four segments of 4 ops: the simulator forecasts 8 MiB for it, 9 MiB for
    # 6, 5, 4, 1 (op5, op10, op14) and 10 MiB for the greedy 7, 5, 3, 1 split
    # (op6, op11, op14) of the old estimate, which left out the gradient
    # buffers and the seed gradient (a folded constant: resident).
    assert names(fg, candidate(fg).checkpoint_ids) == ["op3:0", "op7:0", "op11:0"]
    # 'memory' itself, within 5% of 8 MiB, keeps that peak.
    sel = plan("memory", fg)
    assert sel.problem.peak(sel.schedule, model=sel.problem.judge) == 8 * MiB


def test_memory_weights_positions_by_bytes_not_op_count():
    # The first 8 ops produce tiny tensors, the last 8 large ones: checkpoints
    # go where the bytes are.
    b = Builder()
    h = b.source("x")
    for i in range(8):
        h = b.op(f"small{i}", "Tanh", [h], size_bytes=16)
    for i in range(8):
        h = b.op(f"big{i}", "Tanh", [h], size_bytes=H.MiB)
    fg = b.build(["x"], [h])
    chosen = names(fg, plan("memory", fg).checkpoint_ids)
    assert chosen and all(c.startswith("big") for c in chosen), chosen


@pytest.mark.parametrize(
    "k, expected",
    [
        (1, ["op49:0"]),
        (4, ["op19:0", "op39:0", "op59:0", "op79:0"]),
        (9, [f"op{10 * j - 1}:0" for j in range(1, 10)]),
    ],
)
def test_memory_num_checkpoints_spreads_evenly(k, expected):
    fg = H.chain(100)
    sel = plan("memory", fg, num_checkpoints=k)
    assert names(fg, sel.checkpoint_ids) == expected


def test_memory_num_checkpoints_bounds():
    fg = H.chain(10)
    cands = articulation_candidates(fg)
    none = plan("memory", fg, num_checkpoints=0)
    assert none.checkpoint_ids == () and "num_checkpoints=0" in none.note  # the fallback says why
    assert plan("memory", fg, num_checkpoints=len(cands)).checkpoint_ids == tuple(cands)
    assert plan("memory", fg, num_checkpoints=50).checkpoint_ids == tuple(cands)
    with pytest.raises(ValueError, match="num_checkpoints"):
        plan("memory", fg, num_checkpoints=-1)


def _cut_tensors(fg) -> set[int]:
    """Every tensor crossing a candidate cut of the topological order."""
    return {t for c in topological_cuts(fg, estimate_costs(fg)) for t in c.crossing}


def test_memory_on_residual_and_unet_picks_only_cut_points():
    for fg in (H.residual_block(), H.unet()):
        chosen = set(plan("memory", fg, min_saving_fraction=0.0).checkpoint_ids)
        assert chosen and chosen <= set(articulation_candidates(fg)) | _cut_tensors(fg)


def _stem_and_two_branches():
    # Long skips from the stem to the last op bypass 18 of 23 tensors.
    b = Builder()
    x = b.source("x")
    h = x
    for i in range(3):
        h = b.op(f"pre{i}", "Relu", [h])
    stem = b.op("stem", "Conv2D", [h])
    p = q = stem
    for i in range(9):
        p = b.op(f"p{i}", "Tanh", [p])
        q = b.op(f"q{i}", "Relu", [q])
    y = b.op("join", "AddV2", [p, q, stem])
    return b, b.build(["x"], [y])


def test_memory_plans_over_cuts_where_articulation_points_save_little():
    # Keeping the stem alone (its only articulation point in the branches'
    # region) would cut the forecast peak from 24 to 20 MiB; keeping the
    # pairs (p_i, q_i) that cross cuts of the topological order recomputes
    # each branch in short segments: 11 MiB.
    b, fg = _stem_and_two_branches()
    assert names(fg, articulation_candidates(fg)) == ["pre1:0", "pre2:0", "stem:0"]
    sel = candidate(fg)
    assert names(fg, sel.checkpoint_ids) == [
        "stem:0", "q1:0", "p2:0", "p4:0", "q4:0", "p6:0", "q6:0"]
    assert sel.reason_of[b.ids["stem:0"]] == "articulation point"
    assert sel.reason_of[b.ids["q1:0"]] == candidates.CUT_REASON
    costs = estimate_costs(fg)
    peak = simulate(fg, build_schedule(fg, sel.checkpoint_ids), costs, model=MemoryModel(allocator=BFC),
                    timeline=False).peak_bytes
    assert peak == 11 * MiB
    assert plan("memory", fg, num_checkpoints=1).checkpoint_ids == (b.ids["stem:0"],)


def test_memory_keeps_nothing_when_the_best_plan_saves_too_little():
    # The plan above saves 13 of the 22 MiB of working memory (x and the
    # seed gradient are resident): 59.1%.
    b, fg = _stem_and_two_branches()
    sel = plan("memory", fg, min_saving_fraction=0.6)
    assert sel.checkpoint_ids == ()
    assert "from 25,165,824 to 11,534,336 bytes, a saving of 59.1%" in sel.note
    assert "min_saving_fraction=0.6" in sel.note
    assert plan("memory", fg, min_saving_fraction=0.59).checkpoint_ids
    with pytest.raises(ValueError, match="min_saving_fraction"):
        plan("memory", fg, min_saving_fraction=1.0)


def test_memory_without_articulation_points_keeps_the_tensors_crossing_cuts():
    # Two parallel branches from one op, joined at the y: every op is
    # bypassed, no articulation point. Cuts of the topological order cross
    # one tensor of each branch; keeping both recomputes the branches
    # segment by segment, each op once.
    b = Builder()
    x = b.source("x")
    p = q = b.op("root", "MatMul", [x])
    for i in range(8):
        p = b.op(f"p{i}", "Tanh", [p])
        q = b.op(f"q{i}", "Relu", [q])
    y = b.op("join", "AddV2", [p, q])
    fg = b.build(["x"], [y])
    assert articulation_candidates(fg) == []
    sel = candidate(fg)
    assert sel.checkpoint_ids
    assert set(sel.reason_of.values()) == {candidates.CUT_REASON}
    # kept in pairs: a cut after p_i crosses q_{i-1} and p_i
    costs = estimate_costs(fg)
    cuts = {c.crossing for c in topological_cuts(fg, costs)}
    assert set(sel.checkpoint_ids) <= {t for c in cuts for t in c}
    schedule = build_schedule(fg, sel.checkpoint_ids)
    copied = [o for s in schedule.steps for o in s.ops]
    assert len(copied) == len(set(copied))  # no op recomputed twice
    plain = simulate(fg, None, costs, model=MemoryModel(allocator=BFC), timeline=False).peak_bytes
    assert simulate(fg, schedule, costs, model=MemoryModel(allocator=BFC), timeline=False).peak_bytes < 0.7 * plain


def test_memory_with_nothing_to_keep_says_why():
    # One op between x and y: no activation to keep.
    b = Builder()
    y = b.op("only", "Tanh", [b.source("x")])
    sel = plan("memory", b.build(["x"], [y]))
    assert sel.checkpoint_ids == ()
    assert "no tensor cuts the forward graph" in sel.note


# -- topological cuts -----------------------------------------------------------


def test_topological_cuts_of_the_unet_graph():
    # After e2, e3, mid the long and short skips are both open (2-3 MiB
    # cross); the local minima are after stem, e1 (1 MiB), d2 (e1 and d2)
    # and d1. After `out` the next op is the y, whose cut crosses nothing.
    fg = H.unet()
    cuts = topological_cuts(fg, estimate_costs(fg))
    assert [(fg.ops[c.position].name, names(fg, c.crossing), c.crossing_bytes) for c in cuts] == [
        ("stem", ["stem:0"], MiB),
        ("e1", ["e1:0"], MiB),
        ("d2", ["e1:0", "d2:0"], 2 * MiB),
        ("d1", ["d1:0"], MiB),
    ]


def _dense_block(layers: int):
    """DenseNet-like: layer i convolves the concatenation of the stem and every earlier layer."""
    b = Builder()
    x = b.source("x")
    feats = [b.op("stem", "Conv2D", [x])]
    for i in range(layers):
        cat = (feats[0] if i == 0 else
               b.op(f"cat{i}", "ConcatV2", list(feats), size_bytes=len(feats) * MiB))
        feats.append(b.op(f"c{i}", "Conv2D", [cat]))
    out = b.op("out", "ConcatV2", list(feats), size_bytes=len(feats) * MiB)
    y = b.op("y", "Mean", [out], size_bytes=4)
    return b, b.build(["x"], [y])


def test_topological_cuts_of_a_dense_block():
    # Crossing MiB after stem 1, c0 2, cat1 4, c1 3, cat2 6, c2 4, out 4:
    # a concatenation dies at the conv that reads it, so the cuts after the
    # convs cross only the (small) features, and the big concatenations
    # are recomputed: the memory-efficient DenseNet trick.
    b, fg = _dense_block(3)
    cuts = topological_cuts(fg, estimate_costs(fg))
    assert [(fg.ops[c.position].name, names(fg, c.crossing), c.crossing_bytes) for c in cuts] == [
        ("stem", ["stem:0"], MiB),
        ("c1", ["stem:0", "c0:0", "c1:0"], 3 * MiB),
        ("c2", ["stem:0", "c0:0", "c1:0", "c2:0"], 4 * MiB),
    ]


def test_memory_on_a_dense_block_keeps_features_and_recomputes_concatenations():
    b, fg = _dense_block(8)
    assert names(fg, articulation_candidates(fg)) == ["out:0"]  # the head only
    sel = candidate(fg)
    assert sel.checkpoint_ids and set(sel.reason_of.values()) == {candidates.CUT_REASON}
    kept_types = {fg.ops[fg.tensors[t].producer].type for t in sel.checkpoint_ids}
    assert kept_types == {"Conv2D"}  # features, never a concatenation
    costs = estimate_costs(fg)
    plain = simulate(fg, None, costs, model=MemoryModel(allocator=BFC), timeline=False).peak_bytes
    peak = simulate(fg, build_schedule(fg, sel.checkpoint_ids), costs, model=MemoryModel(allocator=BFC),
                    timeline=False).peak_bytes
    assert peak < 0.71 * plain  # 0.708


def _inception(blocks: int):
    """Inception-like: per block three branches from its input, concatenated."""
    b = Builder()
    h = b.op("stem", "Conv2D", [b.source("x")])
    for k in range(blocks):
        b1 = b.op(f"b{k}_1x1", "Conv2D", [h])
        b2 = b.op(f"b{k}_3x3", "Conv2D", [b.op(f"b{k}_3x3r", "Conv2D", [h])])
        b3 = b.op(f"b{k}_5x5", "Conv2D", [b.op(f"b{k}_5x5r", "Conv2D", [h])])
        h = b.op(f"b{k}_cat", "ConcatV2", [b1, b2, b3], size_bytes=3 * MiB)
    y = b.op("y", "Mean", [h], size_bytes=4)
    return b.build(["x"], [y])


def test_memory_on_inception_blocks_saves():
    # The concatenations are articulation points; of the plans over them and
    # over topological cuts, keeping two of six blocks' outputs (b1, b3)
    # gives the lowest peak, and so does keeping b4 as well, which recomputes
    # less: the candidate 'memory' starts from.
    fg = _inception(6)
    costs = estimate_costs(fg)
    sel = candidate(fg)
    assert names(fg, sel.checkpoint_ids) == ["b1_cat:0", "b3_cat:0", "b4_cat:0"]
    plain = simulate(fg, None, costs, model=MemoryModel(allocator=BFC), timeline=False).peak_bytes
    peak = simulate(fg, build_schedule(fg, sel.checkpoint_ids), costs, model=MemoryModel(allocator=BFC),
                    timeline=False).peak_bytes
    assert peak < 0.65 * plain  # 0.643


def _brute_force_cuts(fg, costs):
    """Every position's crossing activations by definition; keep the local minima."""
    keep = set(candidates.keepable(fg))
    crossing = []
    for i in range(len(fg.ops)):
        ts = sorted(
            t for t in keep
            if fg.tensors[t].producer <= i
            and any(i < op.index and t in op.inputs for op in fg.ops)
        )
        crossing.append((ts, sum(costs.tensor_bytes[t] for t in ts)))
    out = []
    for i, (ts, nbytes) in enumerate(crossing):
        left = crossing[i - 1][1] if i else math.inf
        right = crossing[i + 1][1] if i + 1 < len(crossing) else math.inf
        if fg.ops[i].recomputable and ts and nbytes <= left and nbytes <= right:
            out.append((i, tuple(ts), nbytes))
    return out


def test_branches_that_start_at_an_x_can_each_be_cut():
    # Same, but the branches read x itself: x is always kept, so a branch
    # can be recomputed from x and keeping p1 cuts p0, p1 off the rest.
    b = Builder()
    p = q = b.source("x")
    for i in range(4):
        p = b.op(f"p{i}", "Tanh", [p])
        q = b.op(f"q{i}", "Relu", [q])
    y = b.op("join", "AddV2", [p, q])
    fg = b.build(["x"], [y])
    assert names(fg, articulation_candidates(fg)) == [
        "p1:0", "q1:0", "p2:0", "q2:0", "p3:0", "q3:0",
    ]


# -- registry ------------------------------------------------------------------


def test_builtin_strategies_are_registered():
    assert {"collection", "memory", "speed"} <= set(strategies.available())
    assert strategies.available() == sorted(strategies.available())
    assert planners.get("memory") is memsave.planners.strategies.memory


@pytest.mark.parametrize("bad", ["nope", "Memory", "", None, ["memory"]])
def test_unknown_strategy_raises_and_lists_known_names(bad):
    with pytest.raises(memsave.UnknownStrategyError) as info:
        strategies.get(bad)
    msg = str(info.value)
    for known in ("'collection'", "'memory'", "'speed'"):
        assert known in msg
    assert repr(bad) in msg
    # Code written against tf.gradients catches ValueError for bad arguments.
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, memsave.MemsaveError)


def test_register_custom_strategy(registry):
    @strategies.register("every_other")
    def every_other(fg, *, start=0):
        inner = [t for op in fg.ops for t in op.outputs if t not in fg.ys]
        chosen = inner[start::2]
        return Selection(tuple(chosen), {t: "every other" for t in chosen})

    assert "every_other" in strategies.available()
    fg = H.chain(6)
    assert strategies.get("every_other") is every_other
    assert names(fg, plan("every_other", fg).checkpoint_ids) == [
        "op0:0", "op2:0", "op4:0",
    ]
    assert names(fg, plan("every_other", fg, start=1).checkpoint_ids) == [
        "op1:0", "op3:0",
    ]


def test_register_duplicate_name_raises(registry):
    @strategies.register("mine")
    def mine(fg):
        return Selection((), {})

    with pytest.raises(ValueError, match="'mine' is registered already"):
        strategies.register("mine")(mine)
    with pytest.raises(ValueError, match="'memory' is registered already"):
        strategies.register("memory")(mine)
    assert planners.get("memory") is memsave.planners.strategies.memory
    assert strategies.get("mine") is mine


def test_unregister_removes_and_unknown_names_raise(registry):
    @strategies.register("gone")
    def gone(fg):
        return Selection((), {})

    assert strategies.unregister("gone") is gone
    assert "gone" not in strategies.available()
    with pytest.raises(memsave.UnknownStrategyError, match="'gone' is not registered"):
        strategies.unregister("gone")


def test_registry_fixture_restores_the_registry():
    # Runs after the register tests (file order): nothing leaked.
    assert "every_other" not in strategies.available()
    assert "mine" not in strategies.available()


# -- articulation search against brute force on random DAGs -----------------------


def _random_dag(seed: int):
    rs = np.random.RandomState(seed)
    b = Builder()
    live = [b.source("x0"), b.source("x1")]
    for i in range(int(rs.randint(6, 30))):
        k = 1 + rs.binomial(2, 0.3)
        # Mostly read recent tensors (long chains), sometimes far back (skips).
        picks = {len(live) - 1 - min(int(rs.geometric(0.5)) - 1, len(live) - 1) for _ in range(k)}
        live.append(b.op(f"op{i}", "Op", [live[j] for j in sorted(picks)],
                         recomputable=rs.rand() > 0.1))
    consumed = {t for op in b.ops for t in op.inputs}
    ys = [n for n in live[2:] if b.ids[n] not in consumed]
    return b.build(["x0", "x1"], ys)


def _brute_force_candidates(fg) -> list[int]:
    """Remove each op; keep it if some start of its piece no longer reaches the piece's end.

    Starts: ops reading an x or an external tensor and no recomputable op's
    output, else the piece's first op; end: the node joined to the ys, else
    the piece's last op (the rules of ``candidates._piece_ends``).
    """
    g = nx.Graph()
    g.add_node("sink")
    rec = [op.index for op in fg.ops if op.recomputable]
    g.add_nodes_from(rec)
    for op in fg.ops:
        if not op.recomputable:
            continue
        for t in op.inputs:
            p = fg.tensors[t].producer
            if p is not None and fg.ops[p].recomputable:
                g.add_edge(p, op.index)
    for y in fg.ys:
        p = fg.tensors[y].producer
        if fg.ops[p].recomputable:
            g.add_edge(p, "sink")

    def enters(i):
        inputs = [fg.tensors[t] for t in fg.ops[i].inputs]
        return any(n.producer is None and not n.constant for n in inputs) and not any(
            n.producer is not None and fg.ops[n.producer].recomputable for n in inputs
        )

    ends = {}
    for piece in nx.connected_components(g):
        ops = sorted(v for v in piece if v != "sink")
        if ops:
            starts = [i for i in ops if enters(i)] or ops[:1]
            end = "sink" if "sink" in piece else ops[-1]
            for v in ops:
                ends[v] = (starts, end)
    used = {t for op in fg.ops for t in op.inputs}
    out = []
    for i in rec:
        starts, end = ends[i]
        h = g.copy()
        h.remove_node(i)
        if i != end and any(s != i and not nx.has_path(h, s, end) for s in starts):
            outs = [
                t for t in fg.ops[i].outputs
                if fg.tensors[t].trainable and t in used and t not in fg.ys
            ]
            if len(outs) == 1:
                out.append(outs[0])
    return out


@pytest.mark.parametrize("seed", range(30))
def test_articulation_candidates_match_brute_force_on_random_dags(seed):
    fg = _random_dag(seed)
    assert articulation_candidates(fg) == _brute_force_candidates(fg)
    sel = plan("memory", fg)
    assert list(sel.checkpoint_ids) == sorted(sel.checkpoint_ids)
    assert set(sel.checkpoint_ids) <= set(articulation_candidates(fg)) | _cut_tensors(fg)


@pytest.mark.parametrize("seed", range(30))
def test_topological_cuts_match_brute_force_on_random_dags(seed):
    fg = _random_dag(seed)
    costs = estimate_costs(fg)
    got = [(c.position, c.crossing, c.crossing_bytes) for c in topological_cuts(fg, costs)]
    assert got == _brute_force_cuts(fg, costs)


def _chain_with_scalar_bypass(n=8):
    """x -> op0 .. op{n-1}; aux = sum(op0) (4 bytes) added to the loss at the end."""
    b = Builder()
    h = b.source("x")
    first = None
    for i in range(n):
        h = b.op(f"op{i}", "Tanh", [h])
        first = first or h
    aux = b.op("aux", "Sum", [first], size_bytes=4)
    main = b.op("main", "Sum", [h], size_bytes=4)
    y = b.op("loss", "AddV2", [main, aux], size_bytes=4)
    return b.build(["x"], [y])


def test_a_scalar_bypass_does_not_hide_the_articulation_points():
    fg = _chain_with_scalar_bypass()
    cands = names(fg, articulation_candidates(fg))
    assert {"op2:0", "op3:0", "op4:0", "op5:0"} <= set(cands)
    # Counting the 4-byte edge as a tie, the bypass spans the chain.
    assert all(
        n not in names(fg, articulation_candidates(fg, small_tensor_fraction=0.0))
        for n in ("op2:0", "op3:0", "op4:0", "op5:0")
    )


def test_the_schedule_keeps_what_a_scalar_bypass_needs():
    fg = _chain_with_scalar_bypass()
    sel = plan("memory", fg)
    assert sel.checkpoint_ids
    sched = build_schedule(fg, sel.checkpoint_ids)
    # op0 feeds both the main chain and the scalar: kept rather than
    # recomputed by two steps, so no op is copied twice.
    assert "op0:0" in names(fg, sched.kept)
    copied = [o for s in sched.steps if s.kind == "recompute" for o in s.ops]
    assert len(copied) == len(set(copied))


def test_speed_drops_a_plan_that_saves_too_little_and_says_so():
    # A 256-byte MatMul output at the end of a long tanh chain (an LSTM's
    # projection after its loop, say): keeping it saves 256 bytes and costs
    # recomputing the whole chain.
    b = Builder()
    h = b.source("x")
    for i in range(12):
        h = b.op(f"a{i}", "Tanh", [h])
    h = b.op("proj", "MatMul", [h], size_bytes=256)
    y = b.op("out", "Tanh", [h], size_bytes=256)
    fg = b.build(["x"], [y])
    rule = strategies.EXPENSIVE_OP_TYPES
    sel = plan("speed", fg, op_types=rule)
    assert sel.checkpoint_ids == ()
    assert "'speed''s plan (1 checkpoints)" in sel.note and "min_saving_fraction" in sel.note
    assert "checkpoints='memory'" in sel.note
    assert names(fg, plan("speed", fg, op_types=rule, min_saving_fraction=0.0).checkpoint_ids) \
        == ["proj:0"]


@pytest.mark.parametrize("seed", range(12))
def test_the_floor_bounds_every_plan_and_the_shortcut_loses_no_plan(seed):
    # Problem.floor (inputs, variables, the xs' gradients) is below every
    # plan's forecast peak; when it leaves plain tf.gradients no room to save
    # min_saving_fraction, 'memory' keeps nothing without simulating its
    # plans, and indeed none of them would have been kept.
    import random

    from memsave.planners.strategies import MIN_SAVING_FRACTION, can_save

    rs = random.Random(seed)
    for fg in (H.random_chain(rs, 40), H.random_dag(rs, 40), _weights_heavy_chain(rs)):
        problem = Problem(fg)
        judge = problem.judge
        floor = problem.floor(model=judge)
        base = problem.forecast(None, model=judge)
        assert floor <= base.peak_bytes
        peaks = [problem.peak(problem.schedule(c), model=judge) for c in problem.memory_plans()]
        assert all(floor <= p for p in peaks)
        if can_save(problem, min_saving_fraction=MIN_SAVING_FRACTION):
            working = base.peak_bytes - base.resident_bytes
            assert all((base.peak_bytes - p) / working < MIN_SAVING_FRACTION for p in peaks)
            assert plan("memory", fg).checkpoint_ids == ()


def test_weights_that_make_the_peak_leave_nothing_to_save():
    import random

    from memsave.planners.strategies import can_save

    problem = Problem(_weights_heavy_chain(random.Random(0)))
    assert "no plan can save" in can_save(problem, min_saving_fraction=0.1)
    p = planners.run("memory", problem)
    assert p.checkpoint_ids == () and "the xs' gradients" in p.note
    assert problem.simulations == 1  # plain tf.gradients only: no plan was simulated
    assert can_save(Problem(H.chain(36)), min_saving_fraction=0.1) == ""


def _weights_heavy_chain(rs, n=30):
    """A chain of matmuls whose weights (the xs) outweigh the activations."""
    b = Builder()
    h = b.external("data", size_bytes=MiB // 64)
    for i in range(n):
        w = b.source(f"w{i}", size_bytes=MiB)
        h = b.op(f"mm{i}", "MatMul", [h, w], size_bytes=MiB // 64)
        h = b.op(f"t{i}", "Tanh", [h], size_bytes=MiB // 64)
    return b.build([f"w{i}" for i in range(n)], [h])


# -- the presets with the time model (issue 19) -----------------------------------


def test_speed_is_the_fastest_plan_under_its_generous_budget():
    # 'speed' = the budget solvers at SPEED_BUDGET_FRACTION of the plain peak
    # (every byte counted): within it, and exactly the plan they give; a
    # larger fraction never makes it slower.
    import random

    from memsave.planners import budget as B
    from memsave.planners.strategies import SPEED_BUDGET_FRACTION

    fg = H.conv_chain(random.Random(2), 24)
    problem = Problem(fg)
    sel = planners.run("speed", problem)
    judge = problem.judge
    assert sel.schedule is not None and sel.strategy == "speed" and sel.budget is None
    assert problem.peak(sel.schedule, model=judge) <= SPEED_BUDGET_FRACTION * problem.peak(
        None, model=judge)
    ref = B.solve(Problem(fg), SPEED_BUDGET_FRACTION, model=Problem(fg).judge)
    assert sel.step_seconds == pytest.approx(ref.step_seconds, rel=1e-12)
    assert sel.recompute_seconds > 0 and 1.0 < sel.step_time_ratio < 1.5
    assert not any(why.startswith("budget") for why in sel.reason_of.values())
    steps = [planners.run("speed", Problem(fg), options={"budget_fraction": f}).step_seconds
             for f in (0.6, 0.75, 0.9)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]


def test_speed_with_an_infeasible_budget_keeps_nothing_and_says_why():
    import random

    sel = plan("speed", H.conv_chain(random.Random(2), 24), budget_fraction=0.05)
    assert sel.schedule is None and sel.checkpoint_ids == ()
    assert "budget_fraction=0.05" in sel.note and "smallest" in sel.note
    with pytest.raises(memsave.OptionsError, match="budget_fraction"):
        plan("speed", H.chain(8), budget_fraction=1.5)


def test_memory_trades_a_peak_within_its_tolerance_for_time():
    # With peak_tolerance=0 'memory' keeps the lowest candidate peak; 10%
    # more peak buys a faster plan here (it stores segments the peak leaves
    # room for), and the forecast peak stays within the tolerance.
    import random

    from memsave.planners.strategies import candidate_plan

    fg = H.conv_chain(random.Random(2), 24)
    exact = planners.run("memory", Problem(fg), options={"peak_tolerance": 0.0})
    loose = planners.run("memory", Problem(fg), options={"peak_tolerance": 0.1})
    problem = loose.problem
    _, lowest, _ = candidate_plan(problem, peak_tolerance=0.0)
    judge = problem.judge
    assert exact.problem.peak(exact.schedule, model=judge) == lowest
    assert lowest < problem.peak(loose.schedule, model=judge) <= int(1.1 * lowest)
    assert loose.step_seconds < exact.step_seconds
    assert loose.schedule.in_place  # what bought the time: stored segments
    with pytest.raises(memsave.OptionsError, match="peak_tolerance"):
        plan("memory", fg, peak_tolerance=1.0)


def test_the_plan_reports_forecast_seconds_beside_flops():
    fg = H.chain(16)
    sel = plan("memory", fg)
    problem = sel.problem
    st = problem.step_time(sel.schedule)
    assert sel.recompute_seconds == pytest.approx(st.recompute_s + st.rewrite_s)
    assert sel.step_time_ratio == pytest.approx(st.total_s / problem.step_time(None).total_s)
    assert sel.baseline_step_seconds == problem.step_time(None).total_s
    assert sel.recompute_cost == problem.costs.recompute_flops(sel.schedule)
    d = sel.to_dict()
    assert d["recompute_seconds"] == sel.recompute_seconds
    assert d["step_time_ratio"] == sel.step_time_ratio
    assert "forecast step" in sel.summary()


def test_the_device_profile_is_a_value_of_the_problem():
    # Planning reads the problem's profile (the default one unless given):
    # a device whose memory is ten times slower makes the same plan's
    # recomputation slower, and nothing global changes.
    from memsave.timemodel import CPU_DEFAULT

    fg = H.chain(16)
    default = Problem(fg)
    slow = Problem(fg, profile=CPU_DEFAULT.replace(bytes_per_s=CPU_DEFAULT.bytes_per_s / 10))
    assert default.profile is CPU_DEFAULT
    sched = default.schedule(default.keepable()[::4])
    assert slow.step_time(slow.schedule(default.keepable()[::4])).recompute_s > \
        default.step_time(sched).recompute_s
    assert Problem(fg).profile is CPU_DEFAULT
    with pytest.raises(ValueError, match="profile"):
        Problem(fg, profile="fast")
