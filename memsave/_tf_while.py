"""while_v2's gradient with recomputation: the TensorFlow internals of :mod:`memsave.loops`.

A companion of :mod:`memsave._tf_private`, kept apart because it is one
mechanism built on one private TensorFlow module (``while_v2``): every use
of while_v2's internals by memsave is here, and a TensorFlow upgrade that
changes them breaks this module only.

How while_v2 differentiates a loop (TF 2.21, ``while_v2._WhileGrad``)
--------------------------------------------------------------------
The gradient of a While op is a second While op that runs the trips
backwards. Its body is built by ``gradients_util._GradientsHelper`` over the
forward body's FuncGraph, inside a ``_WhileBodyGradFuncGraph``. Whenever a
gradient op reads a tensor of the forward body, that graph's
``_capture_helper`` decides where the value comes from: loop invariants
(tensors the body passes through), constants and resource handles are
captured directly; every other tensor gets an *accumulator*, a TensorList
the forward body pushes the value onto each trip (``TensorListPushBack``)
and the backward body pops it from. The forward op is then rewritten in
place: the lists become extra inputs and outputs, the body and cond are
re-serialized. Memory: T trips times everything the backward body reads.

What memsave overrides
----------------------
Only that decision. :class:`_RecomputingGradGraph` subclasses
``_WhileBodyGradFuncGraph`` and, for a tensor of the forward body that is
neither a loop input, an invariant, a constant, a resource, nor the output
of an op that must not run twice (a random draw, a read of a variable the
body writes, a shape while_v2 moved to the forward body), it *copies the
producing op into the backward body*, reading its inputs through the same
rule, recursively. The walk stops at loop inputs, which are accumulated
(the loop state: one entry per trip) and then *gated*: ``state + gate``,
with ``gate`` a float32 zero computed from that trip's incoming gradient
(its first element, NaN-proofed, ``where(b == b, -0.0, nan)``), a data
dependency that neither Grappler nor XLA removes. Every copy also waits for
the gate (a control edge), so nothing of trip t's recomputation runs before
trip t's gradient arrives, whatever ``parallel_iterations`` allows. So the
forward loop pushes exactly the state (and what must not run twice), and
the backward loop recomputes one trip's intermediates at a time.

The gradient function is everything ``_WhileGrad`` does, with that graph
class, a trip count and a list size of memsave's choosing (needed by the
chunked loops below). It is registered under :data:`GRADIENT_OP_TYPE` and
selected per op by the ``_gradient_op_type`` attr, which TensorFlow's
``ops.get_gradient_function`` reads before the op type (after the op's
Python-side ``_gradient_function``, which while_v2 does not set), and which
survives copies of the op and FunctionDef round trips (a Python attribute
would not). It is registered when this module is first imported (by the
first memsave.gradients, memsave.plan or memsave.patch; ``import memsave``
alone imports no TensorFlow), so that a graph or function exported with a
marked loop can be differentiated again in a process that uses memsave.

One more change, to the gradient of the body's writes into the lists a
``tf.scan`` or a TensorArray collects its outputs in: TensorFlow's gradient
of ``TensorListSetItem`` sets the item it read in the list's gradient to
a new zero tensor, and that list is loop state, so the backward loop ends
holding one zero buffer per trip. memsave's writes one zero tensor made
outside the loop instead (:func:`list_setters`, through the ops'
Python-side ``_gradient_function``, set on the body graph being
differentiated).

k-step chunks
-------------
:func:`nest_in_chunks` rewrites a loop's body, in place, into an inner loop
that runs up to k trips of the original body (its cond: the original cond
and ``counter < counter_at_chunk_start + k``). The outer loop then makes
ceil(T/k) trips; differentiated per step, it stores its state once per
chunk and recomputes the inner loop in its backward body, and the inner
loop's own gradient stores the k states of that chunk (``inner``:
``"per_step"``, recomputing each trip again, or ``"store"``, keeping every
intermediate of the chunk like while_v2). The counter still counts the
original trips, so the op's outputs are unchanged. Tapered chunks
(``LoopChoice.slots(s)``: s, s - 1, ..., 1 trips) look the chunk's size up
by the trip it starts at, and the gradient the number of chunks by the
trips made, in two constant tables (:func:`taper_tables`); the inner loop
still counts to the constant s.

Size
----
Longer than most modules (some 1100 lines) on purpose, for the same reason
as :mod:`memsave._tf_private`: every private while_v2 API memsave relies on
(the gradient's graph class, its accumulators, the list and TensorArray
gradients, the loop's FunctionDefs) is here and nowhere else, so this file
is the whole list a TensorFlow upgrade has to check.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import constant_op, func_graph as func_graph_module, ops
from tensorflow.python.framework import tensor_spec
from tensorflow.python.ops import control_flow_util_v2 as util
from tensorflow.python.ops import gradients_util, handle_data_util, list_ops, while_v2
from tensorflow.python.ops import while_v2_indexed_slices_rewriter
from tensorflow.python.util import object_identity

from memsave import _tf_private, loopmodel
from memsave.errors import MemsaveError

__all__ = [
    "GRADIENT_OP_TYPE",
    "mark",
    "marked",
    "nest_in_chunks",
    "recomputing_gradient",
    "function_graphs",
    "invariant_positions",
    "set_parallel_iterations",
    "set_skip",
    "skip_scope",
    "chunk_loops",
    "read_sequences_in_place",
    "written_only",
]

#: The ``_gradient_op_type`` of a While op memsave differentiates.
GRADIENT_OP_TYPE = "MemsaveWhile"
#: ``b"per_step"``: recompute each trip from the stored state;
#: ``b"store"``: keep what the gradient reads, as while_v2 does.
MODE_ATTR = "_memsave_loop_mode"
#: Trips of the original loop per trip of this op (k for a chunked loop).
STEPS_ATTR = "_memsave_loop_steps"
#: A static bound on this op's trips, for the accumulators' sizes (XLA
#: needs one); 0: derived from ``maximum_iterations``.
BOUND_ATTR = "_memsave_loop_bound"
#: Positions of loop-invariant inputs whose gradient nobody asked for.
SKIP_ATTR = "_memsave_loop_skip"
#: The gradient call the skip is for (:func:`skip_scope`); 0: every call.
SKIP_SCOPE_ATTR = "_memsave_loop_skip_scope"
#: For tapered chunks (chunks of k, k-1, ..., 1 trips): the length of the
#: tables of chunk sizes and counts (:func:`taper_tables`); 0 or absent:
#: chunks of ``steps`` trips each.
TAPER_ATTR = "_memsave_loop_taper"

#: Op types whose outputs while_v2 computes in the forward body when the
#: backward body asks for them (``_WhileBodyGradFuncGraph._create_op_internal``):
#: small integers, kept rather than recomputed from what they describe.
_MOVED_TYPES = frozenset({"Shape", "Size", "Rank", "TensorListElementShape", "TensorListLength"})

_uid = itertools.count()


def mark(op: tf.Operation, *, mode: str, steps: int = 1, bound: int = 0,
         skip: tuple[int, ...] = (), taper: int = 0) -> None:
    """Give ``op`` memsave's gradient (see the module docstring)."""
    op._set_attr("_gradient_op_type", attr_value_pb2.AttrValue(s=GRADIENT_OP_TYPE.encode()))  # pylint: disable=protected-access
    op._set_attr(MODE_ATTR, attr_value_pb2.AttrValue(s=mode.encode()))  # pylint: disable=protected-access
    op._set_attr(STEPS_ATTR, attr_value_pb2.AttrValue(i=steps))  # pylint: disable=protected-access
    op._set_attr(BOUND_ATTR, attr_value_pb2.AttrValue(i=bound))  # pylint: disable=protected-access
    set_skip(op, skip)
    op._set_attr(TAPER_ATTR, attr_value_pb2.AttrValue(i=taper))  # pylint: disable=protected-access


