"""Checkpointing inside while_v2 loops: store the loop state, recompute each trip.

A ``tf.while_loop`` (every Keras RNN on CPU, ``tf.scan``, ``tf.map_fn``) is
one While op to the rest of memsave. Its stock gradient keeps every body
intermediate the backward body reads, once per trip: memory grows as
T x (everything one trip keeps). :func:`prepare` changes, for one While op,
what its gradient keeps:

* ``LoopChoice.plain()``: nothing changes (while_v2's gradient).
* ``LoopChoice.per_step()``: the forward loop stores only the loop state
  (the body's inputs that change from trip to trip, the trip counter, and
  the outputs of ops that must not run twice: random draws, reads of a
  variable the loop writes); the backward loop recomputes each trip's
  intermediates from its state, when that trip's gradient arrives.
* ``LoopChoice.chunk(k)``: the state is stored every k trips only; the
  backward loop recomputes each chunk of k trips from it, storing the
  chunk's k states (``inner="per_step"``) or its intermediates
  (``inner="store"``) for the chunk's backward trips.
* ``LoopChoice.slots(s)``: as ``chunk`` with chunks of s, s - 1, ..., 1
  trips: about s states stored at once for up to s (s + 1) / 2 trips
  (equal chunks: 2 sqrt(T)), the least any schedule needs that runs each
  trip at most twice before its backward trip.

Data flow: the planner (or a test) calls ``prepare(op, choice)`` on a While
op *before* the stock gradient code differentiates it, whether that is the
original op (a backprop step) or memsave's copy of it (a recompute step);
``tf.gradients`` then builds the gradient ``prepare`` chose. The mechanism
(a gradient function of memsave's own, selected per op) is described in
:mod:`memsave._tf_while`; the memory each choice needs, without
TensorFlow, in :mod:`memsave.loopmodel`.

Examples
--------
>>> out = tf.while_loop(cond, body, [0, h0], maximum_iterations=T)  # doctest: +SKIP
>>> loop = out[1].op.inputs[0].op  # the While op (through an Identity)  # doctest: +SKIP
>>> memsave.loops.prepare(loop, LoopChoice.per_step())  # doctest: +SKIP
>>> grads = tf.gradients(loss, weights)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence

import tensorflow as tf

from memsave import _tf_private, _tf_while
from memsave.errors import LoopChoiceError
from memsave.loopmodel import LoopChoice

__all__ = ["LoopChoice", "Prepared", "prepare", "apply", "applied", "find_loops", "accumulators"]

logger = logging.getLogger(__name__)

#: Trips a prepared loop may run at once in the forward pass. A trip's
#: work that does not read the loop state (a Keras LSTM's ``x_t @ W``,
#: 2 MiB at batch 1024 and 128 units) can run ahead of the state by up to
#: ``parallel_iterations`` trips (Keras sets 32): while_v2 keeps far more
#: per trip than that, but a loop that keeps only its state would hold 32
#: trips of it (measured: +36 MiB on a Keras LSTM at T=128, 20% of the
#: per-step peak). CPU time measured unchanged at 1; override with
#: ``prepare(..., parallel_iterations=)``.
FORWARD_PARALLEL_ITERATIONS = 1


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` did to a loop.

    Attributes
    ----------
    choice : LoopChoice
        What the caller asked for.
    applied : LoopChoice
        What the loop's gradient will do (``plain`` when the request was
        refused; ``reason`` says why).
    reason : str
        Empty, or why ``choice`` was not applied as asked.
    inner : str or None
        For a chunked loop: the name of the inner While op (one chunk).
    """

    choice: LoopChoice
    applied: LoopChoice
    reason: str = ""
    inner: str | None = None


