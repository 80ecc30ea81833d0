"""Where a plan may cut the forward graph, and the plans 'memory' weighs (no TensorFlow).

A plan keeps some activations and recomputes the rest from them. The
places worth keeping are few: an *articulation point* separates the start
of the forward graph from its end with one tensor
(:func:`articulation_points`); where skips bypass every layer (a U-Net,
dense or inception blocks) a *cut of the topological order* keeps every
activation crossing it (:func:`topological_cuts`). Each candidate is placed
at the activation bytes produced up to it (:func:`positions`); sets of
them are chosen by greedy walks whose segments shrink toward the end of the
graph (:func:`walk`, as Griewank's schedules) and by even spreads of about
``sqrt(k)`` of them (:func:`spread`, Chen et al.'s sqrt(n)).
:func:`memory_plans` lists the distinct plans ``'memory'`` weighs, and
:func:`coarsen` thins a candidate list for the budget solvers.

:class:`memsave.problem.Problem` computes each of these once per graph and
hands them to every planner.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence

import networkx as nx

from memsave.costs import Costs, is_activation
from memsave.graph import ForwardGraph

__all__ = [
    "keepable",
    "fused_away",
    "articulation_points",
    "Cut",
    "topological_cuts",
    "positions",
    "spread",
    "walk",
    "memory_plans",
    "coarsen",
    "SMALL_TENSOR_FRACTION",
    "SEGMENT_LIVE_FRACTION",
    "CANDIDATE_LIVE_FRACTIONS",
    "CUT_LIVE_FRACTIONS",
    "CUT_SPREADS",
]


def keepable(fg: ForwardGraph) -> list[int]:
    """Tensors a plan may keep: activations (:func:`memsave.costs.is_activation`)
    of nonzero size (0: a handle or a TensorList, whose size is unknown here)
    that are not ys, in op order."""
    ys = set(fg.ys)
    return [t for op in fg.ops for t in op.outputs
            if is_activation(fg, t) and fg.tensors[t].size_bytes > 0 and t not in ys]


#: Activations whose gradient reads only their output, and that TensorFlow's
#: CPU remapper fuses into a convolution together with the Add before them
#: (``_FusedConv2D``: Conv2D + BiasAdd + Add + activation; :func:`fused_away`).
#: Not :data:`memsave.timemodel.FUSED_ACTIVATIONS`, the activations fused
#: into a batch norm or a bias add (LeakyRelu too).
_SUM_FUSED_ACTIVATIONS = frozenset({"Relu", "Relu6", "Elu"})
_CONTRACTIONS = frozenset({"Conv2D", "Conv3D", "MatMul"})


def fused_away(fg: ForwardGraph) -> dict[int, int]:
    """Sums a plan must not keep, each with the tensor that stands for it.

    The residual ``Add`` of ``activation(bias_add(conv(x), b) + r)``, whose
    only reader is the activation, is fused with them into the convolution
    on CPU (TensorFlow's remapper; ``Relu``, ``Relu6`` and ``Elu``), which
    then never writes it. The remapper does not check that the sum has no
    other reader: one more (memsave's proxy of a checkpoint) and the pass
    fails for the whole function ("remapper failed: ... fanout ... exist for
    missing node"), leaving every op of the step unfused. The activation's
    output is as large, and its gradient reads it anyway: keeping it instead
    holds the same bytes and recomputes one op less. Returns ``{sum:
    activation's output}``.
    """
    consumers = fg.consumers()

    def biased_contraction(t: int) -> bool:
        p = fg.tensors[t].producer
        if p is None or fg.ops[p].type != "BiasAdd":
            return False
        q = fg.tensors[fg.ops[p].inputs[0]].producer
        return q is not None and fg.ops[q].type in _CONTRACTIONS

    out = {}
    for op in fg.ops:
        if op.type not in ("Add", "AddV2", "AddN") or len(op.inputs) != 2 \
                or len(op.outputs) != 1:
            continue
        readers = consumers[op.outputs[0]]
        if len(readers) == 1 and fg.ops[readers[0]].type in _SUM_FUSED_ACTIVATIONS \
                and any(biased_contraction(t) for t in op.inputs):
            out[op.outputs[0]] = fg.ops[readers[0]].outputs[0]
    return out


#: A differentiable tensor with a fully known size at most this fraction of
#: the largest activation (a scalar auxiliary loss on the first layer) does
#: not tie the graph together in the articulation search; nor does any
#: non-differentiable one (a ``tf.shape`` of an early activation read at the
#: end). Either would otherwise bypass every candidate and leave nothing to
#: keep; the schedule keeps what such a bypass needs. Sizes are the cost
#: model's (an unknown batch dimension takes the ``batch_size`` hint), so
#: a step traced for a partial last batch gets the points of the full one.
#: Override with ``small_tensor_fraction=``.
SMALL_TENSOR_FRACTION = 1 / 64


def articulation_points(
    fg: ForwardGraph, *, small_tensor_fraction: float = SMALL_TENSOR_FRACTION,
    sizes: Sequence[int] | None = None,
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
    before it (and it is not :func:`fused_away`).

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
    # Without the cost model's sizes: the static ones, unknown dimensions as
    # 1 ("largest" per example), and a tensor of unknown size never small.
    known = [True] * len(fg.tensors) if sizes is not None else [n.size_known for n in fg.tensors]
    if sizes is None:
        sizes = [node.size_bytes for node in fg.tensors]
    largest = max(
        (sizes[t] for op in fg.ops for t in op.outputs if is_activation(fg, t)),
        default=0,
    )
    small = largest * small_tensor_fraction

    def ties(t: int) -> bool:
        return fg.tensors[t].trainable and not (known[t] and sizes[t] <= small)

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
    fused = fused_away(fg)
    out = []
    for i in sorted(on_path):
        used = [
            t
            for t in fg.ops[i].outputs
            if fg.tensors[t].trainable and consumers[t] and t not in ys
        ]
        if len(used) == 1 and used[0] not in fused:
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
        The activations (see :func:`keepable`) produced at or before
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
    activation, none :func:`fused_away`, and its crossing bytes are no more
    than at the cuts just before and after it (plateaus count whole: every
    layer of a stack under the same skip is a candidate).

    Notes
    -----
    Two sweeps over the ops in topological order: the first keeps the set of
    activations still to be read and its bytes; the second records the
    crossing sets at the chosen positions only. Linear in ops plus edges,
    plus the total size of the recorded crossing sets.
    """
    consumers = fg.consumers()
    keeps = set(keepable(fg))
    last_use = {t: consumers[t][-1] for t in keeps if consumers[t]}

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
    fused = fused_away(fg)
    return [c for c in sweep(chosen) if c.crossing and fused.keys().isdisjoint(c.crossing)]


#: Fraction of a segment's activation bytes assumed alive at once while it
#: is recomputed, used only to *generate* candidate plans (each is then
#: judged by the simulator). A gradient usually needs one tensor of each
#: elementwise pair (tanh's output, not its input), so about half. Override
#: with ``segment_live_fraction=``.
SEGMENT_LIVE_FRACTION = 0.5

#: Further live fractions tried when generating candidates for ``'memory'``;
#: the simulator picks the best of all of them.
CANDIDATE_LIVE_FRACTIONS = (0.25, 1.0)

#: Bisection steps on the byte budget: 2**-30 of the total is far below one tensor.
_BUDGET_BISECTIONS = 30


def _walk_under(pos: list[int], size: list[int], total: int, budget: float, frac: float) -> list[int] | None:
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


def walk(pos: list[int], size: list[int], total: int, frac: float) -> list[int]:
    """Indices of the greedy walk (:func:`_walk_under`) under the smallest byte
    budget it can meet, found by bisection."""
    lo, hi = 0.0, frac * total
    idx: list[int] = []
    for _ in range(_BUDGET_BISECTIONS):
        mid = (lo + hi) / 2
        found = _walk_under(pos, size, total, mid, frac)
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


def positions(fg: ForwardGraph, costs: Costs) -> tuple[list[int], int]:
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
    plans = [walk(pos, size, total, frac) for frac in fracs]
    root = math.isqrt(len(pos))
    plans += [spread(pos, total, k) for k in dict.fromkeys(int(f * root) for f in spreads)
              if 0 < k <= len(pos)]
    return plans


def memory_plans(fg: ForwardGraph, costs: Costs, points: Sequence[int], cuts: Sequence[Cut], *,
                 segment_live_fraction: float = SEGMENT_LIVE_FRACTION) -> list[tuple[int, ...]]:
    """The distinct plans 'memory' weighs (tensor ids, topological order).

    Over the articulation ``points`` (:func:`articulation_points`): a greedy
    walk per live fraction (``segment_live_fraction`` and
    :data:`CANDIDATE_LIVE_FRACTIONS`) and spreads of about ``sqrt(k)``; over
    the topological ``cuts`` (:func:`topological_cuts`), the same with
    :data:`CUT_LIVE_FRACTIONS` and :data:`CUT_SPREADS`, each plan keeping
    every tensor crossing its chosen cuts. ``O(k log n)`` per plan.
    """
    cum, total = positions(fg, costs)
    plans: dict[tuple[int, ...], None] = {}
    if points:
        fracs = (segment_live_fraction, *CANDIDATE_LIVE_FRACTIONS)
        plans.update(dict.fromkeys(_articulation_plans(fg, costs, list(points), cum, total,
                                                       fracs)))
    plans.update(dict.fromkeys(_cut_plans(list(cuts), costs, cum, total)))
    return [c for c in plans if c]


def _articulation_plans(fg, costs, cands, cum, total, fracs) -> list[tuple[int, ...]]:
    # The cost model's bytes, as everywhere in planning: a step traced for a
    # partial last batch (batch None) weighs the plans of the full batch.
    pos = [cum[fg.tensors[t].producer] for t in cands]
    size = [costs.tensor_bytes[t] for t in cands]
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


def coarsen(fg: ForwardGraph, costs: Costs, candidates: Sequence[int], max_cuts: int) -> tuple[int, ...]:
    """At most ``max_cuts`` of ``candidates``, spread evenly over the activation bytes.

    Each candidate is placed at the activation bytes produced up to its
    producer (:func:`positions`); the ones closest to ``j * total /
    (max_cuts + 1)``, ``j = 1 .. max_cuts``, are kept (:func:`spread`), so
    each coarse segment holds about the same activation bytes (what Chen et
    al.'s sqrt(n) plan equalises). Any subset of cuts is a valid decision
    space for the budget solvers; this one bounds their work on large
    graphs. ``O(n + m)``.
    """
    cands = sorted(dict.fromkeys(candidates), key=lambda t: (fg.tensors[t].producer, t))
    if len(cands) <= max_cuts:
        return tuple(cands)
    cum, total = positions(fg, costs)
    pos = [cum[fg.tensors[t].producer] for t in cands]
    return tuple(cands[i] for i in spread(pos, total, max_cuts))