_scopes = threading.local()
_open_scopes: set[int] = set()
_scope_ids = itertools.count(1)


@contextlib.contextmanager
def skip_scope():
    """Limit the skips set inside the block (by :func:`mark` and
    :func:`set_skip`) to the gradients built inside it.

    A skip is recorded on the op with the block's id. The copies of a
    marked loop that a gradient makes (a chunk's inner loop, recomputed in
    the outer loop's backward body) carry both, so a gradient built later
    through any of them (a second call, a second-order gradient through
    the backward loop) finds the block closed and gives every input its
    gradient.
    """
    scope = next(_scope_ids)
    outer = getattr(_scopes, "current", 0)
    _open_scopes.add(scope)
    _scopes.current = scope
    try:
        yield scope
    finally:
        _scopes.current = outer
        _open_scopes.discard(scope)


def set_skip(op: tf.Operation, skip: tuple[int, ...]) -> None:
    """Change which loop-invariant inputs of a marked ``op`` get no gradient
    (in the gradients built in the current :func:`skip_scope`, or in every
    later one outside any)."""
    op._set_attr(SKIP_ATTR, attr_value_pb2.AttrValue(  # pylint: disable=protected-access
        list=attr_value_pb2.AttrValue.ListValue(i=list(skip))))
    op._set_attr(SKIP_SCOPE_ATTR, attr_value_pb2.AttrValue(  # pylint: disable=protected-access
        i=getattr(_scopes, "current", 0)))


def _skip_now(op: tf.Operation, skip: tuple[int, ...]) -> tuple[int, ...]:
    """``skip`` if the scope it was set in is open (or it was set outside any)."""
    try:
        scope = op.get_attr(SKIP_SCOPE_ATTR)
    except ValueError:
        scope = 0
    return skip if scope == 0 or scope in _open_scopes else ()


def chunk_loops(op: tf.Operation) -> list[tf.Operation]:
    """The inner loops :func:`nest_in_chunks` put in ``op``'s body (marked by memsave)."""
    body = getattr(op, "_body_graph", None)
    if body is None:
        return []
    return [inner for inner in body.get_operations()
            if inner.type in _tf_private.WHILE_OP_TYPES and marked(inner) is not None]


def marked(op: tf.Operation) -> tuple[str, int, int, tuple[int, ...], int] | None:
    """(mode, steps, bound, skip, taper) of a marked op, None if memsave did
    not mark it."""
    try:
        if op.get_attr("_gradient_op_type") != GRADIENT_OP_TYPE.encode():
            return None
        return (op.get_attr(MODE_ATTR).decode(), op.get_attr(STEPS_ATTR), op.get_attr(BOUND_ATTR),
                tuple(op.get_attr(SKIP_ATTR)), op.get_attr(TAPER_ATTR))
    except ValueError:
        return None


def function_graphs(op: tf.Operation):
    """(cond, body) FuncGraphs of a While op, as its gradient will read them."""
    return (while_v2._get_graph(op, "cond", "_cond_graph"),  # pylint: disable=protected-access
            while_v2._get_graph(op, "body", "_body_graph"))  # pylint: disable=protected-access


def set_parallel_iterations(op: tf.Operation, n: int) -> None:
    """Let at most ``n`` trips of ``op`` run at once."""
    op._set_attr("parallel_iterations", attr_value_pb2.AttrValue(i=n))  # pylint: disable=protected-access


def invariant_positions(op: tf.Operation) -> tuple[int, ...]:
    """Positions of the inputs ``op``'s body passes through unchanged."""
    body = function_graphs(op)[1]
    return tuple(j for j, (i, o) in enumerate(zip(body.inputs, body.outputs)) if i is o)


def already_differentiated(op: tf.Operation) -> bool:
    """Whether while_v2 (or memsave) already added accumulators to ``op``."""
    try:
        return op.get_attr("_num_original_outputs") != len(op.outputs) or any(
            t.op.type == "TensorListPushBack" for t in function_graphs(op)[1].outputs)
    except ValueError:
        return False


def _register() -> None:
    """Register :func:`_marked_gradient` under :data:`GRADIENT_OP_TYPE` (once)."""
    try:
        ops._gradient_registry.lookup(GRADIENT_OP_TYPE)  # pylint: disable=protected-access
    except LookupError:
        ops.RegisterGradient(GRADIENT_OP_TYPE)(_marked_gradient)


def _marked_gradient(op, *grads):
    if op is None:
        # tf.saved_model.save traces each registered gradient of a function's
        # ops as a custom gradient, called without the op; this one reads it.
        raise MemsaveError(
            "memsave: a tf.while_loop memsave gave its own gradient (per step or in chunks) "
            "cannot have that gradient saved as a SavedModel custom gradient; save with "
            "options=tf.saved_model.SaveOptions(experimental_custom_gradients=False) (the "
            "saved functions run as they were traced)")
    mode, steps, bound, skip, taper = marked(op)
    return recomputing_gradient(op, grads, recompute=mode == "per_step", steps=steps, bound=bound,
                                skip=_skip_now(op, skip), taper=taper)


# -- the gradient ----------------------------------------------------------------