@tf.autograph.experimental.do_not_convert
def prepare(op: tf.Operation, choice: LoopChoice, *, xs: Sequence | None = None,
            skip_inputs: Sequence[int] | None = None,
            parallel_iterations: int = FORWARD_PARALLEL_ITERATIONS) -> Prepared:
    """Make ``op``'s gradient keep what ``choice`` says (see the module docstring).

    Call it before ``tf.gradients`` differentiates ``op``. It never raises
    for a loop it cannot handle: it leaves the loop's gradient as it is
    (``plain``), logs a warning naming the loop and why, and says so in the
    returned :class:`Prepared`.

    Parameters
    ----------
    op : tf.Operation
        A ``While`` or ``StatelessWhile`` op (while_v2).
    choice : LoopChoice
    xs : sequence of tf.Tensor or tf.Variable, optional
        What the gradient will be taken with respect to. Loop-invariant
        inputs that depend on none of them (a Keras RNN's input sequence,
        when the xs are the weights) get no gradient: while_v2 would build
        one anyway, a T-long TensorList filled trip by trip. None: every
        input may need one. This holds for every gradient built through
        ``op`` afterwards, until ``prepare`` is called on it again (which
        changes only this: a loop keeps the gradient it was first given);
        :func:`applied` limits it to the gradients built in a block.
    skip_inputs : sequence of int, optional
        The same, given directly as input positions of ``op`` (what a
        planner that knows which inputs carry no gradient passes); only
        loop-invariant positions are skipped. Overrides ``xs``.
    parallel_iterations : int
        Trips the prepared loop may run at once in the forward pass
        (:data:`FORWARD_PARALLEL_ITERATIONS`).

    Returns
    -------
    Prepared

    Raises
    ------
    LoopChoiceError
        ``op`` is not a While op, or ``choice`` is not a LoopChoice.
    """
    if not isinstance(op, tf.Operation) or op.type not in _tf_private.WHILE_OP_TYPES:
        raise LoopChoiceError(
            f"memsave.loops.prepare: expected a While or StatelessWhile op (while_v2), got "
            f"{_describe(op)}; pass the op of a tf.while_loop's output (its .op, through any "
            "Identity), e.g. from memsave.loops.find_loops(tensors)")
    if not isinstance(choice, LoopChoice):
        raise LoopChoiceError(
            f"memsave.loops.prepare: choice={choice!r}; expected a LoopChoice, e.g. "
            "LoopChoice.per_step() or LoopChoice.chunk(32)")
    if _tf_while.marked(op) is not None:
        return _prepared_before(op, choice, _skip(op, xs, skip_inputs))
    if choice.kind == "plain":
        return Prepared(choice, choice)
    refused = _refusal(op)
    if refused:
        logger.warning("memsave: loop %s keeps while_v2's gradient (%s requested): %s",
                       op.name, choice, refused)
        return Prepared(choice, LoopChoice.plain(), reason=refused)
    skip = _skip(op, xs, skip_inputs)
    _tf_while.set_parallel_iterations(op, parallel_iterations)
    skip += _tf_while.read_sequences_in_place(op, skip)
    _readers_wait_for_every_output(op)
    if choice.kind == "per_step":
        _tf_while.mark(op, mode="per_step", skip=skip)
        return Prepared(choice, choice)
    if choice.kind in ("chunk", "slots"):
        once = _tf_private.first_run_once(_tf_while.function_graphs(op)[1])
        if once is not None:
            reason = (f"{choice} would run the trips of a chunk again, and its body has "
                      f"{once.type} op {once.name!r}, whose effect or value must not repeat; "
                      "stored per step instead")
            logger.warning("memsave: loop %s: %s", op.name, reason)
            _tf_while.mark(op, mode="per_step", skip=skip)
            return Prepared(choice, LoopChoice.per_step(), reason=reason)
        try:
            inner = _tf_while.nest_in_chunks(
                op, choice.k, inner_mode="per_step" if choice.inner == "per_step" else "store",
                skip=skip, taper=choice.kind == "slots")
        except Exception as e:  # noqa: BLE001 - the loop is left as it was: stored per step
            reason = (f"its body could not be nested in chunks ({type(e).__name__}: {e}); "
                      "stored per step instead. This is a bug in memsave: please report it")
            logger.warning("memsave: loop %s: %s", op.name, reason)
            _tf_while.mark(op, mode="per_step", skip=skip)
            return Prepared(choice, LoopChoice.per_step(), reason=reason)
        return Prepared(choice, choice, inner=inner.name)
    raise LoopChoiceError(
        f"memsave.loops.prepare: choice {choice} is not implemented; use plain, per_step, chunk "
        "or slots")


