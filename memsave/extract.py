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

One module of some 600 lines: the walk, the records and the readers of what
the cost model needs (shapes, handle data, gradient uses, bodies) are one
pass over the ops and the objects TensorFlow gives for them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import logging
from collections.abc import Sequence

import tensorflow as tf

from memsave import _tf_private
from memsave.costs import ALIAS_OP_TYPES, check_batch_size, einsum_temporaries, estimate_costs
from memsave.graph import Body, ForwardGraph, GradientUse, OpNode, TensorNode

__all__ = ["Extraction", "extract", "views_rows", "ROW_ALIGN_BYTES"]

logger = logging.getLogger(__name__)


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


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: tf.DType) -> int:
    return dtype.size if dtype not in (tf.resource, tf.variant, tf.string) else 0


#: Eigen's largest alignment in TensorFlow's x86 builds: a cut along
#: dimension 0 is a view only when one row (one index of dimension 0) is a
#: multiple of it (``IsInnerDimsSizeAligned``). Measured with TF 2.21: a
#: ``[64, 1024, 128]`` float32 row (512 KiB) is viewed; rows of 516 KiB + 16
#: and 1 MiB + 32 bytes are copied.
ROW_ALIGN_BYTES = 64


def views_rows(op: tf.Operation) -> int | None:
    """The position of the input whose buffer ``op``'s outputs are parts of,
    or None (each output a buffer of its own).

    TensorFlow's CPU and GPU kernels of ``StridedSlice`` and ``Slice`` (a
    range of dimension 0 with step 1, every other dimension whole),
    ``Split`` and ``SplitV`` along dimension 0, and ``Unpack`` along axis 0
    return slices of their input's buffer, not copies, when a row is
    aligned (:data:`ROW_ALIGN_BYTES`; strided_slice_op.cc, slice_op.cc,
    split_op.cc, unpack_op.cc): a view holds the whole input alive
    (measured with TF 2.21: ``x[-1]``, ``x[2:5]``, ``tf.split(x, 4)[0]``
    and ``tf.unstack(x)[3]`` of a ``[64, 1024, 128]`` float32 tensor each
    hold its 32 MiB; ``x[::2]`` and ``x[:, 3]`` are copies).
    """
    kind = op.type
    if kind not in _ROW_VIEW_TYPES:
        return None
    source = {"Split": 1}.get(kind, 0)
    data = op.inputs[source]
    dims = _dims(data.shape)
    if dims is None or len(dims) < 2 or any(d is None for d in dims[1:]):
        return None
    row = _itemsize(data.dtype)
    for d in dims[1:]:
        row *= d
    if row <= 0 or row % ROW_ALIGN_BYTES:
        return None
    if kind in ("Split", "SplitV"):
        axis = tf.get_static_value(op.inputs[0 if kind == "Split" else 2])
        return source if axis is not None and int(axis) in (0, -len(dims)) else None
    if kind == "Unpack":
        return source if op.get_attr("axis") in (0, -len(dims)) else None
    out = _dims(op.outputs[0].shape)
    if out is None or any(d is None for d in out[1:]):
        return None
    if kind == "StridedSlice":
        if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask") \
                or op.get_attr("shrink_axis_mask") & ~1:
            return None
        strides = tf.get_static_value(op.inputs[3])
        if strides is None or any(int(s) != 1 for s in strides):
            return None
        rest = out if op.get_attr("shrink_axis_mask") else out[1:]
    else:  # Slice
        rest = out[1:]
    return source if list(rest) == dims[1:] else None


_ROW_VIEW_TYPES = frozenset({"StridedSlice", "Slice", "Split", "SplitV", "Unpack"})


def _dims(shape: tf.TensorShape) -> list | None:
    return shape.as_list() if shape.rank is not None else None


