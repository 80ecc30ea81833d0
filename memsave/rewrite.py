"""Run a Schedule: copy segments, gate them on gradients, differentiate them.

Data flow, for each step of the schedule in order:

1. Sum what the earlier steps sent to each of the step's heads (the seeds
   are grad_ys on the ys).
2. ``recompute`` steps: make a *gate*, a boolean computed from the heads'
   incoming gradients (``b == b`` with ``b`` the gradient's first element,
   NaN replaced by 0: :func:`memsave.gates.ready`); under XLA a float32
   zero made from it (``where(ready, 0, nan)``, :func:`memsave.gates.gate`).
   Give the boundary tensors the schedule gates (``Step.gated``,
   :func:`memsave.schedule.gated_boundary`: the checkpoints; under XLA,
   which ignores control dependencies, every floating boundary tensor,
   variable reads too) a fresh proxy read through the gate,
   ``Select(ready, t, t)`` (a data dependency, which Grappler does not
   remove, and on a CPU no pass over ``t``: :func:`memsave.gates.select`),
   under XLA ``t + gate``; the others (weights) are read as they are. Copy
   the step's ops in
   topological order, reading proxies instead of gated tensors, on the
   devices of the originals and after the gate (through a proxy or a copy
   they read; a copy reading neither reads its weights through an Identity
   that waits, else gets a control dependency), so
   the segment is recomputed only once backprop reaches it (a training
   batch norm on the CPU is copied in inference mode on the forward pass's
   statistics: :func:`memsave._tf_private.copy_batch_norm_with_statistics`).
   What the copies wait for, like the gated reads of the heads' gradients,
   includes the gradients the previous step made (across backprop steps,
   whose ops wait for nothing, those of the steps before them too), so
   that no earlier weight gradient runs beside the step.
   Call the stock
   tf.gradients on the copies of the heads with respect to the boundary
   (the proxies where gated), with the heads' gradients read through the
   gate too (see "No shared inputs across steps" below). Its walk forward
   from the boundary stops at ops made before the step
   (:func:`memsave._tf_private.forward_walk_after`), so each call stays
   inside its own segment and building the whole graph stays linear in
   its size.
3. ``backprop`` steps (ops that must not be copied, such as variable reads):
   call the stock tf.gradients on the original ops, stopping at their inputs.
4. Outside XLA, make the step's gradient chain (the ops leading to
   gradients later steps take further) wait, op by op, for the leaf
   gradient ops beside it (a weight's ``x^T g``), so that no leaf is left
   holding its buffers while the chain runs on (:func:`_no_run_ahead`).
5. Add each returned gradient to what its boundary tensor has received.

Finally each x's gradient is the sum of what it received: dense gradients
with ``add_n``, IndexedSlices concatenated (kept sparse), a mix densified, as
tf.gradients aggregates them.

Devices: copies run on their originals' devices and proxies beside the
tensor they pass on. With ``colocate_gradients_with_ops`` (TF2's
``tf.gradients`` always sets it) the stock calls put each gradient op with
its forward op, and memsave puts its own ops in their place the same way:
the seeds with their y, each sum of a tensor's gradients with the tensor's
op. Without it they take the caller's device scope, as tf.gradients' do.

No shared inputs across steps
-----------------------------
A recompute step reads the gradients it receives through proxies of its own
(gated reads, like the checkpoints'), never the tensors themselves.
Reason: TensorFlow's graph passes may merge two ops that read one tensor.
oneDNN's ``MklLayoutRewritePass`` (on by default on CPU, run after Grappler,
so no Grappler option turns it off) merges a ``BiasAddGrad`` and a
``Conv2DBackpropFilter`` that read the same gradient into one node, without
checking whether a path joins them. On conv -> bias_add, step k's
``BiasAddGrad`` and step k+1's ``Conv2DBackpropFilter`` both read the
gradient step k sends to the conv output (Grappler removes the Identity
that tf.gradients puts on grad_ys), and step k+1's copies wait for step k's
gradients: the merged node waited for itself ("N nodes in a cycle"; in a
Session "Retval[i] does not have value"). A merge of two ops closes a loop
only if a path joins them. Every path memsave adds starts at what a step
receives or at the previous step's gradient ops, and ends at the step's gate,
proxies and copies. With the gradient proxies, a gradient is read by the
step that computed it and otherwise only by ops that wait for nothing
memsave adds (the receiving step's gate and proxies, a backprop step, a
sum): no memsave edge leads from one reader of a gradient to another, so no
merge of two readers, by any pass, can close a loop through memsave's edges.
The edges inside a step (step 4) lead from the leaf readers of a gradient
``g`` to ops that read what a chain reader of ``g`` made: the readers of
``g`` stay unjoined.
What two steps' ops still both read are tensors of the forward pass (inputs,
constants, kept tensors behind their per-step proxies); their readers in the
forward pass and in tf.gradients' own backward graph are joined by paths as
well, so a pass that merged those would break tf.gradients too. Merges of a
producer with its consumer (Conv2D + BiasAdd + Add) need the producer's
output to have no other reader; a kept tensor and a received gradient always
have one (the forward pass, the gate). Under XLA the proxy is ``g + 0`` on a
value XLA cannot predict: it stays, one elementwise add per step. Outside
XLA it is a select, which passes the buffer on (on a CPU).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Sequence

import tensorflow as tf

from memsave import _tf_private, gates
from memsave.extract import Extraction
from memsave.schedule import Schedule, Step
from memsave.xla_gradients import xla_gradient_for

__all__ = ["rewrite", "aggregate", "differentiate"]

logger = logging.getLogger(__name__)


def colocated(op: tf.Operation | None):
    """``colocate_with(op)``; nothing when ``op`` is None (no
    ``colocate_gradients_with_ops``)."""
    return contextlib.nullcontext() if op is None \
        else op.graph.colocate_with(op, ignore_existing=True)


def aggregate(grads: Sequence, *, dense: bool, near: tf.Operation | None = None):
    """Sum gradients of one tensor; IndexedSlices stay sparse unless ``dense``.
    ``near``: the op the sum is colocated with (the tensor's producer)."""
    if not grads:
        return None
    with colocated(near):
        sparse = [isinstance(g, tf.IndexedSlices) for g in grads]
        if all(sparse) and not dense:
            if len(grads) == 1:
                return grads[0]
            return tf.IndexedSlices(
                tf.concat([g.values for g in grads], axis=0),
                tf.concat([g.indices for g in grads], axis=0),
                grads[0].dense_shape,
            )
        dense_grads = [tf.convert_to_tensor(g) for g in grads]
        return dense_grads[0] if len(dense_grads) == 1 else tf.math.add_n(dense_grads)


def rewrite(
    ex: Extraction,
    schedule: Schedule,
    grad_ys: Sequence,
    *,
    stop_gradients: Sequence = (),
    gate_gradients: bool = False,
    aggregation_method=None,
    colocate_gradients_with_ops: bool = True,
) -> list:
    """Build the checkpointed backward graph; return one gradient list per x.

    ``grad_ys`` is aligned with ``ex.fg.ys`` and fully specified (no None).
    The returned list is aligned with ``ex.fg.xs``; an entry is None when
    nothing reached that x. ``stop_gradients`` are the caller's: the forward
    graph leaves out the ops that produce them, but a backprop step runs the
    stock tf.gradients on original ops, whose walk would go through them.
    """
    fg = ex.fg
    received: dict[int, list] = collections.defaultdict(list)
    y_values = [ex.tensors[y] for y in fg.ys]
    # Under XLA the seeds wait for the ys by a data dependency (see _after_forward).
    y_gate = gates.gate(y_values) if fg.xla else None
    for y, gy in zip(fg.ys, grad_ys):
        with colocated(ex.tensors[y].op if colocate_gradients_with_ops else None):
            received[y].append(_after_forward(gy, [t.op for t in y_values], y_gate))
    stock = dict(
        gate_gradients=gate_gradients,
        aggregation_method=aggregation_method,
        colocate_gradients_with_ops=colocate_gradients_with_ops,
    )

    xla = ex.fg.xla
    # A float16 step updates its weights after a loss scale's finite check,
    # at the step's end: its ordered gates are computed once (_ordered_after_step).
    half = xla and fg.computes_in_float16()
    previous: list = []
    # Per step, the boundary tensors whose gradients later steps take
    # further (their heads); the others' gradients are leaves (weights, inputs).
    through = [_passes_through(ex, step) for step in schedule.steps]
    deeper: list[set] = []
    later: set = set()
    for step, passes in zip(reversed(schedule.steps), reversed(through)):
        deeper.append(later)
        if not passes:
            later = later | set(step.heads)
    deeper.reverse()
    for k, step in enumerate(schedule.steps):
        heads = [h for h in step.heads if received.get(h)]
        if not heads or not step.boundary:
            continue
        if through[k]:
            # Variable reads: each handle receives its read's gradients as they
            # are (what tf.gradients would build, without a call per step).
            previous = previous + _pass_through(fg, step, received)
            continue
        head_grads = [aggregate(received[h], dense=True, near=ex.tensors[h].op
                                if colocate_gradients_with_ops else None) for h in heads]
        deep = [b in deeper[k] for b in step.boundary]
        with tf.name_scope(f"{step.kind}_{k}"):
            if step.kind == "recompute":
                grads = _recompute(ex, step, heads, head_grads, stock, previous, deep, xla=xla)
            else:
                grads = differentiate(
                    [ex.tensors[h] for h in heads], [ex.tensors[b] for b in step.boundary],
                    head_grads, stock, deep, xla=xla,
                    stop_gradients=[ex.tensors[b] for b in step.boundary] + list(stop_gradients))
        if step.ordered:
            grads = _ordered_after_step(step, grads, once=half)
        # What the next recompute step waits for: this step's gradients, and
        # after a backprop step (whose ops wait for none of them) the ones
        # before it too, so that no earlier step's weight gradient still
        # runs beside the recomputation.
        previous = list(previous) if step.kind == "backprop" else []
        for b, g in zip(step.boundary, grads):
            if g is not None:
                received[b].append(g)
                previous.append((g.values if isinstance(g, tf.IndexedSlices) else g).op)
    return [received.get(x, []) for x in fg.xs]


def _passes_through(ex: Extraction, step: Step) -> bool:
    """Whether ``step`` only hands gradients back through variable reads."""
    return step.kind == "backprop" and all(
        _tf_private.passes_gradient_through(ex.ops[o]) for o in step.ops)


def differentiate(ys, xs, grad_ys, stock, deep: Sequence[bool] | None = None, *, xla: bool,
                  **options) -> list:
    """One stock tf.gradients call of memsave's (a step's, or a whole plan's
    whose only change is its loops' gradients); outside XLA its gradient
    chain then waits for the leaf gradients beside it (:func:`_no_run_ahead`).
    The forecast of a loops-only plan counts that order (``ordered`` in
    :meth:`memsave.simulate._Builder.backward`); a schedule's steps are
    forecast with a weight kernel beside the next gradient still.
    ``stock`` and ``options`` (``stop_gradients``, ``name``,
    ``unconnected_gradients``) are tf.gradients' arguments; ``deep``
    (aligned with ``xs``, default none): whether later steps take that
    gradient further."""
    start = _tf_private.next_op_creation_index(ys[0].graph)
    with _tf_private.unread_zero_gradients_elided():
        grads = _tf_private.original_gradients(ys, xs, grad_ys=grad_ys, **options, **stock)
    if not xla:
        deep = [False] * len(grads) if deep is None else deep
        _no_run_ahead(start, [(g, d) for g, d in zip(grads, deep) if g is not None])
    return grads


def _no_run_ahead(start: int, grads: Sequence) -> int:
    """Make the gradient chain wait for the leaf gradient ops beside it; return the edges added.

    ``grads`` are ``(gradient, deeper)`` pairs of one step's tf.gradients
    call, ``deeper`` when later steps take that gradient further; the call's
    ops are those created at or after creation index ``start``.

    A *chain* op leads to a deeper gradient or to two or more of the
    call's gradients (a layer's input gradient leads to the weight and bias
    gradients of every layer below); a *leaf* op leads to one gradient only
    (a weight's, a bias's). A leaf that reads a single tensor of
    the call ``g`` (``dW = x^T g``, ``BiasAddGrad(g)``) holds ``g`` and its
    forward input until it runs. TensorFlow's executor runs one ready
    successor inline and queues the others; when the second core is busy
    (another process, tf.data's threads in ``fit``) the queued leaves wait
    while the chain runs on, layer after layer, and every leaf waiting
    holds its buffers. Measured on a 48-layer Dense stack (1 MiB a layer)
    in ``fit``, three processes side by side on two cores: nine layers'
    gradients alive at the peak, fits reading 32-44 MiB for a plan
    forecast at 31 MiB. Here each op that consumes what a chain reader of
    ``g`` produced waits for the leaves of ``g``: the chain runs at most one
    layer ahead of its leaves (a leaf still runs beside the chain op that
    reads the same ``g``), the order memsave's forecast assumes; the same
    fits then read their forecast peak in every run (21 and 28 MiB).

    No cycle: a leaf's only input from the call is ``g``, and the op it now
    waits in front of descends from ``g``. No two readers of one gradient
    are joined (the merge oneDNN makes, see "No shared inputs across steps"
    in the module docstring): the leaves of ``g`` gain no path to each
    other, and an op that waits reads what a reader of ``g`` produced, never
    ``g`` itself.
    """
    outs = [(g.values if isinstance(g, tf.IndexedSlices) else g).op for g, _ in grads]
    made: set = set()  # the call's ops
    readers: dict = collections.defaultdict(list)  # tensor ref -> the call's ops reading it
    stack = list(outs)
    while stack:
        op = stack.pop()
        if op in made or _tf_private.op_creation_index(op) < start:
            continue
        made.add(op)
        for t in op.inputs:
            readers[t.ref()].append(op)
            stack.append(t.op)
        stack.extend(op.control_inputs)
    # What each op leads to: the returned gradients it reaches (up to two
    # told apart, then "many"), and whether one of them is deeper. Creation
    # order is topological: consumers are visited before their producers.
    reach: dict = {}
    deep_ops = {op for op, (_, deep) in zip(outs, grads) if deep}
    returned = {op: i for i, op in enumerate(outs)}
    order = sorted(made, key=_tf_private.op_creation_index)
    for op in reversed(order):
        found = {returned[op]} if op in returned else set()
        deep = op in deep_ops
        for out in op.outputs:
            for c in readers.get(out.ref(), ()):
                r, d = reach[c]
                found |= r
                deep = deep or d
        reach[op] = (found if len(found) < 2 else {-1, -2}, deep)
    chain = {op for op, (r, d) in reach.items() if d or len(r) > 1}
    waits: dict = collections.defaultdict(dict)  # op -> the leaves it waits for (ordered set)
    for leaf in order:
        if leaf in chain or any(c in made for c in leaf.control_inputs):
            continue
        from_call = {t.ref() for t in leaf.inputs if t.op in made}
        if len(from_call) != 1:
            continue
        g_ref = next(iter(from_call))
        # A TF1 while frame or cond branch (tf.compat.v1 control flow) is
        # left alone: an edge out of one is invalid or carries its deadness.
        context = _tf_private.control_flow_context(leaf)
        for reader in readers[g_ref]:
            if reader in chain:
                for out in reader.outputs:
                    for c in readers.get(out.ref(), ()):
                        if c in chain and all(t.ref() != g_ref for t in c.inputs) and (
                                _tf_private.control_flow_context(c) is context):
                            waits[c][leaf] = None
    for c, leaves in waits.items():
        _tf_private.add_control_inputs(c, list(leaves))
    return sum(len(v) for v in waits.values())


def _ordered_after_step(step: Step, grads: list, *, once: bool) -> list:
    """``grads`` (aligned with ``step.boundary``), with each gradient of
    ``step.ordered`` (the weights) read through ``g + gate``, a zero computed
    from all of the step's gradients.

    XLA orders by data dependencies only: this puts a weight's update after
    every read of the weight in the step (see
    :func:`memsave.schedule.ordered_boundary`), so XLA need not copy the
    weight to keep its old value. An IndexedSlices gradient has its values
    gated.

    ``once``: the gate computed once (see :func:`memsave.gates.gate`) rather than fused
    into the updates; :func:`rewrite` asks for it where the forward graph
    computes in float16. Fused, XLA computes the first element of each of
    the step's gradients inside every weight update's fusion, from what the
    gradient is computed from. That costs nothing where each update runs
    as soon as its gradient exists; computed apart, the gate is one more
    level of XLA's breadth-first schedule and the updates run later, each
    holding its old kernel and its gradient longer (ResNet50, float32 SGD:
    the step's peak 259.2 MB instead of 242.4). But training in float16
    needs a loss scale, whose finite check holds every update to the step's
    end, and a fused gate then holds what it is computed from until then
    (on MobileNetV2, block 1's 13.4 MB input gradient and 12.6 MB kept
    expand output). Measured with experiments/xla_train.py (custom loop,
    'memory', ``keras.optimizers.LossScaleOptimizer`` under
    ``mixed_float16``, MiB above the resident bytes): MobileNetV2 77.7 ->
    60.4, ResNet50 196.5 -> 182.9, the same losses. Tried and not kept: a
    gate over every element (``max |g|``, which no slice can reach) for
    every dtype: MobileNetV2 loss-scaled 72.3, ResNet50 float32 SGD 138.2
    instead of 120.9; deciding per step, on whether the step's own
    gradients are float16: MobileNetV2 74.8 (its batch norms compute in
    float32, and so do the gradients of their inputs).
    """
    ordered = set(step.ordered)
    gate = gates.gate([g for g in grads if g is not None], once=once)
    if gate is None:
        return grads
    casts: dict = {}
    out = []
    for b, g in zip(step.boundary, grads):
        if g is not None and b in ordered:
            if isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(gates.proxy(g.values, gate, casts), g.indices, g.dense_shape)
            else:
                g = gates.proxy(g, gate, casts)
        out.append(g)
    return out


def _pass_through(fg, step: Step, received: dict) -> list:
    """Send each read's gradients on to the handle it reads; return their ops."""
    boundary = set(step.boundary)
    ops = []
    for o in step.ops:
        node = fg.ops[o]
        got = received.get(node.outputs[0])
        if got and node.inputs[0] in boundary:
            received[node.inputs[0]].extend(got)
            ops += [(g.values if isinstance(g, tf.IndexedSlices) else g).op for g in got]
    return ops


def _after_forward(gy, y_ops: Sequence, y_gate: tf.Tensor | None = None):
    """``gy``, available only once the ys (and so every original forward op) are computed.

    tf.gradients gets this order for free: its first gradient ops read the
    outputs of the last forward ops. memsave's copies need no original op
    past the last kept tensor, so without this the original forward ops of a
    recomputed segment could still be pending when an optimizer updates the
    variables: with TF1 reference variables (read when an op runs, not
    snapshotted) a fetched loss would then read the updated weights. Every
    gradient memsave builds descends from the seeds, so it all waits for the
    forward pass. The Identity passes its buffer through (no copy).

    Under XLA, which ignores control dependencies, ``y_gate`` (a zero
    computed from the ys' values, :func:`memsave.gates.gate`) is added to ``gy`` instead:
    the default seed ``ones_like(y)`` is a constant, and so would be the
    gates of the first recompute step, which XLA folds away, recomputing
    that step's segment in the forward pass (measured on ResNet50 with its
    last stage in the first step: the stage's reversed kernels made at the
    start of the step and held to the backward pass).
    """
    if y_gate is not None:
        if isinstance(gy, tf.IndexedSlices):
            return tf.IndexedSlices(gates.proxy(gy.values, y_gate), gy.indices, gy.dense_shape)
        return gates.proxy(gy, y_gate) if gates.gateable(gy.dtype) else gy
    with tf.control_dependencies(y_ops):
        if isinstance(gy, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(gy.values), gy.indices, gy.dense_shape)
        return tf.identity(gy)


def _recompute(ex: Extraction, step: Step, heads, head_grads, stock, previous, deep, *,
               xla: bool) -> list:
    fg = ex.fg
    # What the step's gated reads wait for: a boolean computed from the
    # heads' gradients (reads: Select(ready, t, t)), under XLA a zero (t + gate).
    gate = gates.gate(head_grads, once=True) if xla else gates.ready(head_grads)
    # Which boundary tensors are read through the gate is the schedule's
    # decision (memsave.schedule.gated_boundary), which the simulator counts.
    gated = set(step.gated) if gate is not None else set()
    if gate is None and xla:
        logger.warning(
            "memsave: under XLA (jit_compile=True) the recomputation of %s cannot be tied "
            "to the incoming gradient, which has no floating-point part; XLA ignores "
            "control dependencies and may recompute it in the forward pass, saving "
            "nothing there",
            ", ".join(fg.describe(heads)),
        )
    casts: dict = {}  # the gate cast to each dtype, for this step

    def through_gate(t: tf.Tensor) -> tf.Tensor:
        return gates.proxy(t, gate, casts) if xla else gates.select(t, gate)

    # Recompute only once the heads' gradients (through the gate) and the
    # previous step's gradients exist.
    if gate is not None:
        waits = [gate.op] + previous
    else:
        waits = [g.op for g in head_grads if not isinstance(g, tf.IndexedSlices)] + previous
    # The gated proxies wait, so the copies reading them need no control
    # input of their own (see _copy_and_differentiate). The other boundary
    # tensors (weights, say) are read as they are.
    start = _tf_private.next_op_creation_index(ex.ops[0].graph)
    with ex.ops[0].graph.control_dependencies(waits):
        proxies = {b: through_gate(ex.tensors[b]) for b in step.boundary if b in gated}
        if gate is not None:
            # The step reads what it receives through proxies of its own, never
            # a tensor an earlier step's ops also read (see "No shared inputs
            # across steps" in the module docstring). They wait too: a
            # gradient op reading only them and forward tensors outside the
            # segment (a first layer's weight gradient, ``x^T g`` on the input
            # batch) would otherwise run beside the previous step's weight
            # gradients, both holding their products.
            head_grads = [through_gate(g) if gates.gateable(g.dtype) else g for g in head_grads]
    return _copy_and_differentiate(ex, step, heads, head_grads, stock, proxies, waits, deep,
                                   start)


def _copy_and_differentiate(ex: Extraction, step: Step, heads, head_grads, stock, proxies: dict,
                            waits: list, deep: Sequence[bool], start: int) -> list:
    """Copy the step's ops reading ``proxies`` (of the gated boundary
    tensors; the others are read as they are), after ``waits``;
    differentiate the copies with respect to the boundary.

    A copy that reads a proxy (which waits) or another copy runs after
    ``waits`` through its inputs; only a copy reading neither (forward
    tensors alone) gets them as control inputs. An op with a control input
    is one TensorFlow's remapper does not fuse: with them on every first op
    of a segment, a recomputed batch norm and the ReLU after it ran as two
    passes over the activation (``_FusedBatchNormEx`` in the forward pass).

    The stock call walks forward from the boundary tensors only through the
    ops made since ``start`` (the step's own, :func:`memsave._tf_private.forward_walk_after`):
    what it would reach from a fresh Identity of each, made for the step,
    which that saves (one op per weight a step reads: 800 of the 5589 ops
    memsave added on bench_build's 1000-layer chain).
    """
    fg = ex.fg
    copies: dict[int, tf.Tensor] = {}
    copied_ops: dict[int, tf.Operation] = {}
    boundary = set(step.boundary)
    waiting: dict[int, tf.Tensor] = {}  # boundary tensors read through an Identity that waits
    for o in step.ops:
        op = ex.ops[o]
        node = fg.ops[o]
        inputs = []
        entered = False  # reads a proxy or a copy: waits through it
        for t in node.inputs:
            # A kept tensor is read through its proxy, or as it is, even when
            # its producer is copied in this step (a sibling output).
            if t in proxies:
                inputs.append(proxies[t])
                entered = True
            elif t in boundary:
                inputs.append(ex.tensors[t])
            elif t in copies:
                inputs.append(copies[t])
                entered = True
            else:
                inputs.append(ex.tensors[t])
        if not entered and op.type not in _tf_private.WHILE_OP_TYPES \
                and boundary.intersection(node.inputs):
            # Reads nothing memsave made (a first layer's x @ w): its boundary
            # inputs through an Identity that waits, so the copy needs no
            # control input (the stock call's walk goes through it). A loop's
            # copy waits through an Identity of its own (_copy_loop).
            for k, t in enumerate(node.inputs):
                if t in boundary:
                    if t not in waiting:
                        with ex.ops[0].graph.control_dependencies(waits):
                            waiting[t] = gates.proxy(ex.tensors[t], None)
                    inputs[k] = waiting[t]
            entered = True
        # Wait for what the original waited for: copies of ops copied
        # in this step, the originals otherwise (already run).
        controls = [
            copied_ops.get(ex.op_index.get(c), c) for c in op.control_inputs
        ]
        if op.type in _tf_private.WHILE_OP_TYPES:
            new = _copy_loop(op, inputs, waits + controls)
        else:
            copy = (_tf_private.copy_batch_norm_with_statistics if node.reuses_statistics
                    else _tf_private.copy_op)
            new = copy(op, inputs, name=op.name)
            controls = controls if entered else waits + controls
            if controls:
                _tf_private.add_control_inputs(new, controls)
        if fg.xla:
            xla_gradient = xla_gradient_for(op)
            if xla_gradient is not None:
                _tf_private.set_gradient_function(new, xla_gradient)
        copied_ops[o] = new
        for t, out in zip(node.outputs, new.outputs):
            copies[t] = out
    logger.debug("memsave: recomputing %d ops for heads %s", len(step.ops), fg.describe(heads))
    xs = [proxies[b] if b in proxies else ex.tensors[b] for b in step.boundary]
    with _tf_private.forward_walk_after(ex.ops[0].graph, start, xs):
        return differentiate([copies[h] for h in heads], xs, head_grads, stock, deep, xla=fg.xla)


def _copy_loop(op: tf.Operation, inputs: list, waits: Sequence[tf.Operation]) -> tf.Operation:
    """A copy of the While ``op`` reading ``inputs`` that runs after ``waits``,
    with no control input of its own.

    while_v2's gradient appends its accumulators to the forward op's inputs
    (``AddWhileInputHack``), after any control input in its NodeDef; a
    Session refuses that node ("Control dependencies must come after
    regular dependencies"; a tf.function's conversion to a FunctionDef sorts
    the inputs). The copy reads its first input through an Identity that
    waits instead: the loop cannot start before it.
    """
    graph = op.graph
    with graph.control_dependencies(None):
        if waits:
            with graph.control_dependencies(waits):
                inputs = [_tf_private.identity(inputs[0], name="wait"), *inputs[1:]]
        return _tf_private.copy_op(op, inputs, name=op.name)
