"""Checkpoint selection strategies (no TensorFlow).

A strategy is a function ``(fg: ForwardGraph, **options) -> Selection`` that
picks tensors of the forward graph to keep. Strategies are registered by
name with :func:`register`; ``memsave.gradients(checkpoints="memory")`` looks
the name up with :func:`get`. An unknown name raises
:class:`~memsave.errors.UnknownStrategyError` listing the known ones.

Every strategy returns internal tensors produced by recomputable ops that are
not ys; outputs of stateful ops and the xs are kept anyway and are not listed.

Memory is judged by one model only, :func:`memsave.simulate.simulate`: the
automatic strategies (``'memory'``, ``'speed'``) keep a plan only when the
simulator predicts it saves at least ``min_saving_fraction`` of the step's
working memory (:func:`judge`), and say by how much when it does not.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterable

import networkx as nx

from memsave.costs import Costs, estimate_costs, is_activation
from memsave.errors import UnknownStrategyError
from memsave.graph import ForwardGraph
from memsave.schedule import build_schedule
from memsave.simulate import BFC, Allocator, MemoryTrace, forward_program, paused_gc, simulate

#: The allocator model plans are compared with: every byte counts. (oneDNN's
#: CPU allocator leaves buffers under 256 KiB out of the peak it *reports*,
#: but they use memory all the same; the Plan's forecast of the reported peak
#: uses the device's model, :func:`memsave.gradients.plan`.)
JUDGE_ALLOCATOR: Allocator = BFC

__all__ = [
    "Selection",
    "Strategy",
    "register",
    "unregister",
    "get",
    "available",
    "collection",
    "memory",
    "speed",
    "judge",
    "articulation_candidates",
    "topological_cuts",
    "Cut",
    "spread",
    "EXPENSIVE_OP_TYPES",
    "MIN_SAVING_FRACTION",
]

#: Op types whose outputs ``'speed'`` keeps: convolutions of every kind and
#: matrix products, the ops that dominate a forward pass, so that what is
#: recomputed is only the cheap elementwise work between them.
EXPENSIVE_OP_TYPES = frozenset(
    {
        "Conv",
        "Conv2D",
        "Conv3D",
        "Conv2DBackpropInput",
        "Conv3DBackpropInputV2",
        "DepthwiseConv2dNative",
        "MatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "Einsum",
    }
)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Tensors a strategy chose, and why.

    Attributes
    ----------
    checkpoints : tuple of int
        Tensor ids, in topological order.
    reasons : dict of int to str
        Why each tensor was chosen (``"tagged"``, ``"articulation point"``,
        ``"output of MatMul"``, ...).
    note : str
        Empty, or what the user should know (e.g. nothing was found, and why).
    """

    checkpoints: tuple[int, ...]
    reasons: dict[int, str]
    note: str = ""


def judge(
    fg: ForwardGraph,
    selection: Selection,
    costs: Costs,
    *,
    min_saving_fraction: float,
    who: str,
    baseline: MemoryTrace | None = None,
    predicted_bytes: int | None = None,
) -> Selection:
    """``selection``, or an empty one when it saves too little.

    The saving is ``baseline - predicted`` peak (both from the simulator) as a
    fraction of the baseline's working memory (its peak minus the resident
    variables and inputs, which no plan can free). Under
    ``min_saving_fraction`` the plan would pay recomputation for a saving
    within the forecast's error: nothing is kept, and the note gives the
    figures. ``baseline`` (the plain trace) and ``predicted_bytes`` (the plan's
    peak) skip simulations the caller has already run.
    """
    if not 0.0 <= min_saving_fraction < 1.0:
        raise ValueError(
            f"memsave: min_saving_fraction must be in [0, 1), got {min_saving_fraction}"
        )
    if not selection.checkpoints or min_saving_fraction == 0.0:
        return selection  # 0 keeps any plan
    base = baseline if baseline is not None else simulate(
        fg, None, costs, timeline=False, allocator=JUDGE_ALLOCATOR)
    if predicted_bytes is None:
        predicted_bytes = simulate(
            fg, build_schedule(fg, selection.checkpoints), costs, timeline=False,
            allocator=JUDGE_ALLOCATOR).peak_bytes
    working = max(base.peak_bytes - base.resident_bytes, 1)
    saving = (base.peak_bytes - predicted_bytes) / working
    if saving >= min_saving_fraction:
        return selection
    return Selection((), {}, (
        f"{who}'s plan ({len(selection.checkpoints)} checkpoints) would take the predicted "
        f"peak (every buffer counted) from {base.peak_bytes:,} to {predicted_bytes:,} bytes, a saving "
        f"of {saving:.1%} of the {working:,} bytes of working memory (less than "
        f"min_saving_fraction={min_saving_fraction:g}), so recomputing would cost time for "
        "next to nothing; "
        + (_CHOOSE_YOURSELF if who != "'speed'"
           else _CHOOSE_YOURSELF.replace("checkpoints='speed'", "checkpoints='memory'"))
    ))