def _size(dims: list | None, dtype: tf.DType, batch_size: int | None = None) -> tuple[int, bool]:
    """Bytes of a tensor of these dimensions (None: unknown rank), unknown ones
    counted as 1 (an unknown first one as ``batch_size`` when given, as
    :func:`memsave.costs.estimate_costs` counts it), and whether all were known."""
    itemsize = _itemsize(dtype)
    if dims is None:
        return itemsize, False
    n, known = 1, True
    for k, d in enumerate(dims):
        if d is None:
            known = False
            n *= batch_size if k == 0 and batch_size is not None else 1
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
    args = _tf_private.custom_gradient_arguments(op, node_def)
    if args is not None:
        # tf.custom_gradient: its function reads the arguments it captured
        # (assumed: what else it closed over cannot be seen) and gives them
        # their gradients; the results it passes through get none.
        return GradientUse(reads_inputs=args, reads_outputs=(), aliases=(None,) * len(op.inputs),
                           gives=args, captured=True)
    learned = _tf_private.learn_gradient_use(op, node_def)
    if learned is None:
        return None
    # One record per learned answer (learned once per op type, attrs and
    # shapes): a deep model's layers share a few.
    found = _USES.get(id(learned))
    if found is None or found[0] is not learned:
        found = _USES[id(learned)] = (learned, GradientUse(
            reads_inputs=learned["reads_inputs"], reads_outputs=learned["reads_outputs"],
            aliases=learned["aliases"], has_gradient=learned["has_gradient"],
            by_input=learned.get("by_input"), early_bytes=learned.get("early_bytes", ()),
            early_from=learned.get("early_from", ()), products=learned.get("products"),
        ))
    return found[1]


#: ``id(learned)`` -> (learned, its GradientUse); ``learned`` is kept alive.
_USES: dict[int, tuple[dict, GradientUse]] = {}


def extract(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    stop_gradients: Sequence[tf.Tensor] = (),
    tagged: Sequence[tf.Tensor] = (),
    _bodies: dict | None = None,
    *,
    batch_size: int | None = None,
) -> Extraction:
    """Build the ForwardGraph of the ops on differentiable paths from xs to ys.

    Calls of tf.functions and While loops get a :class:`~memsave.graph.Body`:
    the function they run, read the same way (``_bodies`` caches it per
    function and input shapes). ``batch_size``: the size of an unknown
    first dimension in the bodies (``Body.batch_size``; the enclosing
    graph's take it from :func:`memsave.costs.estimate_costs`).
    """
    from memsave.simulate import paused_gc  # TF-free; a burst of small allocations here too

    check_batch_size(batch_size)
    with paused_gc():
        return _extract(ys, xs, stop_gradients, tagged, _bodies, batch_size)


def _extract(ys, xs, stop_gradients, tagged, _bodies, batch_size) -> Extraction:
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
    # A TF1 loop's NextIteration closes a cycle: left out, its output is read
    # as an input from outside, the graph is a DAG, and the call is left to
    # tf.gradients (api._not_rewritable: TF1 control flow is not rewritten).
    between = {op for op in between if op.type not in _BACK_EDGE_TYPES}

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
        dtype = t.dtype
        dims = _dims(t.shape)
        size, known = _size(dims, dtype)
        tensors.append(t)
        nodes.append(TensorNode(
            id=i, name=t.name, kind=kind, producer=producer, size_bytes=size,
            size_known=known, trainable=_tf_private.is_trainable(t),
            tagged=key in tagged_refs,
            shape=None if dims is None else tuple(dims),
            itemsize=_itemsize(dtype), dtype=dtype.name,
            held_bytes=_held_bytes(t) if dtype == tf.resource else None,
            constant=t.op.type == "Const",
        ))
        return i

    xla = bool(ops) and _tf_private.in_xla_context(ops[0].graph)
    op_nodes = []
    bodies: dict = {} if _bodies is None else _bodies
    for i, op in enumerate(ops):
        node_def = op.node_def  # parsed once: both cost readers need it
        inputs = tuple(tensor_id(t) for t in op.inputs)
        outputs = tuple(tensor_id(t) for t in op.outputs)
        body, gradient = None, None
        if op.type in _tf_private.CALL_OP_TYPES or op.type in _tf_private.WHILE_OP_TYPES:
            external = frozenset(j for j, t in enumerate(inputs) if nodes[t].kind == "external")
            body, gradient = _read_body(op, bodies, external, batch_size)
        if gradient is None:
            gradient = _gradient_use(op, node_def)
        flops = _tf_private.op_flops(op, node_def)
        op_nodes.append(OpNode(
            index=i, name=op.name, type=op.type, inputs=inputs, outputs=outputs,
            recomputable=_tf_private.is_recomputable(op) and _tf_private.is_copyable(op),
            flops=flops, gradient=gradient, body=body,
            flops_linear=None if flops is not None else _tf_private.op_flops_linear(op, node_def),
            reuses_statistics=not xla and _tf_private.reuses_batch_statistics(op) and not any(
                c in index for t in op.outputs[1:] for c in t.consumers()),
            views_input=None if xla else views_rows(op),
            temporaries=None if xla or op.type != "Einsum" else einsum_temporaries(
                op.get_attr("equation")),
        ))
    x_ids = tuple(tensor_id(x) for x in xs)
    y_ids = tuple(tensor_id(y) for y in ys)
    fg = ForwardGraph(ops=tuple(op_nodes), tensors=tuple(nodes), xs=x_ids, ys=y_ids, xla=xla)
    return Extraction(fg=fg, ops=ops, tensors=tensors, tensor_ids=ids, op_index=index)


