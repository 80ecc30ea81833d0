"""Checkpoint selection strategies (no TensorFlow).

A strategy is a function ``(fg: ForwardGraph, **options) -> Selection`` that
picks tensors of the forward graph to keep. Strategies are registered by
name with :func:`register`; ``memsave.gradients(checkpoints="memory")`` looks
the name up with :func:`get`. An unknown name raises
:class:`~memsave.errors.UnknownStrategyError` listing the known ones.

Every strategy returns internal tensors produced by recomputable ops that are
not ys; outputs of stateful ops and the xs are kept anyway and are not listed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import networkx as nx

from memsave.errors import UnknownStrategyError
from memsave.graph import ForwardGraph

__all__ = [
    "Selection",
    "Strategy",
    "register",
    "get",
    "available",
    "collection",
    "memory",
    "speed",
    "EXPENSIVE_OP_TYPES",
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
        if not op.recomputable:
            continue
        for t in op.outputs:
            node = fg.tensors[t]
            if node.trainable and t not in ys:
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
def speed(fg: ForwardGraph, *, op_types: frozenset[str] = EXPENSIVE_OP_TYPES) -> Selection:
    """Keep the outputs of expensive ops (:data:`EXPENSIVE_OP_TYPES`).

    Recomputation then redoes only the cheap ops between them, so the extra
    time is small; memory drops by what those cheap ops produced.
    """
    chosen = [t for t in _candidates(fg) if fg.ops[fg.tensors[t].producer].type in op_types]
    note = "" if chosen else (
        f"no output of {sorted(op_types)} lies between xs and ys; use checkpoints='memory'"
    )
    return _selection(fg, chosen, lambda t: f"output of {fg.ops[fg.tensors[t].producer].type}", note)


def articulation_candidates(fg: ForwardGraph) -> list[int]:
    """Tensors that cut the recomputable forward graph in two.

    Build an undirected graph of the recomputable ops (edges where a tensor
    flows), plus one node joined to the producers of the ys; an op is a
    cut if removing it disconnects that graph (an articulation point). Its
    output is a candidate when it is the op's only differentiable output
    consumed in the forward graph: keeping it then lets everything after it
    be recomputed without anything before it.

    Notes
    -----
    Articulation points are found with Hopcroft-Tarjan's depth-first search
    (``networkx.articulation_points``), linear in ops plus edges.
    """
    g = nx.Graph()
    sink = -1
    g.add_node(sink)
    consumers = fg.consumers()
    for op in fg.ops:
        if not op.recomputable:
            continue
        g.add_node(op.index)
        for t in op.inputs:
            p = fg.tensors[t].producer
            if p is not None and fg.ops[p].recomputable:
                g.add_edge(p, op.index)
    for y in fg.ys:
        p = fg.tensors[y].producer
        if p is not None and fg.ops[p].recomputable:
            g.add_edge(p, sink)
    cuts = set(nx.articulation_points(g))
    ys = set(fg.ys)
    out = []
    for i in sorted(cuts - {sink}):
        used = [
            t
            for t in fg.ops[i].outputs
            if fg.tensors[t].trainable and consumers[t] and t not in ys
        ]
        if len(used) == 1:
            out.append(used[0])
    return out


@register("memory")
def memory(fg: ForwardGraph, *, num_checkpoints: int | None = None) -> Selection:
    """Keep about sqrt(n) articulation points, spread by activation bytes.

    Parameters
    ----------
    num_checkpoints : int, optional
        How many to keep; default ``ceil(sqrt(n))`` for ``n`` candidates,
        the choice that balances kept tensors against one segment's
        recomputation in a uniform chain (Chen et al., 2016).

    Notes
    -----
    Candidates are :func:`articulation_candidates`. Each gets the cumulative
    bytes of the activations produced up to it (in topological order); the
    chosen ones are those closest to ``j * total / (k + 1)`` for
    ``j = 1..k``, so that the segments between them hold about the same
    bytes. Linear time after the articulation search.

    References
    ----------
    T. Chen, B. Xu, C. Zhang, C. Guestrin. Training Deep Nets with Sublinear
    Memory Cost. arXiv:1604.06174, 2016.
    """
    cands = articulation_candidates(fg)
    if not cands:
        return Selection((), {}, (
            "the forward graph has no articulation point (every tensor is bypassed by "
            "another path, e.g. long skip connections); pass checkpoints as a list of "
            "tensors, tag them with tf.compat.v1.add_to_collection('checkpoints', t), "
            "or use checkpoints='speed'"
        ))
    if num_checkpoints is None:
        num_checkpoints = math.ceil(math.sqrt(len(cands)))
    if num_checkpoints < 0:
        raise ValueError(f"memsave: num_checkpoints must be >= 0, got {num_checkpoints}")
    k = min(num_checkpoints, len(cands))
    # Cumulative activation bytes at each op.
    cum = []
    total = 0
    for op in fg.ops:
        if op.recomputable:
            total += sum(fg.tensors[t].size_B for t in op.outputs if fg.tensors[t].trainable)
        cum.append(total)
    pos = [cum[fg.tensors[t].producer] for t in cands]
    chosen: list[int] = []
    start = 0
    for j in range(1, k + 1):
        target = total * j / (k + 1)
        # Candidates are in topological order, so positions are sorted: move
        # forward to the one closest to the target, leaving room for the rest.
        best = start
        last = len(cands) - (k - j) - 1
        for i in range(start, last + 1):
            if abs(pos[i] - target) < abs(pos[best] - target):
                best = i
            if pos[i] > target:
                break
        chosen.append(cands[best])
        start = best + 1
    return _selection(fg, chosen, lambda t: "articulation point")
