"""``memsave.gradients``: a drop-in for tf.gradients with checkpointing.

Data flow (one direction)::

    gradients(ys, xs, grad_ys, checkpoints, ...)
      -> _normalize: lists, variables to handles, one graph, not eager
      -> extract: ForwardGraph of the ops on paths xs -> ys (memsave.extract)
      -> Problem: costs, the device's memory model, candidate cuts, the
         cached evaluator (memsave.problem)
      -> a planner by name (memsave.planners: a strategy, or a budget solver
         with memory_budget=), or the user's tensors (validated)
      -> Plan: checkpoints, schedule (with its gating), forecast (memsave.record);
         plan() stops here and returns it
      -> rewrite(plan.schedule): copy segments gated on gradients, stock
         tf.gradients per step (memsave.rewrite)
      -> one gradient per x, shaped as tf.gradients returns it

When the plan keeps nothing (no tagged tensor, no articulation point, a
plan that would save too little) a warning says what to do and the stock
tf.gradients answers.

Under a ``tf.GradientTape`` that watches the ys, all of it is built
unrecorded and the tape records the result as one op (:mod:`memsave.tapes`),
so that the tape can differentiate the gradients further.

Some 600 lines, one call's path top down: the public functions and the
checks of their arguments (graph, eager, a Plan of another graph) sit with
the build they guard; planning, recording and rewriting are modules of
their own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Union

import tensorflow as tf

from memsave import _tf_private, loops, planners, tapes, xla
from memsave.errors import (
    ArgumentError,
    CheckpointError,
    EagerExecutionError,
    GraphMismatchError,
    OptionsError,
)
from memsave.extract import Extraction, extract
from memsave.memory_model import BFC, CPU_ONEDNN, Allocator, MemoryModel
from memsave.planners.strategies import budget_refused, given
from memsave.problem import Problem
from memsave.record import Plan
from memsave.rewrite import aggregate, differentiate, rewrite
from memsave.simulate import paused_gc

__all__ = [
    "gradients",
    "gradients_memory",
    "gradients_speed",
    "gradients_collection",
    "plan",
    "Plan",
]

logger = logging.getLogger(__name__)

Checkpoints = Union[str, Sequence[tf.Tensor], Plan]

COLLECTION_KEY = "checkpoints"


def _as_list(v) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def _describe(t) -> str:
    op = getattr(t, "op", None)
    if op is not None:
        return f"{t.name!r} (op type {op.type})"
    return repr(t)


def _graph_of(values: Sequence, what: str, *, outer_ok: bool = False,
              api: str = "memsave.gradients") -> tf.Graph | None:
    """The graph of ``values[0]``; raise if another value is elsewhere.

    With ``outer_ok``, a value from a graph enclosing the first one's (a
    tf.function or loop body reading an outer tensor) is allowed.
    """
    graph = None
    for v in values:
        g = getattr(v, "graph", None)
        if g is None:
            continue
        if graph is None:
            graph = g
        elif g is not graph and not (outer_ok and g in _tf_private.outer_graphs(graph)):
            if graph in _tf_private.outer_graphs(g):
                raise GraphMismatchError(
                    f"{api}: {what} {_describe(v)} is inside the body of a tf.cond, "
                    "tf.while_loop or called tf.function of the ys' graph; memsave keeps such "
                    "bodies whole (a copy of the op that runs them, or its loop gradient): "
                    "choose a tensor of the ys' graph, e.g. the op's output")
            raise GraphMismatchError(
                f"{api}: {what} {_describe(v)} is in another graph than the ys; "
                "build ys, xs, grad_ys and checkpoints in one graph (or one tf.function)"
            )
    return graph


def _normalize(ys, xs, grad_ys, stop_gradients, checkpoints,
               api: str = "memsave.gradients") -> tuple:
    if xs is None:
        raise ArgumentError(
            f"{api}: xs is None; pass the tensors or variables to differentiate with respect to")
    ys = _as_list(ys)
    xs = _as_list(xs)
    if not ys:
        raise ArgumentError(f"{api}: ys is empty; pass at least one tensor")
    for y in ys:
        if isinstance(y, (list, tuple)):
            raise ArgumentError(
                f"{api}: ys is a nested list ({y!r} inside it); pass a tensor or a flat list of "
                "tensors (tf.stack or tf.add_n them first)"
            )
    for y in ys:
        if _is_eager(y):
            raise EagerExecutionError(
                f"{api}: y {y!r} is an eager tensor. Like tf.gradients, memsave "
                "rewrites a graph: call it inside a tf.function (or a tf.compat.v1 Graph); "
                "in eager code use tf.GradientTape"
            )
    ys = [tf.convert_to_tensor(y) if _tf_private.is_resource_variable(y) else y for y in ys]
    graph = _graph_of(ys, "y", api=api)
    if graph is None and not tf.executing_eagerly():
        # Numbers or arrays, in a graph: constants of it, as tf.gradients takes them.
        try:
            ys = [tf.convert_to_tensor(y) for y in ys]
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"{api}: ys must be tensors ({e})") from None
        graph = _graph_of(ys, "y", api=api)
    if graph is None:
        raise EagerExecutionError(
            f"{api}: ys are not graph tensors; call it inside a tf.function "
            "or a tf.compat.v1 Graph, or use tf.GradientTape in eager code"
        )
    with graph.as_default():
        xs = _tf_private.convert_xs(xs)
    for x in xs:
        if _is_eager(x):
            raise EagerExecutionError(
                f"{api}: x {x!r} is an eager tensor; differentiate with respect to "
                "tensors or variables used inside the same tf.function or graph"
            )
    _graph_of(ys + list(xs), "x", outer_ok=True, api=api)
    if grad_ys is None:
        grad_ys = [None] * len(ys)
    else:
        grad_ys = _as_list(grad_ys)
        if len(grad_ys) != len(ys):
            raise ArgumentError(
                f"{api}: passed {len(grad_ys)} grad_ys for {len(ys)} ys; "
                "pass one per y (None for the default ones)"
            )
        _graph_of(ys + [g for g in grad_ys if g is not None and not _is_eager(g)], "grad_y",
                  outer_ok=True, api=api)
    stop_gradients = _as_list(stop_gradients)
    _graph_of(ys + stop_gradients, "stop_gradients tensor", outer_ok=True, api=api)
    if not isinstance(checkpoints, str):
        _graph_of(ys + _as_list(checkpoints), "checkpoint", api=api)
    return ys, xs, grad_ys, stop_gradients, graph


def _is_eager(t) -> bool:
    return isinstance(t, tf.Tensor) and not tf.is_symbolic_tensor(t)


def _validate_list(checkpoints: Sequence, ex: Extraction, ys, xs,
                   api: str = "memsave.gradients") -> tuple[int, ...]:
    y_refs = {y.ref() for y in ys}
    x_refs = {x.ref() for x in xs}
    chosen = []
    for c in checkpoints:
        if not isinstance(c, tf.Tensor) or _is_eager(c):
            if _tf_private.is_resource_variable(c):
                raise CheckpointError(
                    f"{api}: checkpoints are activations (graph tensors), got the variable "
                    f"{getattr(c, 'name', c)!r}: a variable's value is resident anyway; "
                    "remove it from checkpoints")
            raise CheckpointError(
                f"{api}: checkpoints must be graph tensors, got {c!r} "
                f"({type(c).__name__}); pass the output tensor (e.g. op.outputs[0])"
            )
        if c.ref() in y_refs:
            raise CheckpointError(
                f"{api}: checkpoint {_describe(c)} is one of the ys, which are kept anyway: "
                "remove it from checkpoints"
            )
        if c.ref() in x_refs:
            logger.debug("memsave: checkpoint %s is an x, which is kept anyway", c.name)
            continue
        i = ex.id_of(c)
        if i is None or ex.fg.tensors[i].kind != "internal":
            raise CheckpointError(
                f"{api}: checkpoint {_describe(c)} is not between xs and ys "
                "(no differentiable path from an x through it to a y, or stop_gradients cuts "
                "every such path); remove it, or check that it is computed from the xs and "
                "used by the ys"
            )
        chosen.append(i)
    return tuple(sorted(set(chosen)))


def _not_rewritable(ex: Extraction, xs, graph: tf.Graph) -> str:
    """Why memsave must leave this call to tf.gradients, or '' when it need not."""
    outer = [x for x in xs if getattr(x, "graph", graph) is not graph]
    if outer:
        return (
            f"x {_describe(outer[0])} lives in a graph enclosing the ys' (a loop or function "
            "body reading an outer value, as tf.hessians does); memsave rewrites one graph at "
            "a time"
        )
    v1_flow = sorted({op.type for op in ex.fg.ops} & _tf_private.V1_CONTROL_FLOW_TYPES)
    if v1_flow:
        return (
            f"the forward graph uses TF1 control flow ({', '.join(v1_flow)}), which memsave "
            "does not rewrite; build it with control flow v2 (the TF2 default: do not call "
            "tf.compat.v1.disable_control_flow_v2 or disable_v2_behavior)"
        )
    return ""


def device_model(allocator: Allocator | None = None) -> MemoryModel:
    """The memory model of the device the step runs on: a GPU's BFC allocator
    when a GPU is visible, else oneDNN's CPU allocator (or ``allocator``).
    Warns once when that is oneDNN's and this process runs without oneDNN;
    float16 kernels then run without it whatever the CPU
    (:attr:`MemoryModel.float16_without_onednn`)."""
    if allocator is not None and not isinstance(allocator, Allocator):
        raise ArgumentError(
            f"memsave: allocator={allocator!r} is not a memsave.memory_model.Allocator; pass "
            "one of memsave.memory_model's (CPU_ONEDNN, BFC, ...) or leave it None")
    if allocator is None:
        allocator = BFC if tf.config.list_logical_devices("GPU") else CPU_ONEDNN
        if allocator == CPU_ONEDNN:
            _warn_if_onednn_is_off()
    if allocator == CPU_ONEDNN and not _tf_private.onednn_enabled():
        return MemoryModel(allocator=allocator, float16_without_onednn=True)
    return MemoryModel(allocator=allocator)


@functools.cache
def _warn_if_onednn_is_off() -> None:
    if not _tf_private.onednn_enabled():
        logger.warning(
            "memsave: TensorFlow runs this process without oneDNN (its default on CPUs without "
            "AVX-512): memsave's CPU forecasts count buffers as oneDNN's allocator does (none under "
            "256 KiB), and tf.config.experimental.get_memory_info('CPU:0') has no statistics to "
            "check them against. Set TF_ENABLE_ONEDNN_OPTS=1 before importing TensorFlow to run "
            "with the allocator the forecasts describe.")


def _prepare(ys, xs, grad_ys, checkpoints, stop_gradients, strategy_options, *,
             memory_budget=None, batch_size: int | None = None,
             extra_resident_bytes: int = 0, allocator: Allocator | None = None,
             api: str = "memsave.gradients") -> tuple[tuple, Extraction, Plan]:
    """Normalize the arguments, read the graph and plan: ``(args, extraction, plan)``.

    ``args`` are ``(ys, xs, grad_ys, stop_gradients, graph)`` as tf.gradients takes them.
    """
    ys, xs, grad_ys, stop_gradients, graph = _normalize(ys, xs, grad_ys, stop_gradients,
                                                        checkpoints, api)
    if isinstance(checkpoints, str):
        planners.get(checkpoints, api=api)  # an unknown name fails before the graph is read
        name = checkpoints
    elif isinstance(checkpoints, Plan):
        name = "plan"
        # Given is not None (0 is given: memory_budget=0 is refused, not
        # dropped), but for extra_resident_bytes, whose default is 0.
        given_too = [k for k, v in (("strategy_options", strategy_options),
                                    ("memory_budget", memory_budget), ("batch_size", batch_size))
                     if v is not None] + (["extra_resident_bytes"] if extra_resident_bytes != 0
                                          else [])
        if given_too:
            raise OptionsError(
                f"{api}: checkpoints= is a Plan, made with its own planning options; "
                f"{', '.join(given_too)} cannot change it. Pass them to memsave.plan instead")
    elif isinstance(checkpoints, (list, tuple)):
        name = "list"
        if strategy_options:
            raise OptionsError(f"{api}: strategy_options apply to named strategies only")
        if memory_budget is not None:
            raise budget_refused("a list of checkpoints", api)
    else:
        raise not_checkpoints(checkpoints, api)
    tagged = []
    if name == "collection":
        tagged = [t for t in graph.get_collection(COLLECTION_KEY) if isinstance(t, tf.Tensor)]
    with graph.as_default():
        ex = extract(ys, xs, stop_gradients, tagged, batch_size=batch_size)
    problem = Problem(ex.fg, model=device_model(allocator), batch_size=batch_size,
                      extra_resident_bytes=extra_resident_bytes)
    args = (ys, xs, grad_ys, stop_gradients, graph)
    unsupported = _not_rewritable(ex, xs, graph)
    if unsupported:
        return args, ex, problem.plan(name, (), {}, note=unsupported)
    if name == "plan":
        return args, ex, _validate_plan(checkpoints, ex, api)
    if name == "list":
        return args, ex, given(problem, _validate_list(checkpoints, ex, ys, xs, api))
    return args, ex, planners.run(name, problem, budget=memory_budget, options=strategy_options,
                                  api=api)


def not_checkpoints(checkpoints, api: str) -> CheckpointError:
    """The error for a ``checkpoints=`` that is no strategy name, list or Plan."""
    return CheckpointError(
        f"{api}: checkpoints={checkpoints!r} is neither a strategy name "
        f"({', '.join(planners.available())}), a list of tensors nor a memsave.plan Plan")


def _validate_plan(p: Plan, ex: Extraction, api: str) -> Plan:
    """``p`` itself, when it was made for the forward graph ``ex`` holds."""
    planned, here = p.problem.base.fg, ex.fg
    if planned.numbering_key() == here.numbering_key():
        return p
    if planned.xla != here.xla:
        why = ("it was made for a step XLA compiles (jit_compile=True), and this one is not"
               if planned.xla else
               "it was made for a step XLA does not compile, and this one is (jit_compile=True)")
    elif any(d.chosen is not None and d.chosen.choice.kind != "plain" for d in p.loops) \
            and [op.name for op in planned.ops] == [op.name for op in here.ops]:
        why = ("an earlier call on this graph gave its loops the gradients the Plan chose, "
               "changing them in place; use one call for all the gradients of a loss "
               "(memsave.gradients(loss, vars_a + vars_b))")
    else:
        why = ("made by memsave.plan with other ys or xs, or before the model or its input "
               "shapes changed")
    raise GraphMismatchError(
        f"{api}: checkpoints= is a Plan of another forward graph ({why}); plan again with the "
        "ys and xs given here")


@tf.autograph.experimental.do_not_convert
@paused_gc()
def plan(
    ys,
    xs,
    checkpoints: Checkpoints = "collection",
    *,
    stop_gradients=None,
    strategy_options: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    allocator: Allocator | None = None,
    memory_budget: int | float | None = None,
    extra_resident_bytes: int = 0,
) -> Plan:
    """What :func:`gradients` would keep and recompute, and the peak it forecasts.

    Nothing is built: the forward graph is read, the planner chooses, and
    the simulator forecasts the allocator peak of one step (forward and
    gradients, variables and inputs resident), with the plan and with plain
    tf.gradients.

    Parameters
    ----------
    batch_size : int, optional
        Size of unknown first dimensions (a tf.function traced with a
        ``None`` batch); without it they count as 1 and the Plan's
        ``assumptions`` say so.
    allocator : memsave.memory_model.Allocator, optional
        Whose peak to forecast: :data:`memsave.memory_model.BFC` when a GPU
        is visible, else :data:`memsave.memory_model.CPU_ONEDNN` (which does
        not report buffers under 256 KiB).
    memory_budget, extra_resident_bytes
        As for :func:`gradients`.

    The Plan can be given to :func:`gradients` as ``checkpoints``, which then
    builds it without planning again.

    Examples
    --------
    >>> p = memsave.plan(loss, params, checkpoints="memory")  # doctest: +SKIP
    >>> print(p.summary())  # doctest: +SKIP
    >>> grads = memsave.gradients(loss, params, checkpoints=p)  # doctest: +SKIP
    """
    _, _, p = _prepare(ys, xs, None, checkpoints, stop_gradients, strategy_options,
                       memory_budget=memory_budget, batch_size=batch_size,
                       extra_resident_bytes=extra_resident_bytes, allocator=allocator,
                       api="memsave.plan")
    return p


@tf.autograph.experimental.do_not_convert
@paused_gc()  # a burst of Python objects with no cycles: see memsave.simulate.paused_gc
def gradients(
    ys,
    xs,
    grad_ys=None,
    checkpoints: Checkpoints = "collection",
    *,
    name: str | None = "gradients",
    colocate_gradients_with_ops: bool = True,
    gate_gradients: bool = False,
    aggregation_method=None,
    stop_gradients=None,
    unconnected_gradients=tf.UnconnectedGradients.NONE,
    strategy_options: Mapping[str, Any] | None = None,
    memory_budget: int | float | None = None,
    extra_resident_bytes: int = 0,
    batch_size: int | None = None,
) -> list:
    """Symbolic derivatives of sum(ys) w.r.t. xs, recomputing between checkpoints.

    Takes the arguments of ``tf.gradients`` (keyword-only after
    ``checkpoints``) and returns what it returns: a list aligned with
    ``xs``, None (or zeros, per ``unconnected_gradients``) where an x is not
    connected, IndexedSlices where tf.gradients gives them.

    Parameters
    ----------
    colocate_gradients_with_ops : bool
        True, as TF2's ``tf.gradients`` always has it: each gradient op runs
        on its forward op's device (model parallelism keeps its placement;
        where no forward op names a device, the placer puts them alike
        without it, and memsave skips it). False
        (``tf.compat.v1.gradients``' default): the caller's device scope
        places them.
    checkpoints : str or list of tf.Tensor
        ``'collection'`` (tensors added with
        ``tf.compat.v1.add_to_collection('checkpoints', t)``), ``'memory'``
        (about sqrt(n) articulation points), ``'speed'`` (outputs of
        convolutions and matrix products), any planner registered in
        :mod:`memsave.planners` (or strategy registered with
        :func:`memsave.strategies.register`), a list of tensors between
        xs and ys, or a :class:`~memsave.record.Plan` that :func:`plan`
        made for these ys and xs: it is built as it is, without planning
        again (what its ``summary()`` showed is what runs).
    strategy_options : mapping, optional
        Keyword options of the named planner (e.g. ``{"num_checkpoints":
        8}`` for ``'memory'``); with ``memory_budget``, ``solver`` (``'auto'``,
        ``'dp'``, ``'milp'``, ``'greedy'``) and ``time_limit_s``.
    memory_budget : int or float, optional
        The forecast peak allowed: bytes (int), or a fraction in (0, 1] of
        the forecast plain peak (``Plan.baseline_peak_bytes``). memsave then
        keeps and stores what gives the least predicted recompute cost
        under it (:mod:`memsave.planners.budget`), instead of ``checkpoints``.
    extra_resident_bytes : int
        Bytes the step holds besides what the graph from xs to ys reads (an
        optimizer's slots, metric state): counted as resident in every
        forecast, so that a fractional ``memory_budget`` is a fraction of
        the whole step's peak.
    batch_size : int, optional
        The size to plan for where the graph's first dimensions are unknown
        (a tf.function traced on a ``None`` batch, as Keras traces its step
        on data whose size is not a multiple of the batch size). Without
        it they count as 1, the weights then outweigh every activation, and
        the plan saves little or nothing. The graph runs at any batch size
        either way; only the choice of what to keep depends on it.

    Raises
    ------
    EagerExecutionError
        When called eagerly (use tf.function, or tf.GradientTape).
    GraphMismatchError
        When ys, xs, grad_ys or checkpoints come from different graphs, or
        a Plan given as ``checkpoints`` was made for another forward graph.
    CheckpointError
        When a listed checkpoint is a y or is not between xs and ys.
    UnknownStrategyError
        When ``checkpoints`` names no registered planner.
    OptionsError
        When ``strategy_options`` holds an option the planner does not take,
        or planning options come with a Plan.
    MemoryBudgetError
        When ``memory_budget`` is invalid or below the smallest forecast
        peak (its ``min_peak_bytes``).
    """
    try:
        unconnected = tf.UnconnectedGradients(unconnected_gradients)
    except ValueError:
        raise ArgumentError(
            f"memsave.gradients: unconnected_gradients={unconnected_gradients!r}; use one of "
            f"{[u.value for u in tf.UnconnectedGradients]}"
        ) from None
    if isinstance(xs, (list, tuple)) and not xs and not tf.executing_eagerly():
        return []  # as tf.gradients: nothing to differentiate with respect to
    if isinstance(ys, (list, tuple)) and not ys and not tf.executing_eagerly():
        # As tf.gradients: nothing to differentiate, each x's gradient None
        # (zeros with unconnected_gradients='zero').
        return _tf_private.original_gradients(
            ys, xs, grad_ys, name=name, stop_gradients=stop_gradients,
            unconnected_gradients=unconnected, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops)
    build = functools.partial(
        _build_gradients, ys, xs, grad_ys, checkpoints, name=name,
        colocate_gradients_with_ops=colocate_gradients_with_ops, gate_gradients=gate_gradients,
        aggregation_method=aggregation_method, stop_gradients=stop_gradients,
        unconnected=unconnected, strategy_options=strategy_options, memory_budget=memory_budget,
        extra_resident_bytes=extra_resident_bytes, batch_size=batch_size)
    watched = [y for y in tf.nest.flatten(ys) if isinstance(y, tf.Tensor)]
    if not _tf_private.tape_watches(watched):
        return build()
    return tapes.seen_by_tapes(build, watched[0].graph)


def _build_gradients(ys, xs, grad_ys, checkpoints, *, name, colocate_gradients_with_ops,
                     gate_gradients, aggregation_method, stop_gradients, unconnected,
                     strategy_options, memory_budget, extra_resident_bytes, batch_size) -> list:
    """The body of :func:`gradients`, its arguments checked."""
    (ys, xs, grad_ys, stop_gradients, graph), ex, p = _prepare(
        ys, xs, grad_ys, checkpoints, stop_gradients, strategy_options,
        memory_budget=memory_budget, batch_size=batch_size,
        extra_resident_bytes=extra_resident_bytes)
    stock = dict(
        gate_gradients=gate_gradients,
        aggregation_method=aggregation_method,
        # Colocation pins each gradient op to its forward op's device; where
        # no forward op names a device the placer puts both alike anyway,
        # and colocating cost 8% of the build (ResNet-110, 0.06 s).
        colocate_gradients_with_ops=colocate_gradients_with_ops
        and any(op.device for op in ex.ops),
    )
    budget = memory_budget if p.budget is None else p.budget_bytes  # (a Plan given: its own)
    with contextlib.ExitStack() as loops_prepared:
        # The loops' inputs that depend on no x get no gradient in this call only.
        prepared = {}
        if p.loops or planners.decides_loops(p.strategy, budget, strategy_options):
            with graph.as_default():
                prepared = loops_prepared.enter_context(loops.applied(
                    p.loops, graph, xs=xs, ops=[op.name for op in ex.fg.ops]))
        return _build_prepared(p, ex, (ys, xs, grad_ys, stop_gradients, graph), prepared,
                               name=name, stock=stock, unconnected=unconnected)


def _build_prepared(p: Plan, ex: Extraction, args, prepared: dict, *, name, stock,
                    unconnected) -> list:
    """:func:`_build_gradients` once the loops are prepared (``prepared``:
    :func:`memsave.loops.apply`'s answer)."""
    ys, xs, grad_ys, stop_gradients, graph = args
    colocate = stock["colocate_gradients_with_ops"]
    if p.schedule is None and any(r.applied.kind != "plain" for r in prepared.values()):
        # Only the loops' gradients change: one stock call, ordered as the
        # forecast assumes.
        with graph.as_default():
            return differentiate(ys, xs, grad_ys, stock, xla=ex.fg.xla, name=name,
                                 stop_gradients=stop_gradients, unconnected_gradients=unconnected)
    if p.schedule is None:
        refused = [f"loop {n} keeps while_v2's gradient ({r.reason})"
                   for n, r in prepared.items() if r.reason]
        logger.warning(
            "memsave.gradients(checkpoints=%r): nothing to checkpoint, so no memory is saved "
            "and the gradients are tf.gradients' own: %s%s",
            p.strategy, "; ".join(refused) or p.note or "no tensor between xs and ys",
            f" (assumed: {'; '.join(p.assumptions)})" if p.assumptions else "",
        )
        with graph.as_default():
            return _tf_private.original_gradients(
                ys, xs, grad_ys, name=name, stop_gradients=stop_gradients,
                unconnected_gradients=unconnected, **stock,
            )
    logger.info(
        "memsave.gradients(checkpoints=%r): keeping %d checkpoints, recomputing %d ops",
        p.strategy, len(p.checkpoint_ids), p.schedule.recomputed_ops,
    )
    if p.budget is None:
        # (A budgeted plan with a schedule saves by construction: plain
        # tf.gradients, which recomputes nothing, did not fit its budget.)
        problem = p.problem
        predicted = problem.peak(p.schedule, model=problem.judge)
        baseline = problem.base.peak(None, model=problem.judge)
        if predicted >= baseline:
            advice = ("try checkpoints='memory' or fewer checkpoints"
                      if p.strategy in ("list", "collection") else
                      "at this size the activations do not outweigh what every plan holds; "
                      "a larger batch is where checkpointing pays")
            logger.warning(
                "memsave.gradients(checkpoints=%r): this plan is not expected to save memory "
                "(forecast peak %s bytes, tf.gradients' %s): the kept tensors hold as "
                "much as backprop would. See memsave.plan(...).summary(); %s",
                p.strategy, f"{predicted:,}", f"{baseline:,}", advice,
            )
        else:
            note = xla.saving_warning(problem, p.schedule)
            if note:
                logger.warning("memsave.gradients(checkpoints=%r): %s", p.strategy, note)
    if not ex.fg.xla and _tf_private.auto_clustering():
        logger.info(
            "memsave.gradients: XLA auto-clustering is on; a cluster XLA compiles keeps the "
            "recomputation's data dependencies, and the forecast is the executor's "
            "(compile the step with jit_compile=True for XLA's forecast; see memsave.xla)")
    with graph.as_default(), tf.name_scope(name or "gradients"):
        # Densified as the stock gradients' seeds: a step reads each through a proxy.
        seeds = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in _tf_private.default_grad_ys(grad_ys, ys, colocate)]
        received = rewrite(ex, p.schedule, seeds, stop_gradients=stop_gradients, **stock)
        out = []
        for x, grads in zip(xs, received):
            g = aggregate(grads, dense=False, near=x.op if colocate else None)
            if g is None and unconnected is tf.UnconnectedGradients.ZERO:
                g = _tf_private.zeros_like_gradient(x)
            out.append(g)
    return out


def _preset(api: str, strategy: str, kwargs: dict) -> str:
    """``strategy``, unless the caller of preset ``api`` also gave ``checkpoints=``."""
    if "checkpoints" in kwargs:
        raise ArgumentError(
            f"memsave.{api}: checkpoints={kwargs['checkpoints']!r} given to a preset of "
            f"checkpoints={strategy!r}; call memsave.gradients(..., checkpoints=...) instead")
    return strategy


@tf.autograph.experimental.do_not_convert
def gradients_memory(ys, xs, grad_ys=None, **kwargs) -> list:
    """:func:`gradients` with ``checkpoints='memory'``."""
    checkpoints = _preset("gradients_memory", "memory", kwargs)
    return gradients(ys, xs, grad_ys, checkpoints=checkpoints, **kwargs)


@tf.autograph.experimental.do_not_convert
def gradients_speed(ys, xs, grad_ys=None, **kwargs) -> list:
    """:func:`gradients` with ``checkpoints='speed'``."""
    checkpoints = _preset("gradients_speed", "speed", kwargs)
    return gradients(ys, xs, grad_ys, checkpoints=checkpoints, **kwargs)


@tf.autograph.experimental.do_not_convert
def gradients_collection(ys, xs, grad_ys=None, **kwargs) -> list:
    """:func:`gradients` with ``checkpoints='collection'``."""
    checkpoints = _preset("gradients_collection", "collection", kwargs)
    return gradients(ys, xs, grad_ys, checkpoints=checkpoints, **kwargs)