Strategy = Callable[..., Selection]

_REGISTRY: dict[str, Strategy] = {}


def register(name: str) -> Callable[[Strategy], Strategy]:
    """Register a strategy under ``name`` (a decorator)."""

    def deco(fn: Strategy) -> Strategy:
        if name in _REGISTRY:
            raise ValueError(f"memsave.strategies.register: {name!r} is registered already")
        _REGISTRY[name] = fn
        return fn

    return deco


def unregister(name: str) -> Strategy:
    """Remove the strategy registered under ``name`` and return it.

    Built-in strategies can be removed too (and registered again).
    """
    try:
        return _REGISTRY.pop(name)
    except KeyError:
        raise UnknownStrategyError(
            f"memsave.strategies.unregister: {name!r} is not registered; registered: "
            f"{sorted(_REGISTRY)}"
        ) from None


def get(name: str) -> Strategy:
    """The strategy registered under ``name``."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownStrategyError(
            f"memsave.gradients: checkpoints={name!r} is not a known strategy; "
            f"use one of {sorted(_REGISTRY)} or pass a list of tensors"
        ) from None


def available() -> list[str]:
    """Names of the registered strategies."""
    return sorted(_REGISTRY)


def _candidates(fg: ForwardGraph) -> Iterable[int]:
    """Tensors a strategy may choose: internal, recomputable, differentiable, not ys."""
    ys = set(fg.ys)
    for op in fg.ops:
        for t in op.outputs:
            # size 0: a handle or a TensorList, whose real size is unknown here.
            if is_activation(fg, t) and fg.tensors[t].size_bytes > 0 and t not in ys:
                yield t


def _selection(fg: ForwardGraph, chosen: Iterable[int], reason: Callable[[int], str], note: str = "") -> Selection:
    ids = tuple(sorted(set(chosen)))
    return Selection(ids, {t: reason(t) for t in ids}, note)


@register("collection")
def collection(fg: ForwardGraph) -> Selection:
    """Keep the tensors the user added to the ``'checkpoints'`` collection.

    Tagged tensors that are not between the xs and the ys are not part of
    ``fg`` and so are ignored: a collection is shared by every gradient
    computation in the graph.
    """
    chosen = [t for t in _candidates(fg) if fg.tensors[t].tagged]
    note = "" if chosen else (
        "the 'checkpoints' collection holds no tensor between xs and ys; add some with "
        "tf.compat.v1.add_to_collection('checkpoints', t) or use checkpoints='memory'"
    )
    return _selection(fg, chosen, lambda t: "tagged", note)


@register("speed")
def speed(
    fg: ForwardGraph,
    *,
    op_types: frozenset[str] = EXPENSIVE_OP_TYPES,
    costs: Costs | None = None,
    min_saving_fraction: float | None = None,
) -> Selection:
    """Keep the outputs of expensive ops (:data:`EXPENSIVE_OP_TYPES`).

    Recomputation then redoes only the cheap ops between them, so the extra
    time is small; memory drops by what those cheap ops produced. Like every
    automatic strategy, the plan is dropped when the simulator predicts it
    saves under ``min_saving_fraction`` (:func:`judge`; default
    :data:`MIN_SAVING_FRACTION`).
    """
    chosen = [t for t in _candidates(fg) if fg.ops[fg.tensors[t].producer].type in op_types]
    note = "" if chosen else (
        f"no output of {sorted(op_types)} lies between xs and ys; use checkpoints='memory'"
    )
    sel = _selection(fg, chosen, lambda t: f"output of {fg.ops[fg.tensors[t].producer].type}", note)
    return judge(
        fg, sel, costs if costs is not None else estimate_costs(fg),
        min_saving_fraction=MIN_SAVING_FRACTION if min_saving_fraction is None else min_saving_fraction,
        who="'speed'",
    )


#: A differentiable tensor with a fully known size at most this fraction of
#: the largest activation (a scalar auxiliary loss on the first layer) does
#: not tie the graph together in the articulation search; nor does any
#: non-differentiable one (a ``tf.shape`` of an early activation read at the
#: end). Either would otherwise bypass every candidate and leave nothing to
#: keep; the schedule keeps what such a bypass needs. Sizes count unknown
#: dimensions as 1, so "largest" is per example when the batch is dynamic.
#: Override with ``small_tensor_fraction=``.
SMALL_TENSOR_FRACTION = 1 / 64


def articulation_candidates(
    fg: ForwardGraph, *, small_tensor_fraction: float = SMALL_TENSOR_FRACTION
) -> list[int]:
    """Tensors that separate the start of the forward graph from its end.

    Build an undirected graph of the recomputable ops (edges where a
    differentiable tensor flows, leaving out tensors smaller than
    ``small_tensor_fraction`` of the largest activation), plus one node
    joined to the producers of the ys. It falls into connected pieces; in
    each, :func:`_piece_ends` names where the forward pass enters (its
    starts) and where it leaves (its end). An op is a cut when removing it
    separates a start of its piece from the piece's end: a cut vertex on the
    path between them in the block-cut tree. Its output is a candidate when
    it is the op's only differentiable output consumed in the forward graph:
    keeping it then lets everything after it be recomputed without anything
    before it.

    A cut vertex off those paths is not a candidate: it only cuts off a side
    branch that rejoins the rest through small tensors (a normalisation's
    statistics: ``Mean`` of ``SquaredDifference``, then channel-sized ops),
    so keeping it bounds no segment.

    Notes
    -----
    Biconnected components are found with Hopcroft-Tarjan's depth-first
    search (``networkx.biconnected_components``); building the block-cut
    tree and walking its paths is linear too, so the whole is linear in ops
    plus edges.
    """
    largest = max(
        (fg.tensors[t].size_bytes for op in fg.ops for t in op.outputs if is_activation(fg, t)),
        default=0,
    )
    small = largest * small_tensor_fraction

    def ties(t: int) -> bool:
        node = fg.tensors[t]
        return node.trainable and not (node.size_known and node.size_bytes <= small)

    g = nx.Graph()
    sink = -1
    g.add_node(sink)
    for op in fg.ops:
        if not op.recomputable:
            continue
        g.add_node(op.index)
        for t in op.inputs:
            p = fg.tensors[t].producer
            if p is not None and fg.ops[p].recomputable and ties(t):
                g.add_edge(p, op.index)
    for y in fg.ys:
        p = fg.tensors[y].producer
        if p is not None and fg.ops[p].recomputable:
            g.add_edge(p, sink)

    # Block-cut tree: a node per biconnected component ("block", keyed by
    # ("block", k)) and per cut vertex, joined when the vertex is in the block.
    tree = nx.Graph()
    home: dict[int, object] = {}  # op -> its tree node (itself if a cut vertex)
    cuts = set(nx.articulation_points(g))
    tree.add_nodes_from(cuts)
    for k, block in enumerate(nx.biconnected_components(g)):
        b = ("block", k)
        tree.add_node(b)
        for v in block:
            if v in cuts:
                tree.add_edge(b, v)
            else:
                home[v] = b
    for v in cuts:
        home[v] = v

    on_path: set[int] = set()
    for starts, end in _piece_ends(fg, g, sink):
        parent = nx.predecessor(tree, home[end])  # BFS tree rooted at the end
        seen = {home[end]}
        for s in starts:
            n = home[s]
            if n == s and n not in seen:  # a start that is a cut vertex: not on its own path
                n = parent[n][0]
            while n not in seen:  # walk toward the end until a path already walked
                seen.add(n)
                if n in cuts:
                    on_path.add(n)
                n = parent[n][0]

    consumers = fg.consumers()
    ys = set(fg.ys)
    out = []
    for i in sorted(on_path):
        used = [
            t
            for t in fg.ops[i].outputs
            if fg.tensors[t].trainable and consumers[t] and t not in ys
        ]
        if len(used) == 1:
            out.append(used[0])
    return out


def _piece_ends(fg: ForwardGraph, g: nx.Graph, sink: int) -> Iterable[tuple[list[int], int]]:
    """``(starts, end)`` of each connected piece of ``g`` with two or more nodes.

    The starts are the piece's ops that read an x or input data and no
    output of a recomputable op (:func:`_enters`): where the forward pass
    enters. The end is the node joined to the ys when the piece holds it.
    A piece can lack either when small tensors cut it off (the classifier
    head of a CNN, below :data:`SMALL_TENSOR_FRACTION`, cuts the loss off the
    body; ops after a stateful op read no x): its first op (topological
    order) then stands for the starts, its last op for the end.
    """
    for piece in nx.connected_components(g):
        if len(piece) < 2:
            continue
        ops = sorted(v for v in piece if v != sink)
        starts = [i for i in ops if _enters(fg, fg.ops[i])] or ops[:1]
        yield starts, (sink if sink in piece else ops[-1])


def _enters(fg: ForwardGraph, op) -> bool:
    """Whether ``op`` reads an x or input data and no recomputable op's output.

    Input data is an external tensor that is not a constant: a ``Reshape``
    of a weight read by a constant shape reads no input, and taking it for a
    start would make the op that consumes it (a ``MatMul``) a cut.
    """
    reads_input = False
    for t in op.inputs:
        node = fg.tensors[t]
        if node.producer is None:
            reads_input = reads_input or not node.constant
        elif fg.ops[node.producer].recomputable:
            return False
    return reads_input


@dataclasses.dataclass(frozen=True)
class Cut:
    """A cut of the topological order: between ``ops[position]`` and the next op.

    Attributes
    ----------
    position : int
        Index of the last op before the cut.
    crossing : tuple of int
        The activations (see :func:`_candidates`) produced at or before
        ``position`` and read after it, in id order. Keeping them all
        separates what comes before the cut from what comes after, for the
        purpose of recomputation.
    crossing_bytes : int
        Their bytes.
    """

    position: int
    crossing: tuple[int, ...]
    crossing_bytes: int


def topological_cuts(fg: ForwardGraph, costs: Costs) -> list[Cut]:
    """The cuts of the topological order whose crossing bytes are a local minimum.

    Where the graph has articulation points, they are such cuts with one
    crossing tensor; where long skips bypass everything (a U-Net, dense or
    inception blocks), a cut crosses the running activation and the skips
    still open, which the schedule keeps like any checkpoint. A cut is a
    candidate when it follows a recomputable op, crosses at least one
    activation, and its crossing bytes are no more than at the cuts just
    before and after it (plateaus count whole: every layer of a stack under
    the same skip is a candidate).

    Notes
    -----
    Two sweeps over the ops in topological order: the first keeps the set of
    activations still to be read and its bytes; the second records the
    crossing sets at the chosen positions only. Linear in ops plus edges,
    plus the total size of the recorded crossing sets.
    """
    consumers = fg.consumers()
    keepable = set(_candidates(fg))
    last_use = {t: consumers[t][-1] for t in keepable if consumers[t]}

    def sweep(record: set[int] | None):
        live: dict[int, None] = {}
        alive_bytes = 0
        for op in fg.ops:
            for t in dict.fromkeys(op.inputs):
                if last_use.get(t) == op.index and t in live:
                    del live[t]
                    alive_bytes -= costs.tensor_bytes[t]
            for t in op.outputs:
                if t in last_use and last_use[t] > op.index:
                    live[t] = None
                    alive_bytes += costs.tensor_bytes[t]
            if record is None:
                yield alive_bytes
            elif op.index in record:
                ids = tuple(sorted(live))
                yield Cut(op.index, ids, alive_bytes)

    profile = list(sweep(None))
    n = len(profile)
    chosen = {
        i for i in range(n)
        if fg.ops[i].recomputable and profile[i] > 0
        and (i == 0 or profile[i] <= profile[i - 1])
        and (i + 1 == n or profile[i] <= profile[i + 1])
    }
    return [c for c in sweep(chosen) if c.crossing]


#: Fraction of a segment's activation bytes assumed alive at once while it
#: is recomputed, used only to *generate* candidate plans (each is then
#: judged by the simulator). A gradient usually needs one tensor of each
#: elementwise pair (tanh's output, not its input), so about half. Override
#: with ``segment_live_fraction=``.
SEGMENT_LIVE_FRACTION = 0.5

#: Further live fractions tried when generating candidates for ``'memory'``;
#: the simulator picks the best of all of them.
CANDIDATE_LIVE_FRACTIONS = (0.25, 1.0)

#: Smallest fraction of the step's predicted working memory (plain peak minus
#: resident variables and inputs, both from :func:`memsave.simulate.simulate`)
#: that an automatic strategy's plan must save to be used. Recomputation
#: costs up to a forward pass; a plan predicted to save less than this pays
#: that for a saving within the forecast's error, so the strategy keeps
#: nothing and memsave falls back to tf.gradients with a warning. Measured: a
#: U-Net-36 plan predicted 3% and saved 1-5% for 1.3x step time. Override
#: with ``min_saving_fraction=`` (0 keeps any plan).
MIN_SAVING_FRACTION = 0.1

#: What to do when ``'memory'`` finds nothing worth keeping.
_CHOOSE_YOURSELF = (
    "pass checkpoints as a list of tensors, tag them with "
    "tf.compat.v1.add_to_collection('checkpoints', t), or use checkpoints='speed'"
)

#: Bisection steps on the byte budget: 2**-30 of the total is far below one tensor.
_BUDGET_BISECTIONS = 30


def _greedy(pos: list[int], size: list[int], total: int, budget: float, frac: float) -> list[int] | None:
    """Fewest-risk checkpoints under ``budget``, or None if it cannot be met.

    Backprop runs the segments last to first; while segment ``m`` is
    recomputed the checkpoints before it are alive. Walking forward, each
    segment is made as long as ``alive + frac * segment_bytes <= budget``
    allows, so segments shrink toward the end where more checkpoints are
    alive (the non-uniform spacing of Griewank's schedules).
    """
    chosen: list[int] = []
    alive = 0
    start = 0
    lo = 0
    while alive + frac * (total - start) > budget:
        limit = start + (budget - alive) / frac
        i = bisect.bisect_right(pos, limit, lo) - 1
        if i < lo:
            return None
        chosen.append(i)
        alive += size[i]
        start = pos[i]
        lo = i + 1
    return chosen


def spread(pos: list[int], total: int, k: int) -> list[int]:
    """Indices of ``k`` increasing positions closest to ``j * total / (k + 1)``."""
    chosen: list[int] = []
    lo = 0
    n = len(pos)
    for j in range(1, k + 1):
        target = total * j / (k + 1)
        hi = n - (k - j)  # leave room for the checkpoints still to choose
        i = bisect.bisect_left(pos, target, lo, hi)
        if i >= hi or (i > lo and target - pos[i - 1] <= pos[i] - target):
            i -= 1
        i = max(i, lo)
        chosen.append(i)
        lo = i + 1
    return chosen


def _greedy_plan(pos, size, total, frac) -> list[int]:
    """The greedy walk under the smallest budget it can meet (bisection)."""
    lo, hi = 0.0, frac * total
    idx: list[int] = []
    for _ in range(_BUDGET_BISECTIONS):
        mid = (lo + hi) / 2
        found = _greedy(pos, size, total, mid, frac)
        if found is None:
            lo = mid
        else:
            hi, idx = mid, found
    return idx


#: Why a tensor of a cut plan is kept, when it is not an articulation point.
CUT_REASON = "crosses a cut of the topological order"

#: Live fractions (see :data:`SEGMENT_LIVE_FRACTION`) of the greedy walks
#: over topological cuts, and multiples of ``sqrt(cuts)`` for the evenly
#: spread cut plans. Each distinct plan costs one simulation; on the study's
#: U-Net, ResNet and Keras' DenseNet121/InceptionV3 the best cut plan always
#: came from these (0.25 and ``2 sqrt`` never won, and ``2 sqrt`` cost up to
#: 1.5x the best peak).
CUT_LIVE_FRACTIONS = (0.5, 1.0)
CUT_SPREADS = (0.5, 1.0)


def _positions(fg: ForwardGraph, costs: Costs) -> tuple[list[int], int]:
    """Per op, the activation bytes produced up to it (topological order); and the total."""
    cum = []
    total = 0
    for op in fg.ops:
        if op.recomputable:
            total += sum(costs.tensor_bytes[t] for t in op.outputs if is_activation(fg, t))
        cum.append(total)
    return cum, total


def _index_plans(pos: list[int], size: list[int], total: int, fracs: Iterable[float],
                 spreads: Iterable[float] = (0.5, 1.0, 2.0)) -> list[list[int]]:
    """Candidate index sets: the greedy walk per live fraction, and spreads of ``f * sqrt(k)``."""
    plans = [_greedy_plan(pos, size, total, frac) for frac in fracs]
    root = math.isqrt(len(pos))
    plans += [spread(pos, total, k) for k in dict.fromkeys(int(f * root) for f in spreads)
              if 0 < k <= len(pos)]
    return plans


def memory_plans(fg: ForwardGraph, costs: Costs, *,
                 segment_live_fraction: float = SEGMENT_LIVE_FRACTION,
                 small_tensor_fraction: float = SMALL_TENSOR_FRACTION) -> list[tuple[int, ...]]:
    """The distinct plans 'memory' weighs (tensor ids, topological order):
    over articulation points and over cuts of the topological order (see
    :func:`memory`). The ``greedy`` budget solver's family holds those its
    candidates can express, so a budget 'memory' meets is not called
    infeasible."""
    cands = articulation_candidates(fg, small_tensor_fraction=small_tensor_fraction)
    return _memory_plans(fg, costs, cands, *_positions(fg, costs), segment_live_fraction)


def _memory_plans(fg, costs, cands, cum, total, segment_live_fraction) -> list[tuple[int, ...]]:
    plans: dict[tuple[int, ...], None] = {}
    if cands:
        fracs = (segment_live_fraction, *CANDIDATE_LIVE_FRACTIONS)
        plans.update(dict.fromkeys(_articulation_plans(fg, cands, cum, total, fracs)))
    plans.update(dict.fromkeys(_cut_plans(topological_cuts(fg, costs), costs, cum, total)))
    return [c for c in plans if c]


def _articulation_plans(fg, cands, cum, total, fracs) -> list[tuple[int, ...]]:
    pos = [cum[fg.tensors[t].producer] for t in cands]
    size = [fg.tensors[t].size_bytes for t in cands]
    return [tuple(sorted(cands[i] for i in idx)) for idx in _index_plans(pos, size, total, fracs)]


def _cut_plans(cuts: list[Cut], costs: Costs, cum, total) -> list[tuple[int, ...]]:
    """Plans keeping every tensor that crosses some chosen cuts.

    The greedy walk needs the bytes each chosen cut adds; a skip crosses
    many cuts but is kept once, so two sizes are tried: a cut's whole
    crossing bytes, and the bytes of its crossing tensors that did not
    cross the cut before it (what it adds when its neighbour is chosen too).
    """
    pos = [cum[c.position] for c in cuts]
    full = [c.crossing_bytes for c in cuts]
    new = []
    prev: frozenset[int] = frozenset()
    for c in cuts:
        new.append(sum(costs.tensor_bytes[t] for t in c.crossing if t not in prev))
        prev = frozenset(c.crossing)
    plans = []
    for size in (full, new):
        for idx in _index_plans(pos, size, total, CUT_LIVE_FRACTIONS, CUT_SPREADS):
            plans.append(tuple(sorted({t for i in idx for t in cuts[i].crossing})))
    return plans


@register("memory")
def memory(
    fg: ForwardGraph,
    *,
    num_checkpoints: int | None = None,
    segment_live_fraction: float = SEGMENT_LIVE_FRACTION,
    small_tensor_fraction: float = SMALL_TENSOR_FRACTION,
    min_saving_fraction: float = MIN_SAVING_FRACTION,
    costs: Costs | None = None,
) -> Selection:
    """Keep the articulation points, or the tensors crossing cuts, that give the lowest predicted peak.

    Parameters
    ----------
    num_checkpoints : int, optional
        Keep exactly this many articulation points (fewer if there are
        fewer candidates), spread so that the segments between them hold
        about the same bytes. On a graph without articulation points, this
        many cuts of the topological order (:func:`topological_cuts`),
        spread the same way, and every tensor crossing them.
    segment_live_fraction : float
        See :data:`SEGMENT_LIVE_FRACTION` (shapes the candidate plans only).
    small_tensor_fraction : float
        See :data:`SMALL_TENSOR_FRACTION`.
    min_saving_fraction : float
        See :data:`MIN_SAVING_FRACTION`. Not applied with ``num_checkpoints``.
    costs : Costs, optional
        The cost model of ``fg`` (built here when not given).

    Notes
    -----
    Two families of candidate plans. Articulation points
    (:func:`articulation_candidates`) each cut the graph with one tensor.
    Where skips bypass every layer (a U-Net, dense and inception blocks)
    there are none, so cuts of the topological order
    (:func:`topological_cuts`) stand in: a plan keeps every activation
    crossing its chosen cuts (the running activation and the skips still
    open), and recomputes each layer once, between two cuts. Each candidate
    is placed at the cumulative bytes of the activations produced up to it
    (topological order). Plans come from a greedy walk (:func:`_greedy`:
    each segment as long as ``alive + frac * segment_bytes <= budget``
    allows, under the smallest budget found by bisection, for a few live
    fractions ``frac``) and from evenly spread sets of about ``sqrt(k)``
    candidates; the simulator (:func:`memsave.simulate.simulate`) forecasts
    each distinct plan's peak and the lowest wins (ties: the lower peak with
    each gradient freed when complete, then fewer checkpoints). Segments shrink toward the end of the graph, as in
    Griewank's schedules; a uniform chain of ``n`` equal tensors keeps about
    ``sqrt(n)``: the O(sqrt(n)) memory of Chen et al. (2016). ``O(k log n)``
    per generated plan plus one linear simulation per distinct plan (at most
    fifteen).

    References
    ----------
    T. Chen, B. Xu, C. Zhang, C. Guestrin. Training Deep Nets with Sublinear
    Memory Cost. arXiv:1604.06174, 2016.
    A. Griewank, A. Walther. Algorithm 799: revolve. ACM TOMS 26(1), 2000.
    P. Jain et al. Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization. MLSys 2020 (the "AP greedy" baseline and its
    generalisation to linearized cuts).
    """
    if not 0.0 <= min_saving_fraction < 1.0:
        raise ValueError(
            f"memsave: min_saving_fraction must be in [0, 1), got {min_saving_fraction}"
        )
    if num_checkpoints is not None and num_checkpoints < 0:
        raise ValueError(f"memsave: num_checkpoints must be >= 0, got {num_checkpoints}")
    if costs is None:
        costs = estimate_costs(fg)
    cands = articulation_candidates(fg, small_tensor_fraction=small_tensor_fraction)
    ap = set(cands)

    def reason(t: int) -> str:
        return "articulation point" if t in ap else CUT_REASON

    cum, total = _positions(fg, costs)
    if num_checkpoints is not None:
        if cands:
            pos = [cum[fg.tensors[t].producer] for t in cands]
            idx = spread(pos, total, min(num_checkpoints, len(cands)))
            return _selection(fg, [cands[i] for i in idx], reason)
        cuts = topological_cuts(fg, costs)
        idx = spread([cum[c.position] for c in cuts], total, min(num_checkpoints, len(cuts)))
        return _selection(fg, [t for i in idx for t in cuts[i].crossing], reason)

    plans = _memory_plans(fg, costs, cands, cum, total, segment_live_fraction)
    forward = forward_program(fg, costs, JUDGE_ALLOCATOR)  # shared by every plan's simulation

    def peak(schedule, gradients_kept: bool = True) -> int:
        return simulate(fg, schedule, costs, timeline=False, allocator=JUDGE_ALLOCATOR,
                        forward=forward, gradients_kept=gradients_kept).peak_bytes

    with paused_gc():  # many schedules, no cycles: see memsave.simulate.paused_gc
        scored = [(peak(schedule), chosen, schedule)
                  for chosen in plans
                  for schedule in (build_schedule(fg, chosen),)]
    best, best_peak = (), None
    if scored:
        # Lowest peak; among equal peaks (a peak set by the xs' gradients at
        # the end of the step is the same for every plan), the lowest
        # working memory, which is the step's peak when an optimizer update
        # consumes each gradient (see simulate's gradients_kept); then the
        # fewest checkpoints.
        best_peak = min(p for p, _, _ in scored)
        tied = [(c, s) for p, c, s in scored if p == best_peak]
        best = tied[0][0] if len(tied) == 1 else min(
            tied, key=lambda cs: (peak(cs[1], gradients_kept=False), len(cs[0])))[0]
    if not best:
        return Selection((), {}, (
            "no tensor cuts the forward graph in two (every activation is bypassed by "
            "another path, or all of them are inside ops that are kept anyway); "
            + _CHOOSE_YOURSELF
        ))
    sel = _selection(fg, best, reason)
    return judge(fg, sel, costs, min_saving_fraction=min_saving_fraction, who="'memory'",
                 predicted_bytes=best_peak)