#: Op types whose output closes a TF1 while loop's cycle.
_BACK_EDGE_TYPES = frozenset({"NextIteration", "RefNextIteration"})


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


# -- bodies of calls and loops -------------------------------------------------

#: Op types that write an item into a TensorList (a TensorArray in graph
#: mode), and the position of the item among their inputs: inside a loop,
#: the list the loop carries keeps every trip's item alive.
LIST_WRITE_ITEM = {"TensorListSetItem": 2, "TensorListPushBack": 1}

#: Comparison of a loop counter with a bound (cond ``i < n``, ``i <= n``):
#: how many trips a counter from ``start`` by ``step`` makes.
_COUNTER_COMPARISONS = {"Less": 0, "LessEqual": 1}

#: Trips assumed for a loop whose trip count is not known statically
#: (the Plan lists such loops among its assumptions).
UNKNOWN_TRIPS = 1


def _read_body(op: tf.Operation, cache: dict, external: frozenset = frozenset(),
               batch_size: int | None = None) -> tuple[Body | None, GradientUse | None]:
    """The Body of a call or While, and what the op's gradient reads.

    ``external``: positions of the op's inputs that carry no gradient in
    the enclosing graph (a loop's ``no_gradient`` when it passes them through).

    What the gradient keeps is read from the body's own ops, by the rules
    TensorFlow follows when it differentiates a function call (the forward
    function outputs every intermediate its backward function reads) and a
    while_v2 loop (``_WhileBodyGradFuncGraph._capture_helper``: it captures
    loop invariants and constants directly, re-reads resources, looks
    through Identity, and pushes every other tensor the gradient reads to an
    accumulator, one entry per trip).
    """
    key = _tf_private.function_key(op)
    if key is None:
        return None, None
    if key not in cache:
        try:
            cache[key] = _read_function(op, cache, batch_size)
        except Exception:  # noqa: BLE001 - modelling a body must never stop the rewrite
            logger.debug("memsave: could not read the body of %s", op.name, exc_info=True)
            cache[key] = None
    read = cache[key]
    if read is None:
        return None, None
    (fg, saved, stored, reads_inputs, reads_outputs, invariant, state, kept, input_ids,
     stored_outputs, stored_state, once) = read
    loop = op.type in _tf_private.WHILE_OP_TYPES
    trips, known = (_while_trips(op) if loop else (1, True))
    no_gradient = tuple(sorted(input_ids[j] for j in invariant
                               if j in external and input_ids[j] is not None)) if loop else ()
    body = Body(fg=fg, trips=trips, trips_known=known, saved=saved, stored=stored, loop=loop,
                invariant=invariant, state=state if loop else (), kept_bytes=kept if loop else (),
                once=once if loop else "",
                read_lists_bytes=_read_lists_bytes(
                    op, [j for j in invariant if j not in external], batch_size) if loop else 0,
                no_gradient=no_gradient,
                pinned=_pinned(op) if loop else "",
                stored_outputs=stored_outputs if loop else (),
                stored_state=stored_state if loop else (), batch_size=batch_size)
    gradient = GradientUse(
        reads_inputs=reads_inputs, reads_outputs=() if loop else reads_outputs,
        aliases=(None,) * len(op.inputs),
    )
    return body, gradient


def _pinned(op: tf.Operation) -> str:
    """Why the loop ``op`` must keep while_v2's gradient ("" if it need not)."""
    writer = _tf_private.written_variable(op)
    return (f"its body reads a variable that {writer!r} writes: a trip recomputed after the "
            "write would read the new value") if writer else ""