def recomputing_gradient(op: tf.Operation, grads, *, recompute: bool, steps: int = 1,
                         bound: int = 0, skip: tuple[int, ...] = (), taper: int = 0) -> list:
    """``while_v2._WhileGrad`` with :class:`_RecomputingGradGraph` (when
    ``recompute``), ``steps`` original trips per trip of ``op`` (``taper``:
    ``steps``, ``steps - 1``, ... trips, :func:`taper_tables`), a list
    size ``bound`` (0: from ``maximum_iterations``), and no gradient for the
    loop-invariant inputs at positions ``skip``. Same structure as
    while_v2's, statement for statement, so that a reader can diff them."""
    # pylint: disable=protected-access
    while_op = op.outputs[0].op
    cond_graph, body_graph = function_graphs(while_op)
    cond_graph._while = while_op
    body_graph._while = while_op
    orig_num_params = len(body_graph.outputs)
    maximum_iterations = op.inputs[1]
    parallel_iterations = op.get_attr("parallel_iterations")
    try:
        num_original_outputs = while_op.get_attr("_num_original_outputs")
    except ValueError:
        num_original_outputs = len(while_op.outputs)
    num_intermediates = len(while_op.outputs) - num_original_outputs
    # An invariant's gradient is a sum over trips that nothing reads back:
    # unless someone asked for it, none is computed (a Keras RNN's input
    # sequence would otherwise get a T-long gradient list, built trip by
    # trip). The zeros while_v2 starts an invariant's gradient from are made
    # from the op's input, the same value as its output: reading the output
    # of a loop nested in a recomputed body would copy that loop before its
    # own gradient adds its accumulators, and run it twice.
    invariant = {i for i, (x, y) in enumerate(zip(body_graph.inputs, body_graph.outputs)) if x is y}
    grads = [_one_item(_lazy_zeros(g, while_op, i), while_op, i) if i < num_original_outputs
             else g for i, g in enumerate(grads)]
    grads = [
        None if i in skip and i in invariant else while_v2._preprocess_grad(
            grad, body_out, while_in, while_in if i in invariant else while_out)
        for i, (grad, body_out, while_in, while_out) in enumerate(zip(
            grads[:num_original_outputs], body_graph.outputs[:num_original_outputs],
            while_op.inputs[:num_original_outputs], while_op.outputs[:num_original_outputs]))
    ] + [None] * num_intermediates
    if getattr(op, "skip_input_indices", None) is not None:
        captures_start_index = len(body_graph.inputs) - len(body_graph.internal_captures)
        for i in op.skip_input_indices:
            if i >= captures_start_index:
                grads[i] = None
    ys, xs, non_none_grads = zip(*[(y, x, grad) for (y, x, grad) in zip(
        body_graph.outputs, body_graph.inputs, grads) if grad is not None])

    for setter in list_setters(body_graph):
        _tf_private.set_gradient_function(setter, _set_item_gradient)
    list_bound = _list_bound(while_op, steps, bound, taper)
    body_grad_graph, args = _create_grad_func(
        ys, xs, non_none_grads, cond_graph, body_graph, util.unique_grad_fn_name(body_graph.name),
        while_op, maximum_iterations, while_op.outputs[0], list_bound, recompute)

    unpushed = recompute and _unpush_recomputed_loops(body_grad_graph.recomputed)
    if body_grad_graph.while_op_needs_rewrite:
        # The forward op outputs the accumulators its gradient pops.
        suffix = f"_memsave{next(_uid)}"
        cond_graph.name += suffix
        body_graph.name += suffix
        new_inputs = body_grad_graph.extra_inputs
        new_outputs = body_graph.outputs[orig_num_params:]
        while_op._set_func_attr("cond", util.create_new_tf_function(cond_graph))
        while_op._set_func_attr("body", util.create_new_tf_function(body_graph))
        # Where its pushed lists start, for an enclosing recomputing
        # gradient (:func:`_unpush_recomputed_loops`).
        while_op._memsave_pushes_from = orig_num_params
        if len(body_graph.output_types) != len(while_op.inputs) + len(new_inputs):
            raise AssertionError(
                "this is a bug in memsave: the rewritten loop "
                f"{while_op.name!r} has {len(body_graph.output_types)} outputs for "
                f"{len(while_op.inputs)} + {len(new_inputs)} inputs")
        while_op._set_type_list_attr("T", body_graph.output_types)
        while_op._set_shape_list_attr("output_shapes", body_graph.output_shapes)
        while_op._add_while_inputs(new_inputs)
        while_op._add_outputs([t.dtype for t in new_outputs], [t.shape for t in new_outputs])
        while_v2._copy_handle_data(new_outputs, while_op.outputs[orig_num_params:])
    elif unpushed:
        body_graph.name += f"_memsave{next(_uid)}"
        while_op._set_func_attr("body", util.create_new_tf_function(body_graph))
    while_op._set_attr("_num_original_outputs", attr_value_pb2.AttrValue(i=len(while_op.outputs)))

    # The trip count reads the forward op's outputs: only now that the op has
    # its final outputs (an enclosing recomputing gradient copies the op
    # when this is read).
    args = [args[0], args[1], _trips(while_op, steps, taper)] + list(args[3:])
    captured_inputs = while_v2._resolve_grad_captures(body_graph, body_grad_graph, while_op)
    loop_vars = args + captured_inputs
    loop_vars = while_v2_indexed_slices_rewriter.rewrite_grad_indexed_slices(
        grads, body_grad_graph, loop_vars, while_op.inputs)

    def grad_cond(counter, unused_maximum_iterations_arg, forward_loop_iters, *unused_args):
        return counter < forward_loop_iters

    grad_cond_name = util.unique_grad_fn_name(op.get_attr("cond").name)
    cond_grad_graph = func_graph_module.func_graph_from_py_func(
        grad_cond_name, grad_cond, loop_vars, {},
        func_graph=util.WhileCondFuncGraph(grad_cond_name))
    while_v2._check_num_inputs_outputs(cond_grad_graph, body_grad_graph, len(loop_vars))
    outputs = while_v2._build_while_op(
        loop_vars, cond_grad_graph, body_grad_graph,
        output_shapes=[t.shape for t in body_grad_graph.outputs],
        parallel_iterations=parallel_iterations, name=f"{while_op.name}_grad",
        num_original_outputs=len(body_grad_graph.outputs))
    # The TensorLists the gradient loop reads from the forward pass (an input
    # sequence its trips are recomputed from) leave it as outputs nobody
    # reads, dropped when the executor gets to them: the gradient's readers
    # could allocate first (its input sequence's gradient, stacked: measured
    # on a GRU(128) reading an LSTM's outputs, T=128, batch 1024, three
    # sequences alive in four runs out of six). They wait for an op that
    # reads each such list, whose inputs are released before its successors
    # run. (Variants TensorFlow did not record as lists are left alone.)
    released = [list_ops.tensor_list_length(t, name="release") for t in outputs[len(args):]
                if t.dtype == tf.variant and _list_item(t) is not None]
    with tf.control_dependencies(released):
        outputs = [tf.identity(t) for t in outputs]
    return while_v2._get_structured_grad_output(outputs, grads, body_grad_graph)


def _unpush_recomputed_loops(recomputed) -> bool:
    """Stop the forward ops of nested loops from filling their gradients'
    accumulators; True if any was changed.

    A loop nested in a recomputed body is differentiated where it stands,
    in the forward body: its gradient makes the forward op push each trip's
    state (with a chunk's ``inner="store"``, every intermediate the
    gradient reads) onto TensorLists, and the backward body reads them from
    its recomputed copy of the op. The forward op's own lists are read by
    nobody, yet it filled them: a chunk's pushed values were held until the
    chunk ended (experiments/bench_loops.py, ``tf.scan`` at T=1000,
    chunk(k=16, inner=store): 1065.5 -> 1032.0 MiB above resident at the
    forward pass's end). Such an op gets a body that passes the lists
    through unfilled; its copy in the backward body keeps the filling one.
    """
    changed = False
    for op in recomputed:
        start = getattr(op, "_memsave_pushes_from", None)
        if start is None or any(t.consumers() for t in op.outputs[start:]):
            continue
        body = function_graphs(op)[1]
        name = f"{body.name}_unpushed"

        def unpushed(*args, body=body, start=start):
            while_v2._copy_handle_data(body.inputs, args)  # pylint: disable=protected-access
            outs = inline(body, args, roots=body.outputs[:start] + list(body.control_outputs))
            return outs[:start] + list(args[start:])

        # Built in the op's graph: a FuncGraph's outer graph is the default
        # graph when it is made, and a later gradient of ``op`` (a second
        # order: the gradient of a gradient that reads this loop) creates
        # its accumulators there.
        auto_deps = op.graph._add_control_dependencies  # pylint: disable=protected-access
        with op.graph.as_default():
            new = func_graph_module.func_graph_from_py_func(
                name, unpushed, [], {},
                signature=[tensor_spec.TensorSpec(t.shape, t.dtype) for t in body.inputs],
                func_graph=util.WhileBodyFuncGraph(name), add_control_dependencies=auto_deps)
        # Pass-throughs stay the same tensor, as in while_v2's bodies (its
        # gradient recognises loop invariants that way).
        new.outputs = [i if j >= start or body.outputs[j] is body.inputs[j] else o
                       for j, (i, o) in enumerate(zip(new.inputs, new.outputs))]
        op._set_func_attr("body", util.create_new_tf_function(new))  # pylint: disable=protected-access
        op._body_graph = new  # pylint: disable=protected-access
        del op._memsave_pushes_from  # pylint: disable=protected-access
        changed = True
    return changed