def _skip(op: tf.Operation, xs, skip_inputs) -> tuple[int, ...]:
    """The loop-invariant input positions of ``op`` that get no gradient
    (see :func:`prepare`'s ``xs`` and ``skip_inputs``)."""
    invariant = _tf_while.invariant_positions(op)
    if skip_inputs is not None:
        return tuple(sorted(j for j in set(skip_inputs) if j in invariant))
    return _without_gradient(op, invariant, xs)


def _prepared_before(op: tf.Operation, choice: LoopChoice, skip: tuple[int, ...]) -> Prepared:
    """A loop an earlier :func:`prepare` changed: it keeps that gradient (its
    forward pass already stores for it); only which inputs get no gradient
    is this call's (``skip``)."""
    for loop in (op, *_tf_while.chunk_loops(op)):
        _tf_while.set_skip(loop, skip)
    kept = _marked_choice(op)
    if kept == choice:
        return Prepared(choice, kept)
    reason = f"an earlier memsave.loops.prepare gave it the {kept} gradient, which it keeps"
    logger.warning("memsave: loop %s keeps the %s gradient an earlier call gave it (%s "
                   "requested)", op.name, kept, choice)
    return Prepared(choice, kept, reason=reason)


def _marked_choice(op: tf.Operation) -> LoopChoice:
    """The LoopChoice :func:`prepare` applied to the marked ``op``."""
    mode, steps, _, _, taper = _tf_while.marked(op)
    inner = _tf_while.chunk_loops(op)
    if not inner:
        return LoopChoice.per_step() if mode == "per_step" else LoopChoice.plain()
    if taper:
        return LoopChoice.slots(steps)
    return LoopChoice.chunk(steps, inner="store" if _tf_while.marked(inner[0])[0] == "store"
                            else "per_step")


@contextlib.contextmanager
def applied(decisions: Sequence, graph: tf.Graph, *, xs: Sequence | None = None,
            ops: Sequence[str] = ()):
    """:func:`apply` for the gradients built inside the ``with`` block
    (what :func:`memsave.gradients` does): on leaving it, every loop it
    prepared, and every copy of one its gradients made (a chunk's inner
    loop, recomputed in the backward body), gives every input a gradient
    again (:func:`memsave._tf_while.skip_scope`). The inputs that depend on
    none of the ``xs`` get none in this call only; a later gradient through
    the loop (``tf.gradients`` of the same loss with respect to the input
    sequence, another optimizer's variables, a gradient penalty's second
    order through the backward loop) gets its own."""
    with _tf_while.skip_scope():
        yield apply(decisions, graph, xs=xs, ops=ops)


def _readers_wait_for_every_output(op: tf.Operation) -> None:
    """Make the readers of ``op``'s outputs wait for the whole loop to end
    (a control edge from ``op``).

    An output whose readers do not run (the c sequence a ``tf.scan`` over
    an LSTM's (h, c) stacks, when the loss reads the h sequence: pruned in
    a tf.function, not fetched in a Session) is freed as the loop ends; a
    reader of another output (the h sequence's stack) may run first, on
    the executor's other thread, and both are held at once: measured on a
    chunked LSTM scan, 54.5 MB above resident in some runs, up to 75 MB in
    others. Waiting for the whole loop, the readers run after every
    output's release. The outputs all come out as the last trip ends, so
    the readers lose no time.
    """
    readers = {c for t in op.outputs for c in t.consumers()}
    for reader in sorted(readers, key=lambda r: r.name):
        if op not in reader.control_inputs:
            _tf_private.add_control_inputs(reader, [op])