def _read_function(op: tf.Operation, cache: dict, batch_size: int | None):
    func = _tf_private.body_graph(op)
    if func is None:
        return None
    inputs, outputs = list(func.inputs), list(func.outputs)
    if len(inputs) != len(op.inputs) or len(outputs) != len(op.outputs):
        return None  # captures not lined up with the op's inputs: not read
    xs = [t for t in inputs if _tf_private.is_trainable(t)]
    ys = [t for t in outputs if _tf_private.is_trainable(t)]
    if not xs or not ys:
        return None
    sub = extract(ys, xs, _bodies=cache, batch_size=batch_size)
    fg = sub.fg
    loop = op.type in _tf_private.WHILE_OP_TYPES

    def root(t: int) -> int:
        node = fg.tensors[t]
        while node.producer is not None and fg.ops[node.producer].type in ALIAS_OP_TYPES \
                and fg.ops[node.producer].inputs:
            t = fg.ops[node.producer].inputs[0]
            node = fg.tensors[t]
        return t

    position = {}  # body tensor id -> input position
    for j, t in enumerate(inputs):
        i = sub.id_of(t)
        if i is not None:
            position[i] = j
    out_root = {}  # root tensor id -> output position
    invariant = set()
    for k, t in enumerate(outputs):
        i = sub.id_of(t)
        if i is None:
            continue
        r = root(i)
        if loop and position.get(r) == k:
            invariant.add(k)
        else:
            out_root.setdefault(r, k)
    saved, reads_inputs, reads_outputs = {}, set(), set()
    stored = {}
    kept: dict = {}  # ref -> a draw stored each trip (loops)
    draws = _Draws()
    # A body's backward runs apart from its forward (a function's backward
    # function, the gradient loop): what early gradient values are computed
    # from is what it keeps, as the costs count it by default.
    costs = estimate_costs(fg, batch_size=batch_size)
    for node in fg.ops:
        read_ins, read_outs = costs.gradient_reads[node.index]
        read = read_ins + read_outs
        for t in read:
            r = root(t)
            tn = fg.tensors[r]
            if tn.dtype in ("resource", "variant") or tn.constant:
                continue
            if tn.kind != "internal":
                j = position.get(r)
                if j is None:
                    drawn = draws.behind(sub.tensors[r]) if loop else None
                    if drawn:
                        # Made from a random draw (a dropout mask): while_v2
                        # accumulates it; a gradient that recomputes trips,
                        # the draw.
                        saved[r] = r
                        kept.update(drawn)
                    continue
                if not loop or j in invariant:
                    reads_inputs.add(j)
                else:
                    saved[("var", j)] = r  # a loop variable: accumulated every trip
            elif r in out_root and not loop:
                reads_outputs.add(out_root[r])
            elif r in out_root:
                saved[("var", out_root[r])] = r  # next trip's loop variable
            else:
                saved[r] = r
        j = LIST_WRITE_ITEM.get(node.type)
        if loop and j is not None and j < len(node.inputs) and not (
                node.type == "TensorListSetItem" and fg.tensors[node.inputs[1]].constant):
            # (A SetItem at a constant index overwrites one item: a Keras
            # RNN without return_sequences writes each output at index 0.)
            r = root(node.inputs[j])
            if fg.tensors[r].kind == "internal":
                stored[r] = out_root.get(root(node.outputs[0]), -1)
    saved_ids = tuple(sorted(dict.fromkeys(saved.values())))
    stored_ids = tuple(sorted(stored))
    stored_outputs = tuple(stored[r] for r in stored_ids)
    # An item that the body also outputs as loop state: the next trip's state.
    stored_state = tuple(r for r in stored_ids if r in out_root and out_root[r] not in invariant
                         and fg.tensors[r].dtype not in ("resource", "variant"))
    # The loop state (what a per-step gradient stores) and what must not be
    # computed twice (read by the gradient, made by a random draw).
    state = tuple(sorted(i for i, j in position.items()
                         if loop and j not in invariant and fg.tensors[i].dtype not in ("resource", "variant")))
    input_ids = [None] * len(inputs)
    for i, j in position.items():
        input_ids[j] = i
    once = _tf_private.first_run_once(func) if loop else None
    return (fg, saved_ids, stored_ids, tuple(sorted(reads_inputs)), tuple(sorted(reads_outputs)),
            tuple(sorted(invariant)), state,
            tuple(_size(_dims(t.shape), t.dtype, batch_size)[0] for t in kept.values()),
            tuple(input_ids),
            stored_outputs, stored_state, "" if once is None else once.name)