def _lazy_zeros(grad, while_op, i):
    """The incoming gradient of a TensorList ``output``; for the zeros
    ``tf.gradients`` makes of a list nobody differentiates (``ZerosLike`` of
    it: every item a zero tensor), a list of as many unset items instead.

    ``tf.gradients`` makes those zeros where the forward pass ends (they
    read only the list), so the list's and the zeros' items stay alive until
    the loop's gradient: a ``tf.scan`` over (h, c) returns both sequences,
    and a step that reads only h held c's and its zeros, 1 MiB per trip of
    an LSTM(128) at batch 1024. An unset item reads as zeros (TensorList
    reads are given the item's shape), so nothing changes but the memory.
    The zeros of a list the loop passes through unchanged (an input
    sequence it reads items of) may be made of the loop's input instead, as
    a gradient graph captures it: in a chunked loop's gradient, every chunk's
    were T zero items (measured on a GRU(128) reading an LSTM's outputs,
    T=128, batch 1024: 119 MiB of zeros at the step's peak).
    Only for items of a static shape; other gradients are returned as given.
    """
    output = while_op.outputs[i]
    if grad is None or grad.dtype != tf.variant or grad.op.type != "ZerosLike":
        return grad
    item = _list_item(output)
    if item is None or not item[0].is_fully_defined():
        return grad
    of = grad.op.inputs[0]
    if of is output:
        length = _output_length(while_op, i)
    elif (_tf_private.captured_outer(of) is while_op.inputs[i]
          and i in invariant_positions(while_op)):
        length = list_ops.tensor_list_length(of)  # (it reads what the zeros read)
    else:
        return grad
    return list_ops.tensor_list_reserve(
        element_shape=item[0].as_list(), num_elements=length,
        element_dtype=item[1], name="unset_gradient")


def _one_item(grad, while_op, i):
    """The incoming gradient of a TensorList ``output``; for the gradient of
    one item of it, stacked (``tf.scan(...)[-1]``: ``TensorListFromTensor``
    of the ``StridedSliceGrad`` of one index), a list of unset items with
    that one item set instead.

    ``tf.gradients`` builds the gradient of ``stack(list)[i]`` as a dense
    zero tensor of the whole sequence with one item filled in, then unstacks
    it into a list of as many items: two sequence-sized buffers (1 GiB for
    an LSTM(128) over 1000 trips at batch 1024) alive when the loop's
    gradient starts, for one item of gradient. The list built here holds
    that item only; unset items read as zeros (item shape static), so the
    values are the same. Other gradients are returned as given.
    """
    if grad is None or grad.dtype != tf.variant or grad.op.type != "TensorListFromTensor":
        return grad
    output = while_op.outputs[i]
    dense = grad.op.inputs[0]
    item = _list_item(output)
    if dense.op.type != "StridedSliceGrad" or item is None or not item[0].is_fully_defined():
        return grad
    sliced = dense.op
    begin, end, strides = (_tf_private.static_value(sliced.inputs[k]) for k in (1, 2, 3))
    masks = {a: sliced.get_attr(a) for a in ("begin_mask", "end_mask", "ellipsis_mask",
                                            "new_axis_mask", "shrink_axis_mask")}
    one_index = (begin is not None and end is not None and strides is not None
                 and len(begin) == len(strides) == 1 and int(strides[0]) == 1
                 and masks == {"begin_mask": 0, "end_mask": 0, "ellipsis_mask": 0,
                               "new_axis_mask": 0, "shrink_axis_mask": 1})
    dy = sliced.inputs[4]
    if not one_index or not dy.shape.is_compatible_with(item[0]) or dy.dtype != item[1]:
        return grad
    with ops.name_scope("one_item_gradient"):
        length = _output_length(while_op, i)
        index = int(begin[0])
        at = length + index if index < 0 else tf.constant(index, tf.int32)
        unset = list_ops.tensor_list_reserve(item[0].as_list(), length, item[1])
        return list_ops.tensor_list_set_item(unset, at, dy)


def _output_length(while_op, i) -> tf.Tensor:
    """The length of the TensorList ``while_op`` outputs at ``i``, read so
    that nothing holds that output: a list the loop only writes
    (:func:`written_only`) is as long as it came in.

    An op that reads the output (``TensorListLength``) keeps every item of
    it alive until it runs, which the executor may put off past the next
    large allocation: a ``tf.scan``'s unread c sequence beside the stacked
    h sequence, in one run out of two.
    """
    if not written_only(while_op, i):
        return list_ops.tensor_list_length(while_op.outputs[i])
    length = _entry_length(while_op, i)
    return constant_op.constant(length, tf.int32) if isinstance(length, int) else length


def _entry_length(while_op, i):
    """The length of ``while_op``'s TensorList input ``i``: an int when it
    follows from constants, else a tensor in ``while_op``'s graph."""
    entry = while_op.inputs[i]
    with entry.graph.as_default(), util.clear_control_inputs():
        length = list_ops.tensor_list_length(entry)
    known = _tf_private.static_value(length)
    return length if known is None else int(known)


def _list_item(list_tensor):
    """(shape, dtype) of the items of a TensorList tensor, from its handle
    data; None when TensorFlow did not record them."""
    data = handle_data_util.get_resource_handle_data(list_tensor)
    if not data.is_set or len(data.shape_and_type) != 1:
        return None
    item = data.shape_and_type[0]
    return tf.TensorShape(item.shape), tf.dtypes.as_dtype(item.dtype)


def _trips(while_op: tf.Operation, steps: int, taper: int = 0) -> tf.Tensor:
    """Trips of ``while_op`` that its gradient loop runs backwards.

    while_v2 reads the counter's final value (it starts at 0). A chunked
    loop's counter counts the original trips, ``steps`` per trip of its own
    (tapered: the chunks :func:`taper_tables` counts); a chunk's inner loop
    starts where the previous chunk stopped.
    """
    done = while_op.outputs[0] - while_op.inputs[0]
    if steps == 1:
        return done
    if taper:
        return _chunks_for(done, steps, taper)
    return (done + (steps - 1)) // steps