def _refusal(op: tf.Operation) -> str:
    """Why ``op``'s gradient cannot be changed ('' if it can)."""
    try:
        _tf_while.function_graphs(op)
    except Exception as e:  # noqa: BLE001 - a loop that cannot be read keeps its gradient
        return f"its body function could not be read ({type(e).__name__}: {e})"
    writer = _tf_private.written_variable(op)
    if writer:
        return (f"its body reads a variable that {writer!r} writes: a trip recomputed after "
                "the write would read the new value")
    if _tf_while.already_differentiated(op):
        return ("its gradient was already built (its body pushes accumulators); prepare it "
                "before tf.gradients differentiates it")
    return ""


def _without_gradient(op: tf.Operation, positions, xs) -> tuple[int, ...]:
    """Of ``op``'s input ``positions``, those that depend on none of ``xs``.

    Walks back from each input over producers, through the captures of
    function graphs (a placeholder standing for an outer tensor). An
    argument of a function other than the caller's graph (the default
    graph, where the xs are read) stands for a value of some call op's
    caller, not known here: it may depend on an x.
    """
    if xs is None:
        return ()
    home = tf.compat.v1.get_default_graph()
    if any(isinstance(x, tf.Tensor) and not tf.is_symbolic_tensor(x) for x in xs):
        # As tf.gradients converts them: a function captures an eager tensor
        # once (a Const when it is small, a placeholder otherwise), and
        # converting it again gives that capture.
        try:
            with home.as_default():
                xs = _tf_private.convert_xs(xs)
        except Exception:  # noqa: BLE001 - not capturable here: skip no input
            return ()
    targets = set()
    for x in xs:
        if _tf_private.is_resource_variable(x):
            targets.add(x.handle.ref())
        elif isinstance(x, tf.Variable):
            targets.add(tf.convert_to_tensor(x).ref())  # a reference variable's value
        else:
            targets.add(x.ref())
    out = []
    for j in positions:
        if j < 2:
            continue  # the counter and maximum_iterations
        seen, stack, found = set(), [op.inputs[j]], False
        while stack and not found:
            t = stack.pop()
            if t.ref() in seen:
                continue
            seen.add(t.ref())
            if t.ref() in targets:
                found = True
                break
            if not tf.is_symbolic_tensor(t):
                continue  # an eager tensor a function captured: a source
            stack.extend(t.op.inputs)
            outer = _tf_private.captured_outer(t)
            if outer is not None:
                stack.append(outer)
            elif t.op.type == "Placeholder" and t.graph is not home:
                found = True  # an argument of a called function
                break
        if not found:
            out.append(j)
    return tuple(out)


@tf.autograph.experimental.do_not_convert
def apply(decisions: Sequence, graph: tf.Graph, *, xs: Sequence | None = None,
          ops: Sequence[str] = ()) -> dict[str, Prepared]:
    """Prepare the loops a plan chose for (``Plan.loops``), before the rewrite.

    Parameters
    ----------
    decisions : sequence of memsave.loopmodel.LoopDecision
    graph : tf.Graph
        The graph the loops are in (the ys').
    xs : sequence, optional
        As for :func:`prepare`.
    ops : sequence of str
        Names of the differentiated graph's ops: the loops inside their
        function bodies (a loop in a loop body, in a called function) keep
        while_v2's gradient, and a warning says which and why.

    Returns
    -------
    dict of str to Prepared
        What :func:`prepare` did, per loop it was asked to change.
    """
    done = {}
    for d in decisions:
        if d.pinned:
            logger.warning("memsave: loop %s keeps while_v2's gradient: %s", d.name, d.pinned)
        if d.choice.kind == "plain":
            continue
        done[d.name] = prepare(graph.get_operation_by_name(d.name), d.choice, xs=xs)
        logger.info("memsave: loop %s (T=%d): %s gradient", d.name, d.trips,
                    done[d.name].applied)
    chosen = {d.name for d in decisions}
    for name in ops:
        outer = graph.get_operation_by_name(name)
        if not _runs_functions(outer):
            continue
        for inner in _inner_loops(outer):
            if inner.name in chosen or _tf_while.marked(inner) is not None:
                continue
            where = ("the body of loop" if outer.type in _tf_private.WHILE_OP_TYPES else
                     "a branch of" if outer.type in _tf_private.COND_OP_TYPES else "function call")
            where = f"function {inner.graph.name}, in {where}"
            logger.warning(
                "memsave: loop %s (in %s %s) keeps while_v2's gradient: the planner chooses "
                "per-step or chunked gradients for the loops of the graph it differentiates, "
                "not for loops nested in a loop body, a called function or a branch (forecast as "
                "while_v2's). To change it, call memsave.loops.prepare on it before the "
                "gradients are built (memsave.loops.find_loops(ys, nested=True) lists it)",
                inner.name, where, outer.name)
    return done