class _Draws:
    """The outputs of ops that must not run twice (random draws) that a
    body's tensors are computed from.

    A gradient that recomputes a loop's trips (:mod:`memsave._tf_while`)
    stops there: it stores the draw each trip and computes what the
    gradient reads (a dropout mask) from it again.
    """

    def __init__(self):
        self._of_op: dict = {}  # op -> {ref: tensor} of the draws behind its outputs

    def behind(self, t: tf.Tensor) -> dict:
        """``{ref: tensor}`` of the draws ``t`` is computed from (its own op's
        outputs if that op is one), within its function."""
        op = t.op
        if op in self._of_op:
            return self._of_op[op]
        order, seen, stack = [], set(), [(op, False)]
        while stack:  # every op behind ``op`` not yet known, producers first
            o, expanded = stack.pop()
            if expanded:
                order.append(o)
                continue
            if o in self._of_op or o in seen:
                continue
            seen.add(o)
            stack.append((o, True))
            if not _tf_private.runs_once(o):
                stack.extend((i.op, False) for i in o.inputs)
        for o in order:
            if _tf_private.runs_once(o):
                self._of_op[o] = {out.ref(): out for out in o.outputs}
            else:
                found: dict = {}
                for i in o.inputs:
                    found.update(self._of_op.get(i.op, {}))
                self._of_op[o] = found
        return self._of_op[op]



def _read_lists_bytes(op: tf.Operation, invariant, batch_size: int | None) -> int:
    """Bytes of the TensorLists a While passes through that were unstacked
    from a tensor (``TensorListFromTensor``): the items its body reads.
    (Those that carry no gradient are not counted: a loop memsave prepares
    reads their items from the source tensor, memsave.loops.prepare.)"""
    total = 0
    for j in invariant:
        t = op.inputs[j]
        while t.dtype == tf.variant:
            if t.op.type == "TensorListFromTensor":
                source = t.op.inputs[0]
                total += _size(source.shape.as_list() if source.shape.rank is not None else None,
                               source.dtype, batch_size)[0]
                break
            if t.op.type == "Identity":
                t = t.op.inputs[0]
                continue
            outer = _tf_private.captured_outer(t)
            if outer is None or not tf.is_symbolic_tensor(outer):
                break
            t = outer
    return total


def _while_trips(op: tf.Operation) -> tuple[int, bool]:
    """Trips of a While: ``maximum_iterations`` when given, else a counter
    compared with a constant bound (``i < n`` with ``i`` starting at a
    constant and stepping by one), else :data:`UNKNOWN_TRIPS` (unknown)."""
    limit = _tf_private.static_value(op.inputs[1]) if len(op.inputs) > 1 else None
    if limit is not None and int(limit) >= 0:
        return int(limit), True
    cond = _tf_private.cond_graph(op)
    body = _tf_private.body_graph(op)
    if cond is None or body is None or not cond.outputs:
        return UNKNOWN_TRIPS, False
    cmp = cond.outputs[0].op
    while cmp.type == "Identity" and cmp.inputs:
        cmp = cmp.inputs[0].op
    if cmp.type not in _COUNTER_COMPARISONS or len(cmp.inputs) != 2:
        return UNKNOWN_TRIPS, False
    counter, bound = cmp.inputs
    bound_value = tf.get_static_value(bound)
    pos = next((j for j, t in enumerate(cond.inputs) if t is counter), None)
    if bound_value is None or pos is None or pos >= len(op.inputs):
        return UNKNOWN_TRIPS, False
    start = tf.get_static_value(op.inputs[pos])
    step_op = body.outputs[pos].op if pos < len(body.outputs) else None
    while step_op is not None and step_op.type == "Identity":
        step_op = step_op.inputs[0].op
    if start is None or step_op is None or step_op.type not in ("AddV2", "Add"):
        return UNKNOWN_TRIPS, False
    a, b = step_op.inputs
    step = tf.get_static_value(b if a is body.inputs[pos] else a)
    if step is None or int(step) <= 0 or not (a is body.inputs[pos] or b is body.inputs[pos]):
        return UNKNOWN_TRIPS, False
    span = int(bound_value) - int(start) + _COUNTER_COMPARISONS[cmp.type]
    return max(0, -(-span // int(step))), True