def _list_bound(while_op: tf.Operation, steps: int, bound: int, taper: int = 0) -> tf.Tensor:
    """The accumulators' ``max_num_elements``, in the forward op's graph."""
    with while_op.graph.as_default(), util.clear_control_inputs():
        if bound > 0:
            return constant_op.constant(bound, dtype=while_op.inputs[1].dtype, name="trip_bound")
        limit = while_op.inputs[1]
        if steps == 1:
            return limit
        known = _tf_private.static_value(limit)
        if known is not None:
            if int(known) < 0:
                value = -1
            elif taper:
                value = len(loopmodel.tapered_chunks(steps, int(known)))
            else:
                value = -(-int(known) // steps)
            return constant_op.constant(value, dtype=limit.dtype, name="trip_bound")
        chunks = _chunks_for(limit, steps, taper) if taper else (limit + (steps - 1)) // steps
        return tf.where(limit < 0, tf.constant(-1, limit.dtype), chunks)


def _create_grad_func(ys, xs, grads, cond_graph, body_graph, name, while_op, maximum_iterations,
                      total_iters, list_bound, recompute):
    """``while_v2._create_grad_func``, with memsave's graph class and trip count."""
    counter = constant_op.constant(0, dtype=total_iters.dtype, name="grad_counter")
    body_graph_inputs = object_identity.ObjectIdentitySet(body_graph.inputs)
    body_graph_outputs = object_identity.ObjectIdentitySet(body_graph.outputs)
    args = [counter, maximum_iterations, total_iters] + list(grads)
    grad_func_graph = func_graph_module.func_graph_from_py_func(
        name, lambda *args: _grad_fn(ys, xs, args, body_graph), args, {},
        func_graph=_RecomputingGradGraph(
            name, cond_graph, body_graph, list_bound, while_op, body_graph_inputs,
            body_graph_outputs, recompute=recompute))
    for external_capture, internal_capture in grad_func_graph.captures:
        key = ops.tensor_id(internal_capture)
        if key not in grad_func_graph.internal_capture_to_output:
            raise ValueError(
                f"Tensor {internal_capture} which captures {external_capture} is in list of "
                "internal_captures but not in internal_capture_to_output.")
        new_output = grad_func_graph.internal_capture_to_output[key]
        grad_func_graph.outputs.append(new_output)
        grad_func_graph.structured_outputs.append(new_output)
    return grad_func_graph, args


def _grad_fn(ys, xs, args, func_graph):
    """``while_v2._grad_fn``: the gate is made from this trip's incoming
    gradients before the body is differentiated."""
    graph = ops.get_default_graph()
    grad_ys = args[3:]
    graph.make_gate(grad_ys)
    grad_outs = gradients_util._GradientsHelper(  # pylint: disable=protected-access
        ys, xs, grad_ys=grad_ys, src_graph=func_graph, unconnected_gradients="zero")
    if any(g is None for g in grad_outs):
        raise AssertionError("this is a bug in memsave: a loop body gradient is None")
    return [args[0] + 1, args[1], args[2]] + grad_outs


class _RecomputingGradGraph(while_v2._WhileBodyGradFuncGraph):  # pylint: disable=protected-access
    """The backward body: recompute what the gradient reads from the loop state.

    With ``recompute=False`` it is while_v2's own graph (every tensor the
    gradient reads is accumulated), used with a trip count and list size of
    memsave's choosing.

    Attributes
    ----------
    gate : tf.Tensor or None
        A float32 zero computed from this trip's incoming gradient.
    recomputed : list of tf.Operation
        Forward-body ops copied into this graph.
    stored : list of tf.Tensor
        Forward-body tensors accumulated (the loop state, what must not run
        twice), in the order they were first read.
    """

    def __init__(self, name, forward_cond_graph, forward_body_graph, list_bound,
                 forward_while_op, body_graph_inputs, body_graph_outputs, *, recompute: bool):
        super().__init__(name, forward_cond_graph, forward_body_graph, list_bound,
                         forward_while_op, body_graph_inputs, body_graph_outputs)
        self._recompute = recompute
        self._inputs = object_identity.ObjectIdentitySet(forward_body_graph.inputs)
        self._invariant = object_identity.ObjectIdentitySet(
            t for t, o in zip(forward_body_graph.inputs, forward_body_graph.outputs) if t is o)
        self._written = _written_resources(forward_body_graph)
        self.gate = None
        self._waits: list = []
        self.recomputed: list = []
        self.stored: list = []
        self._copies: dict = {}
        self._invariants: dict = {}

    # -- the gate ----------------------------------------------------------

    def make_gate(self, grads) -> None:
        """Make :attr:`gate` from this trip's incoming gradients.

        Every gradient decides: the first element of each floating one (the
        state read through ``+ gate`` and every copy, by a control edge,
        wait for them), and the others (TensorLists) by control edges. One
        gradient alone is not enough: an unread output's gradient is zeros
        that exist before the step's loss does (a ``tf.scan`` over (h, c)
        whose loss reads the h sequence only gets zeros for the final h and
        c), and a gate on it let the first trips' recomputation run during
        the end of the forward pass (measured: the recomputed chunk beside
        the stacked sequence, +50% at the peak). With no floating gradient
        the copies wait by control edges alone, which XLA does not need (it
        runs one trip at a time).
        """
        floats = [g for g in grads if g.dtype.is_floating]
        with self.control_dependencies(None):
            self._waits = [tf.identity(g).op for g in grads if not g.dtype.is_floating]
            if not floats:
                return
            firsts = tf.concat([tf.cast(tf.reshape(g, [-1])[:1], tf.float32) for g in floats], 0)
            firsts = tf.where(tf.math.is_nan(firsts), tf.zeros_like(firsts), firsts)
            # Always -0.0 (_tf_private.GATE_ZERO: negative, so that a -0.0
            # state comes back as -0.0), but no compiler can prove it
            # without the values.
            self.gate = tf.where(tf.reduce_all(tf.equal(firsts, firsts)),
                                 tf.constant(_tf_private.GATE_ZERO),
                                 tf.constant(float("nan")), name="recompute_gate")
            self._waits.append(self.gate.op)

    # -- capturing forward-body tensors ------------------------------------

    def _capture_helper(self, tensor, name):
        if not self._recompute or tensor.graph is not self._forward_graph:
            return super()._capture_helper(tensor, name)
        found = self._indirect_captures.get(ops.tensor_id(tensor))
        if found is not None:
            return found
        source = self._passed_through(tensor)
        if source is not tensor:
            found = self._indirect_captures[ops.tensor_id(tensor)] = self._capture_helper(source, name)
            return found
        if self._kept(tensor):
            unset = self._unset_list(tensor)
            return self._keep(tensor, name) if unset is None else unset
        # Copy the producers, inputs first (iterative: bodies can be deep).
        # An op copied before it grew outputs (a nested loop rewritten by its
        # own gradient after a first read) is copied again.
        stack = [tensor.op]
        while stack:
            op = stack[-1]
            if all(ops.tensor_id(o) in self._indirect_captures for o in op.outputs):
                stack.pop()
                continue
            inputs, missing = [], []
            for t in op.inputs:
                got = self._indirect_captures.get(ops.tensor_id(t))
                if got is None and (self._kept(t) or self._passed_through(t) is not t):
                    got = self._capture_helper(t, t.op.name)
                if got is None:
                    missing.append(t.op)
                inputs.append(got)
            if missing:
                stack.extend(missing)
                continue
            self._copy(op, inputs)
            stack.pop()
        return self._indirect_captures[ops.tensor_id(tensor)]

    def _passed_through(self, t):
        """The input a nested loop passes through as output ``t`` (the same
        value: read, it costs no copy of the loop), else ``t``."""
        while t.op.type in _tf_private.WHILE_OP_TYPES and t.dtype != tf.resource:
            op = t.op
            if op not in self._invariants:
                self._invariants[op] = invariant_positions(op)
            if t.value_index not in self._invariants[op]:
                break
            t = op.inputs[t.value_index]
        return t

    def _kept(self, t) -> bool:
        """Whether ``t`` is read as while_v2 reads it (not recomputed)."""
        op = t.op
        if t in self._inputs or t.dtype == tf.resource or constant_op.is_constant(t):
            return True
        if op.type in _MOVED_TYPES and op in self._moved():
            return True
        if op.type in _tf_private.READ_ONLY_STATEFUL_TYPES:
            # A read of a variable the loop writes: read again later, it
            # would see the new value.
            return any(ops.tensor_id(i) in self._written for i in op.inputs if i.dtype == tf.resource)
        return not _tf_private.is_recomputable(op)

    def _unset_list(self, t):
        """For a TensorList of the loop state that the body only writes (the
        outputs a ``tf.scan`` or a TensorArray collects): a list of as many
        unset items, which the recomputed trips write into, instead of the
        stored one. None for any other tensor (it is stored).

        The recomputed values never read the list's items; stored, it would
        keep each trip's items (the value at that trip holds every item
        written so far) until the backward trip pops it: a chunked
        ``tf.scan`` over an LSTM's (h, c) held both output sequences through
        the whole gradient.
        """
        if t.dtype != tf.variant or t not in self._inputs or t in self._invariant:
            return None
        j = next(i for i, x in enumerate(self._forward_graph.inputs) if x is t)
        item = _list_item(t)
        if item is None or not written_only(self._forward_while_op, j):
            return None
        length = _entry_length(self._forward_while_op, j)
        if isinstance(length, int):
            with self.control_dependencies(None):
                length = constant_op.constant(length, tf.int32)
        elif _tf_private.in_xla_context(self):
            return None  # XLA needs the list's size at compile time
        else:
            length = self._capture_helper(length, "list_length")
        with self.control_dependencies(None):
            got = list_ops.tensor_list_reserve(item[0], length, item[1], name="unset_list")
        self._indirect_captures[ops.tensor_id(t)] = got
        return got

    def _moved(self):
        cache = getattr(self._forward_graph, "_optimized_reduction_ops_cache", None)
        return object_identity.ObjectIdentitySet(cache.values()) if cache else ()

    def _keep(self, t, name):
        got = super()._capture_helper(t, name)
        if t in self._inputs and t not in self._invariant:
            self.stored.append(t)
            if self.gate is not None and (got.dtype.is_floating or got.dtype.is_integer):
                with self.control_dependencies(None):
                    got = tf.math.add(got, tf.cast(self.gate, got.dtype), name="gated")
                self._indirect_captures[ops.tensor_id(t)] = got
        elif t not in self._inputs and t.dtype != tf.resource and not constant_op.is_constant(t):
            self.stored.append(t)
        return got

    def _copy(self, op, inputs) -> None:
        _import_functions(op, self)
        name = self.unique_name(f"recompute/{op.name}")
        with self.control_dependencies(None), self.control_dependencies(self._waits):
            new = _tf_private.copy_op(op, inputs, name=name, graph=self)
        earlier = self._copies.get(op)
        if earlier is not None:
            # ``op`` grew outputs since it was copied (a nested loop, which
            # its own gradient rewrote after while_v2 read one of its
            # outputs): the earlier copy's readers read the new copy, so
            # the loop runs once per trip, not twice.
            for old_out, new_out in zip(earlier.outputs, new.outputs):
                for consumer in old_out.consumers():
                    for i, t in enumerate(consumer.inputs):
                        if t is old_out:
                            _tf_private.update_input(consumer, i, new_out)
        self._copies[op] = new
        for src, dst in zip(op.outputs, new.outputs):
            self._indirect_captures[ops.tensor_id(src)] = dst
        self.recomputed.append(op)


#: Ops that read a TensorList's length or item shape, not its items.
_LIST_METADATA_TYPES = frozenset({"TensorListLength", "TensorListElementShape"})


def written_only(op: tf.Operation, position: int) -> bool:
    """Whether the loop ``op`` only writes the TensorList at input ``position``:
    its body sets items (``TensorListSetItem`` at a valid index: a
    TensorArray's ``write``, what ``tf.scan`` and ``tf.map_fn`` collect their
    outputs with), reads its length or item shape, and passes it on, also
    through loops nested in the body (checked the same way); its cond does
    not read it. No item of such a list decides a value of a trip.
    """
    stack = [(op, position)]
    while stack:
        loop, j = stack.pop()
        cond_graph, body_graph = function_graphs(loop)
        if cond_graph.inputs[j].consumers():
            return False
        values, seen = [body_graph.inputs[j]], set()
        while values:
            v = values.pop()
            if ops.tensor_id(v) in seen:
                continue
            seen.add(ops.tensor_id(v))
            for reader in v.consumers():
                if reader.type in _LIST_METADATA_TYPES:
                    continue
                if reader.type == "Identity":
                    values.append(reader.outputs[0])
                elif (reader.type == "TensorListSetItem" and reader.inputs[0] is v
                      and reader.inputs[2] is not v
                      and not reader.get_attr("resize_if_index_out_of_bounds")):
                    values.append(reader.outputs[0])
                elif reader.type in _tf_private.WHILE_OP_TYPES:
                    for i, x in enumerate(reader.inputs):
                        if x is v:
                            stack.append((reader, i))
                            values.append(reader.outputs[i])
                else:
                    return False
    return True


def list_setters(body_graph) -> list:
    """The ``TensorListSetItem`` ops of a loop body whose gradient
    :func:`_set_item_gradient` builds: those writing a numeric item of a
    static shape at an index inside the list.

    TensorFlow's gradient of ``TensorListSetItem`` reads the item's
    gradient from the list's, then sets that item of the list's gradient to
    ``zeros_like(item)`` (the value before the write did not reach the
    output). The list's gradient is loop state: those zeros, a new buffer
    each trip, stay in it to the end of the backward loop (measured on a
    chunked ``tf.scan`` of an LSTM cell over (h, c), T=200, batch 1024: 390
    zero items of 0.5 MiB, the whole peak of the step, 229 MiB). The same
    zeros can be one buffer: a zero tensor made once, outside the backward
    loop, that every trip's write refers to (the peak then is the forward
    loop's end, 227 MiB, forecast 214.5).
    """
    return [op for op in body_graph.get_operations()
            if op.type == "TensorListSetItem" and _item_shape(op) is not None
            and op.inputs[2].dtype not in (tf.variant, tf.resource, tf.string)
            and not op.get_attr("resize_if_index_out_of_bounds")]


def _item_shape(setter: tf.Operation) -> tf.TensorShape | None:
    """The static shape of the item ``setter`` writes, else of the list's
    items (its handle data), else None. A body imported from its
    FunctionDef (a chunk's inner loop) can lack the first: the import infers
    shapes without the handle data of the variables it captures, so after
    a read of one (an LSTM's bias) the items have none; the lists' handle
    data are copied from the loop's inputs. Without a shape, TensorFlow's
    gradient of each write keeps a new zero item per trip (measured on
    ``bench_loops.py``'s ``tf.scan`` at T=1000, chunk(k=16, inner=store):
    593 zero items, 296 MiB, held at the end of the backward loop)."""
    shape = setter.inputs[2].shape
    if shape.is_fully_defined():
        return shape
    item = _list_item(setter.inputs[0])
    if item is None or item[1] != setter.inputs[2].dtype or not item[0].is_fully_defined():
        return None
    return item[0] if shape.is_compatible_with(item[0]) else None


def _set_item_gradient(op, dlist):
    """``TensorListSetItem``'s gradient for :func:`list_setters`: TensorFlow's,
    with the item's zeros made once, outside the backward loop being built."""
    _, index, item = op.inputs
    shape = _item_shape(op)
    body = ops.get_default_graph()
    with body.outer_graph.as_default(), util.clear_control_inputs():
        zeros = tf.zeros(shape, item.dtype, name="zero_item")
    list_grad = list_ops.tensor_list_set_item(dlist, index, zeros)
    item_grad = list_ops.tensor_list_get_item(dlist, index, element_shape=shape,
                                              element_dtype=item.dtype)
    return list_grad, None, item_grad


def _written_resources(body_graph) -> set:
    """Ids of the resource tensors of ``body_graph`` that an op of the body
    writes (a stateful op not of the read-only types): reads of those are
    kept, not recomputed. Writes outside the loop are not looked for: as
    everywhere in memsave, variables are assumed to be updated after the
    gradients (an optimizer), so a recomputed read sees the value the
    forward pass read."""
    written = set()
    for op in body_graph.get_operations():
        if op._is_stateful and op.type not in _tf_private.READ_ONLY_STATEFUL_TYPES:  # pylint: disable=protected-access
            written.update(ops.tensor_id(t) for t in op.inputs if t.dtype == tf.resource)
    return written


def _import_functions(op: tf.Operation, graph) -> None:
    """Register in ``graph`` the functions ``op`` calls (found from ``op``'s graph)."""
    for value in op.node_def.attr.values():
        names = [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
        for name in names:
            if not name or graph._get_function(name) is not None:  # pylint: disable=protected-access
                continue
            fn = _tf_private.find_function(op.graph, name)
            if fn is not None:
                graph._add_function_recursive(fn)  # pylint: disable=protected-access


# -- reading the input sequence in place -----------------------------------------

def read_sequences_in_place(op: tf.Operation, positions) -> tuple[int, ...]:
    """Make ``op``'s body read items of its input sequences from the tensors
    they were unstacked from; return the new input positions of those tensors.

    A Keras RNN unstacks its input into a TensorList before the loop
    (``TensorListFromTensor(transpose(x, [1, 0, 2]))``, and
    ``reverse(transpose(...), [0])`` first with ``go_backwards``, the
    backward half of a ``Bidirectional``; tf.scan and map_fn
    ``TensorListFromTensor(elems)``) and its body reads trip t's item
    (``TensorListGetItem``). The list is a copy of the input (and the
    transpose and the reverse others): a loop that stores only its state
    still holds it until its gradient, and building it holds two copies at
    the start of the step. For each loop-invariant input at ``positions``
    (inputs nobody needs a gradient of) that is such a list, read only by
    ``TensorListGetItem``, the body reads ``gather(x, t, axis)`` from the
    source tensor instead (a new loop input), and the op gets a list of
    unset items in the list's place (nothing then computes the copies).
    Rewrites ``op`` in place.
    Under XLA, a list whose items' shape is not fully known (an unknown
    batch) is left alone: XLA needs the size of the list left in its place
    ("TensorList is not initialized" at run time).
    """
    # pylint: disable=protected-access
    cond_graph, body_graph = function_graphs(op)
    xla = _tf_private.in_xla_context(op.graph)
    found = []
    for j in positions:
        source = _unstacked_source(op.inputs[j])
        if source is None:
            continue
        x, axis, perm, reverse = source
        placeholder = body_graph.inputs[j]
        reads = [c for c in placeholder.consumers()]
        if not reads or any(c.type != "TensorListGetItem" or c.inputs[0] is not placeholder
                            for c in reads):
            continue
        if any(c.graph is cond_graph for c in cond_graph.inputs[j].consumers()):
            continue  # the cond reads the list
        if xla and not all(r.outputs[0].shape.is_fully_defined() for r in reads):
            continue
        found.append((j, x, axis, perm, reverse, reads))
    if not found:
        return ()
    new_positions = []
    for j, x, axis, perm, reverse, reads in found:
        with body_graph.as_default():
            x_in = body_graph.capture(x)
            for read in reads:
                with ops.name_scope(None), ops.name_scope(read.name + "_in_place"):
                    index = read.inputs[1]
                    if reverse:  # item i of the reversed sequence
                        index = tf.shape(x_in, out_type=index.dtype)[axis] - 1 - index
                    item = tf.gather(x_in, index, axis=axis)
                    if perm is not None:
                        item = tf.transpose(item, perm)
                    item.set_shape(read.outputs[0].shape)
                _replace_uses(read.outputs[0], item, body_graph)
        body_graph.outputs.append(x_in)
        with cond_graph.as_default():
            cond_graph.capture(x)
        new_positions.append(len(op.inputs) + len(new_positions))
    suffix = f"_memsave{next(_uid)}"
    cond_graph.name += suffix
    body_graph.name += suffix
    added = [x for _, x, *_ in found]
    op._set_func_attr("cond", util.create_new_tf_function(cond_graph))
    op._set_func_attr("body", util.create_new_tf_function(body_graph))
    op._set_type_list_attr("T", body_graph.output_types)
    op._set_shape_list_attr("output_shapes", body_graph.output_shapes)
    op._add_while_inputs(added)
    op._add_outputs([x.dtype for x in added], [x.shape for x in added])
    op._set_attr("_num_original_outputs", attr_value_pb2.AttrValue(i=len(op.outputs)))
    op._cond_graph, op._body_graph = cond_graph, body_graph
    with op.graph.as_default(), util.clear_control_inputs(), \
            op.graph.colocate_with(op, ignore_existing=True):
        for j, x, axis, *_ in found:
            # Unset items: read (by an op TensorFlow did not prune) as zeros.
            item = _list_item(op.inputs[j])
            shape = None if item is None else item[0]
            length = tf.shape(x, out_type=tf.int32)[axis]
            _tf_private.update_input(op, j, list_ops.tensor_list_reserve(
                shape, length, element_dtype=x.dtype, name="unread_sequence"))
    return tuple(new_positions)


def _unstacked_source(t):
    """(x, axis, perm, reverse) when ``t`` is ``TensorListFromTensor`` of
    ``x``, of ``transpose(x, p)``, or of either reversed along the
    sequence (``reverse(..., [0])``): item i is ``gather(x, i, axis)``
    (``gather(x, n - 1 - i, axis)`` when ``reverse``, n the sequence's
    length), transposed by ``perm`` (None: no transpose). Else None."""
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    if t.dtype != tf.variant or t.op.type != "TensorListFromTensor":
        return None
    x = t.op.inputs[0]
    if x.shape.rank is None or x.shape.rank < 1:
        return None
    reverse = False
    if x.op.type == "ReverseV2":
        dims = tf.get_static_value(x.op.inputs[1])
        if dims is not None and [int(d) % x.shape.rank for d in dims.reshape(-1)] == [0]:
            reverse, x = True, x.op.inputs[0]
    if x.op.type != "Transpose":
        return x, 0, None, reverse
    p = tf.get_static_value(x.op.inputs[1])
    src = x.op.inputs[0]
    if p is None or src.shape.rank != len(p):
        return x, 0, None, reverse
    p = [int(v) for v in p]
    axis = p[0]
    rest = [d for d in range(len(p)) if d != axis]
    perm = [rest.index(d) for d in p[1:]]
    return src, axis, None if perm == sorted(perm) else perm, reverse


def _replace_uses(old, new, graph) -> None:
    """Make every reader of ``old`` in ``graph`` (and its outputs) read ``new``."""
    for consumer in old.consumers():
        if consumer is new.op:
            continue
        for i, t in enumerate(consumer.inputs):
            if t is old:
                _tf_private.update_input(consumer, i, new)
    graph.outputs = [new if t is old else t for t in graph.outputs]


# -- k-step chunks ---------------------------------------------------------------

def taper_tables(steps: int, length: int) -> tuple[list[int], list[int]]:
    """Tables of the tapered chunks of ``loopmodel.tapered_chunks(steps, .)``
    (``steps``, ``steps - 1``, ..., 1 trips, then 1 each): for each trip c in
    ``[0, length]``, the trips left in the chunk c falls in (read at a
    chunk's first trip: its size), and the chunks that c trips make."""
    sizes, counts = [], []
    for j, n in enumerate(loopmodel.tapered_chunks(steps, length + 1)):
        sizes.extend(range(n, 0, -1))
        counts.extend([j] + [j + 1] * (n - 1))
    return sizes, counts


def _chunks_for(done: tf.Tensor, steps: int, length: int) -> tf.Tensor:
    """The number of tapered chunks ``done`` trips make (an int tensor; past
    the tables, chunks of one trip), as ``loopmodel.tapered_chunks``."""
    counts = tf.constant(taper_tables(steps, length)[1], dtype=done.dtype)
    top = tf.constant(length, done.dtype)
    return tf.gather(counts, tf.minimum(done, top)) + tf.maximum(done - top, 0)


def nest_in_chunks(op: tf.Operation, steps: int, *, inner_mode: str,
                   skip: tuple[int, ...] = (), taper: bool = False) -> tf.Operation:
    """Rewrite ``op``'s body, in place, into a loop of up to ``steps`` trips of
    the original body; mark the outer op (per step, ``steps`` trips each) and
    the inner loop (``inner_mode``, at most ``steps`` trips). With ``taper``,
    the chunks are ``steps``, ``steps - 1``, ..., 1 trips (then 1 each),
    looked up by the trip a chunk starts at in a table of ``steps *
    (steps + 1) / 2`` entries, or of the loop's trip count when it is
    known and smaller (:func:`taper_tables`). Returns the inner While op (in
    the new body)."""
    # pylint: disable=protected-access
    cond_graph, body_graph = function_graphs(op)
    shapes = [tf.TensorShape(s) for s in op.get_attr("output_shapes")]
    dtypes = [t.dtype for t in op.inputs]
    invariant = set(invariant_positions(op))
    uid = next(_uid)
    inner_ops = []
    length = 0
    if taper:
        length = steps * (steps + 1) // 2
        known = _tf_private.static_value(op.inputs[1])
        if known is not None and 0 <= int(known) < length:
            length = int(known)

    def chunk_body(*args):
        while_v2._copy_handle_data(op.inputs, args)
        counter, limit = args[0], args[1]
        # The inner loop counts from ``start`` to ``steps`` (a constant: XLA
        # compiles a loop whose limit depends on the outer trip only that
        # way), so that it stops after the chunk or at the outer limit.
        size = tf.constant(steps, limit.dtype)
        if taper:
            sizes = tf.constant(taper_tables(steps, length)[0], dtype=limit.dtype)
            size = tf.gather(sizes, tf.minimum(tf.cast(counter, limit.dtype),
                                               tf.constant(length, limit.dtype)))
        remaining = tf.where(limit < 0, size, limit - tf.cast(counter, limit.dtype))
        start = steps - tf.minimum(size, remaining)
        graph = ops.get_default_graph()
        inner_body = util.get_func_graph(op, shapes, op.get_attr("body").name)
        inner_body.name = f"{body_graph.name}_chunk{uid}"
        while_v2._copy_handle_data(op.inputs, inner_body.inputs)
        inner_cond = _chunk_cond(cond_graph, shapes, dtypes, f"{cond_graph.name}_chunk{uid}")
        inner_body.outer_graph = graph
        inner_cond.outer_graph = graph
        start = tf.cast(start, counter.dtype)
        outs = while_v2._build_while_op(
            [start, tf.constant(steps, limit.dtype), *args[2:]], inner_cond, inner_body,
            output_shapes=shapes, parallel_iterations=op.get_attr("parallel_iterations"), name="chunk",
            num_original_outputs=len(shapes))
        inner = outs[0].op
        mark(inner, mode=inner_mode, steps=1, bound=steps, skip=skip)
        inner_ops.append(inner)
        done = outs[0] - start
        return [counter + done, limit] + [outs[j] for j in range(2, len(outs))]

    name = f"{body_graph.name}_chunked{uid}"
    with op.graph.as_default():
        chunked = func_graph_module.func_graph_from_py_func(
            name, chunk_body, [], {},
            signature=[tensor_spec.TensorSpec(s, d) for s, d in zip(shapes, dtypes)],
            func_graph=util.WhileBodyFuncGraph(name),
            add_control_dependencies=op.graph._add_control_dependencies)
    # Pass invariants through as the same tensor, as while_v2's bodies do
    # (its gradient recognises loop invariants that way); the limit too (the
    # inner loop's start reads it: an invariant is not stored per chunk).
    outputs = list(chunked.outputs)
    for j in invariant | {1}:
        outputs[j] = chunked.inputs[j]
    chunked.outputs = outputs
    op._set_func_attr("body", util.create_new_tf_function(chunked))
    op._body_graph = chunked
    mark(op, mode="per_step", steps=steps, bound=0, skip=skip, taper=length)
    return inner_ops[0]


def _chunk_cond(cond_graph, shapes, dtypes, name):
    """A cond: the original one and ``counter < limit`` (the chunk's end;
    the original cond checks it too when the loop has a maximum_iterations)."""

    def cond(counter, limit, *rest):
        (pred,) = inline(cond_graph, [counter, limit, *rest])[:1]
        return tf.logical_and(counter < limit, pred)

    return func_graph_module.func_graph_from_py_func(
        name, cond, [], {},
        signature=[tensor_spec.TensorSpec(s, d) for s, d in zip(shapes, dtypes)],
        func_graph=util.WhileCondFuncGraph(name))


def inline(func_graph, inputs, roots=None) -> list:
    """Copy the ops of ``func_graph`` into the default graph, its inputs
    replaced by ``inputs``; return what its outputs became. With ``roots``
    (tensors and ops of ``func_graph``), only the ops they need are copied,
    and only the outputs among them are returned (the others: None)."""
    graph = ops.get_default_graph()
    mapping = {ops.tensor_id(p): t for p, t in zip(func_graph.inputs, inputs)}
    copied = {}
    placeholders = {p.op for p in func_graph.inputs}
    for op in _inputs_first(func_graph.get_operations() if roots is None else roots):
        if op in placeholders:
            continue
        _import_functions(op, graph)
        new = _tf_private.copy_op(op, [mapping[ops.tensor_id(t)] for t in op.inputs],
                                  name=graph.unique_name(op.name), graph=graph)
        controls = [copied[c] for c in op.control_inputs if c in copied]
        if controls:
            _tf_private.add_control_inputs(new, controls)
        copied[op] = new
        for src, dst in zip(op.outputs, new.outputs):
            mapping[ops.tensor_id(src)] = dst
    return [mapping.get(ops.tensor_id(t)) for t in func_graph.outputs]


def _inputs_first(roots) -> list:
    """The ops ``roots`` (tensors or ops) read, through data and control
    edges, themselves included, each after those it reads. (Not creation
    order: while_v2 adds inputs to a loop made earlier than them.)"""
    order, done = [], set()
    stack = [(r if isinstance(r, tf.Operation) else r.op, False) for r in reversed(list(roots))]
    while stack:
        op, expanded = stack.pop()
        if op in done:
            continue
        if expanded:
            done.add(op)
            order.append(op)
            continue
        stack.append((op, True))
        stack.extend((i, False) for i in op.control_inputs if i not in done)
        stack.extend((t.op, False) for t in op.inputs if t.op not in done)
    return order


_register()
