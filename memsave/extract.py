"""Read the part of a TensorFlow graph between xs and ys into a ForwardGraph.

Data flow: ``extract(ys, xs, stop_gradients, tagged)`` walks forward from
the consumers of the xs along differentiable tensors (TensorFlow's own rule,
as tf.gradients walks), never entering an op listed in stop_gradients, then
backward from the ys over every input, keeping the ops reached both ways.
Those ops, numbered in topological order, and the tensors they touch become
a :class:`~memsave.graph.ForwardGraph`, with what the cost model needs read
from TensorFlow: static shapes and dtypes, the variable behind each resource
handle, registered FLOP counts, and which inputs/outputs each op's gradient
reads (learned once per op type and shapes, ``_tf_private.learn_gradient_use``); an :class:`Extraction` keeps the
map from ids back to TensorFlow objects for the rewrite.

Only ops on paths from the given xs to the given ys are ever considered,
never "all ops in the graph": under tf.distribute one graph holds a forward
pass per replica, and each call must touch its own replica only.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Sequence

import tensorflow as tf

from memsave import _tf_private
from memsave.graph import ForwardGraph, GradientUse, OpNode, TensorNode

__all__ = ["Extraction", "extract"]


@dataclasses.dataclass
class Extraction:
    """A ForwardGraph and the TensorFlow objects behind its ids."""

    fg: ForwardGraph
    ops: list[tf.Operation]
    tensors: list[tf.Tensor]
    tensor_ids: dict  # tensor.ref() -> id
    op_index: dict  # tf.Operation -> index in ops

    def id_of(self, t: tf.Tensor) -> int | None:
        return self.tensor_ids.get(t.ref())


def _itemsize(dtype: tf.DType) -> int:
    return dtype.size if dtype not in (tf.resource, tf.variant, tf.string) else 0


def _size(t: tf.Tensor) -> tuple[int, bool]:
    shape = t.shape
    itemsize = _itemsize(t.dtype)
    if shape.rank is None:
        return itemsize, False
    n, known = 1, True
    for d in shape.as_list():
        if d is None:
            known = False
        else:
            n *= d
    return n * itemsize, known


def _held_bytes(t: tf.Tensor) -> int | None:
    """Bytes of the variable a resource handle refers to (None if unknown)."""
    found = _tf_private.resource_value_shape_dtype(t)
    if found is None or found[0] is None or any(d is None for d in found[0]):
        return None
    n = 1
    for d in found[0]:
        n *= d
    return n * _itemsize(found[1])


def _gradient_use(op: tf.Operation, node_def) -> GradientUse | None:
    learned = _tf_private.learn_gradient_use(op, node_def)
    if learned is None:
        return None
    return GradientUse(
        reads_inputs=learned["reads_inputs"], reads_outputs=learned["reads_outputs"],
        aliases=learned["aliases"], has_gradient=learned["has_gradient"],
    )


def extract(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    stop_gradients: Sequence[tf.Tensor] = (),
    tagged: Sequence[tf.Tensor] = (),
) -> Extraction:
    """Build the ForwardGraph of the ops on differentiable paths from xs to ys."""
    stop_ops = {t.op for t in stop_gradients}

    # Forward: ops reached from the xs along differentiable tensors.
    reached: set[tf.Operation] = set()
    queue = collections.deque()
    for x in xs:
        if _tf_private.is_trainable(x):
            queue.extend(x.consumers())
    while queue:
        op = queue.popleft()
        if op in reached or op in stop_ops:
            continue
        reached.add(op)
        for out in op.outputs:
            if _tf_private.is_trainable(out):
                queue.extend(out.consumers())

    # Backward: of those, the ones the ys depend on.
    between: set[tf.Operation] = set()
    queue.extend(y.op for y in ys)
    while queue:
        op = queue.popleft()
        if op in between or op not in reached:
            continue
        between.add(op)
        queue.extend(t.op for t in op.inputs)

    ops = _toposort(between)
    index = {op: i for i, op in enumerate(ops)}

    x_refs = {x.ref() for x in xs}
    tagged_refs = {t.ref() for t in tagged}
    tensors: list[tf.Tensor] = []
    nodes: list[TensorNode] = []
    ids: dict = {}

    def tensor_id(t: tf.Tensor) -> int:
        key = t.ref()
        if key in ids:
            return ids[key]
        i = len(tensors)
        ids[key] = i
        producer = index.get(t.op)
        if producer is not None:
            kind = "internal"
        elif key in x_refs:
            kind = "source"
        else:
            kind = "external"
        size, known = _size(t)
        tensors.append(t)
        nodes.append(TensorNode(
            id=i, name=t.name, kind=kind, producer=producer, size_B=size,
            size_known=known, trainable=_tf_private.is_trainable(t),
            tagged=key in tagged_refs,
            shape=None if t.shape.rank is None else tuple(t.shape.as_list()),
            itemsize=_itemsize(t.dtype), dtype=t.dtype.name,
            held_B=_held_bytes(t) if t.dtype == tf.resource else None,
            constant=t.op.type == "Const",
        ))
        return i

    op_nodes = []
    for i, op in enumerate(ops):
        node_def = op.node_def  # parsed once: both cost readers need it
        inputs = tuple(tensor_id(t) for t in op.inputs)
        outputs = tuple(tensor_id(t) for t in op.outputs)
        op_nodes.append(OpNode(
            index=i, name=op.name, type=op.type, inputs=inputs, outputs=outputs,
            recomputable=_tf_private.is_recomputable(op),
            flops=_tf_private.op_flops(op, node_def), gradient=_gradient_use(op, node_def),
        ))
    x_ids = tuple(tensor_id(x) for x in xs)
    y_ids = tuple(tensor_id(y) for y in ys)
    xla = bool(ops) and _tf_private.in_xla_context(ops[0].graph)
    fg = ForwardGraph(ops=tuple(op_nodes), tensors=tuple(nodes), xs=x_ids, ys=y_ids, xla=xla)
    return Extraction(fg=fg, ops=ops, tensors=tensors, tensor_ids=ids, op_index=index)


def _toposort(ops: set[tf.Operation]) -> list[tf.Operation]:
    """Kahn's algorithm over data and control edges inside ``ops``.

    Ties are broken by creation order, so the result is deterministic.
    """
    indegree = {}
    consumers: dict[tf.Operation, list[tf.Operation]] = {op: [] for op in ops}
    for op in ops:
        preds = {t.op for t in op.inputs if t.op in ops}
        preds.update(c for c in op.control_inputs if c in ops)
        indegree[op] = len(preds)
        for p in preds:
            consumers[p].append(op)
    key = _tf_private.op_creation_index
    heap = [(key(op), op) for op, d in indegree.items() if d == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, op = heapq.heappop(heap)
        out.append(op)
        for c in consumers[op]:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(heap, (key(c), c))
    if len(out) != len(ops):
        raise AssertionError("this is a bug in memsave: the forward graph has a cycle")
    return out