@tf.autograph.experimental.do_not_convert
def find_loops(tensors: Sequence[tf.Tensor], *, nested: bool = False) -> list[tf.Operation]:
    """The While ops ``tensors`` depend on, in creation order.

    With ``nested=False``, those of the graph the tensors live in. With
    ``nested=True`` also the loops inside the functions those ops call
    (PartitionedCall, StatefulPartitionedCall, While bodies, the branches of
    an If or Case), each listed after the op that runs it: :func:`prepare`
    handles them too, when called before the gradient of the op that runs
    them is built.
    """
    seen, found = set(), []
    stack = [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in _tf_private.WHILE_OP_TYPES:
            found.append(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    found.sort(key=_tf_private.op_creation_index)
    if not nested:
        return found
    out = []
    for op in found:
        out.append(op)
        out.extend(_inner_loops(op))
    for op in sorted(seen, key=_tf_private.op_creation_index):
        if op.type in _tf_private.CALL_OP_TYPES or op.type in _tf_private.COND_OP_TYPES:
            out.extend(_inner_loops(op))
    return out


def _runs_functions(op: tf.Operation) -> bool:
    """Whether ``op`` runs functions that may hold loops: a loop, a call, a conditional."""
    return op.type in _tf_private.WHILE_OP_TYPES or op.type in _tf_private.CALL_OP_TYPES \
        or op.type in _tf_private.COND_OP_TYPES


def _inner_loops(op: tf.Operation) -> list[tf.Operation]:
    """While ops in the functions ``op`` runs (loop bodies, called functions,
    cond and case branches; recursively), creation order within each."""
    out, stack, seen = [], [op], set()
    while stack:
        outer = stack.pop()
        if outer.type in _tf_private.COND_OP_TYPES:
            funcs = _tf_private.branch_graphs(outer)
        else:
            funcs = [_tf_private.body_graph(outer)]
        for func in funcs:
            if func is None or id(func) in seen:
                continue
            seen.add(id(func))
            for inner in func.get_operations():
                if inner.type in _tf_private.WHILE_OP_TYPES:
                    out.append(inner)
                if _runs_functions(inner):
                    stack.append(inner)
    return out


@tf.autograph.experimental.do_not_convert
def accumulators(op: tf.Operation) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """What ``op`` pushes onto a TensorList each trip, once its gradient is built.

    Returns (body tensor pushed each trip, output of ``op`` holding every
    trip's entry) pairs, in the body's output order. For a loop prepared per
    step: the state, the counter and the values that must not be computed
    twice; for a chunked loop: the state at the start of each chunk.
    """
    body = _tf_while.function_graphs(op)[1]
    return [(out.op.inputs[1], op.outputs[j]) for j, out in enumerate(body.outputs)
            if out.op.type == "TensorListPushBack" and j < len(op.outputs)]


def _describe(value) -> str:
    if isinstance(value, tf.Operation):
        return f"op {value.name!r} of type {value.type}"
    return f"{type(value).__name__} {value!r}"
