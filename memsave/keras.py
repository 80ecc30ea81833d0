"""Keras 3 ``fit`` with memsave's gradients: :func:`checkpointed` and :func:`restore`.

Keras ``fit`` takes its gradients with ``tf.GradientTape``, which no patch
of ``tf.gradients`` reaches. :func:`checkpointed` gives one model instance
a train step of its own (an instance attribute; the class is untouched)
that does what Keras' TensorFlow ``train_step`` does, with one difference:
the gradients come from :func:`memsave.gradients`.

Data flow::

    checkpointed(model, checkpoints, ...)
      -> validate: a Keras 3 model on the TensorFlow backend whose train_step
         is Keras' own; a known strategy name, or layers of the model;
         not compiled with run_eagerly=True
      -> model.train_step = <checkpointed step>;  model.fit = <fit that notes
         the batch size it runs at>;  model.train_function = None
    model.fit(...)
      -> the batch size: fit's batch_size=, Keras' 32 for arrays, a dataset's
         batch size (checkpointed's batch_size= overrides); a change of it
         drops the trace
      -> make_train_function: tf.function(strategy.run(train_step)), with
         the model's jit_compile, per replica under tf.distribute
      -> checkpointed step (traced once per input signature):
           y_pred = model(x, training=True)     (listed layers' outputs recorded)
           loss = model._compute_loss(...);  loss tracker updated
           loss = optimizer.scale_loss(loss)    (loss scaling, mixed_float16)
           grads = memsave.gradients(loss, model.trainable_weights, checkpoints=...,
                                     batch_size=<for a batch of unknown size>,
                                     extra_resident_bytes=<slots, metrics, frozen weights,
                                                           the prefetched next batch>)
           optimizer.apply_gradients(zip(grads, weights))   (unscales, skips inf)
           return model.compute_metrics(...)
    restore(model)
      -> delete the instance attributes;  model.train_function = None

Everything else ``fit`` does (callbacks, metrics, validation,
``steps_per_execution``, ``jit_compile``, distribution strategies, the
optimizer's loss scaling) is Keras' own code, which calls the step.

One module (some 900 lines) because it is one integration: the train step,
its forecast and their validation share the step's code, and every private
Keras API this module uses is in the section "Private Keras API" at the
end, checked against Keras 3.15, in one place for a Keras upgrade to check; the step mirrors
``keras/src/backend/tensorflow/trainer.py`` ``TensorFlowTrainer.train_step``
line for line, with ``tape.gradient`` replaced.

Examples
--------
>>> import memsave.keras  # doctest: +SKIP
>>> model = memsave.keras.checkpointed(model, checkpoints="memory")  # doctest: +SKIP
>>> model.compile(optimizer="adam", loss="mse")  # doctest: +SKIP
>>> model.fit(x, y, epochs=3)  # doctest: +SKIP
>>> memsave.keras.restore(model)  # plain fit again  # doctest: +SKIP

Before training, :func:`plan` forecasts the peak memory of one ``fit``
step, plain and checkpointed, for a batch of a given size::

    memsave.keras.plan(model, x, y, checkpoints="memory", batch_size=256)
      -> validate (as checkpointed; the model must be compiled)
      -> build what fit builds first (model, loss, metrics, optimizer slots)
      -> trace the step's forward pass and loss in a FuncGraph, on TensorSpecs
         of the batch, and call memsave.plan where the step calls
         memsave.gradients, with the same extra resident bytes
      -> the Plan

Both count, besides what the graph from the weights to the loss reads, the
variables the step holds (optimizer slots, metric state, non-trainable
weights) and the next batch, which fit's input pipeline prefetches while the
step runs, as resident (``extra_resident_bytes``): a forecast is of the whole
``fit`` step, and a fractional ``memory_budget`` is a fraction of plain
``fit``'s forecast step peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import numbers
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import keras
import tensorflow as tf

from memsave import _tf_private, planners
from memsave.errors import (
    ArgumentError,
    CheckpointError,
    EagerExecutionError,
    MemsaveError,
    OptionsError,
)
from memsave.api import device_model
from memsave.api import gradients as _memsave_gradients
from memsave.api import plan as _memsave_plan
from memsave.memory_model import Allocator
from memsave.planners.strategies import budget_refused

__all__ = ["checkpointed", "restore", "is_checkpointed", "plan", "max_batch_size", "extra_resident_bytes",
           "KerasModelError"]

logger = logging.getLogger(__name__)

LayerRef = Union[str, "keras.layers.Layer"]


class KerasModelError(MemsaveError, TypeError):
    """memsave.keras cannot take over this object's train step."""


# -- public API ------------------------------------------------------------


def checkpointed(
    model: keras.Model,
    checkpoints: str | Sequence[LayerRef] = "memory",
    *,
    strategy_options: Mapping[str, Any] | None = None,
    aggregation_method=None,
    gate_gradients: bool = False,
    memory_budget: int | float | None = None,
    batch_size: int | None = None,
) -> keras.Model:
    """Make ``model.fit`` compute the train step's gradients with memsave.

    The model (Sequential, functional or subclassed) is not rebuilt or
    copied: its instance gets a train step that is Keras' own with the
    gradients taken by :func:`memsave.gradients` instead of
    ``tf.GradientTape``. Compile before or after; call it again to change
    the options; :func:`restore` undoes it.

    Parameters
    ----------
    model : keras.Model
        A Keras 3 model on the TensorFlow backend that uses Keras' own
        ``train_step`` (overriding ``compute_loss`` or ``compute_metrics``
        is fine).
    checkpoints : str or sequence of keras.layers.Layer or str
        A strategy name for :func:`memsave.gradients` (``'memory'``,
        ``'speed'``, ``'collection'`` or one registered with
        :func:`memsave.strategies.register`), or layers of the model (or
        their names): the outputs of each call of those layers in the
        forward pass are the checkpoints.
    strategy_options : mapping, optional
        Options of the named strategy, e.g. ``{"num_checkpoints": 8}``.
    aggregation_method, gate_gradients
        Passed to :func:`memsave.gradients` (as to ``tf.gradients``).
    memory_budget : int or float, optional
        The forecast allocator peak of the whole ``fit`` train step allowed
        (weights, optimizer slots, metric state, the batch and the next one
        that fit prefetches included): in
        bytes, or as a fraction of plain ``fit``'s forecast step peak
        (:func:`plan`'s ``baseline_peak_bytes``). memsave then plans the
        least recomputation under it; a budget below every plan's forecast
        raises :class:`memsave.MemoryBudgetError` (with ``min_peak_bytes``)
        when ``fit`` traces the step.
    batch_size : int, optional
        The batch size to plan for when ``fit`` traces the step on batches
        of unknown size, as it does whenever the data's size is not a
        multiple of the batch size. By default, what ``fit``'s arguments
        say: its ``batch_size=``, Keras' 32 for arrays, a dataset's batch
        size (its static batch dimension, or the size its last
        ``batch(b)`` gives). Without any (a generator, a PyDataset),
        memsave plans for a batch of 1, where the weights outweigh every
        activation, and saves little; it warns when that happens.

    Returns
    -------
    keras.Model
        ``model`` itself.

    Raises
    ------
    KerasModelError
        When ``model`` is not a Keras 3 model on the TensorFlow backend, or
        its class overrides ``train_step`` (memsave would bypass that code;
        call :func:`memsave.gradients` in your own train step instead).
    UnknownStrategyError
        When ``checkpoints`` names no registered strategy.
    OptionsError
        When ``strategy_options`` are not options of that strategy.
    MemoryBudgetError
        When ``memory_budget`` is neither bytes (an int > 0) nor a fraction
        in (0, 1]. (A budget below every plan is refused when ``fit``
        traces the step, which is when memsave plans.)
    CheckpointError
        When a listed layer is not in the model, ``checkpoints`` is neither
        a name nor layers, or a list of layers comes with a budget.
    EagerExecutionError
        When the model is compiled with ``run_eagerly=True`` (here, or from
        ``fit`` if it is compiled so later): memsave rewrites graphs.

    Notes
    -----
    When fit traces the step, memsave rewrites the gradient graph of that
    trace; each replica's trace under ``tf.distribute`` is rewritten
    separately. Stateful ops (dropout's seed generator reads, batch
    normalization's moving-statistics updates) are kept, never recomputed,
    so the gradients equal plain fit's up to rounding (the order partial
    gradients are summed in; with bfloat16, which ops Grappler fuses).

    With ``'collection'``, tag tensors in the model's ``call`` while it is
    traced: ``if not tf.executing_eagerly():
    tf.compat.v1.add_to_collection('checkpoints', h)``.

    The setting lives on the instance only: it is not saved with the model
    (``model.save``, ``clone_model`` give plain models); call
    :func:`checkpointed` again after loading.
    """
    _check_model(model)
    config = _Config(
        strategy=_check_checkpoints(checkpoints),
        layers=_resolve_layers(model, checkpoints),
        gradient_options=dict(
            strategy_options=_check_strategy_options(strategy_options, checkpoints),
            aggregation_method=aggregation_method,
            gate_gradients=gate_gradients,
            **({} if memory_budget is None else {"memory_budget": memory_budget}),
        ),
    )
    _check_planning(checkpoints, strategy_options, memory_budget)
    if _private.compiled(model) and model.run_eagerly:
        raise EagerExecutionError(_EAGER_MESSAGE.format(name=model.name))
    batch_size = _check_batch_size(batch_size, "memsave.keras.checkpointed", "fit's arguments")
    step = functools.partial(_checkpointed_train_step, model, config)
    step = tf.autograph.experimental.do_not_convert(step)
    _private.set_train_step(model, _CheckpointedStep(step, config, batch_size))
    _private.set_fit(model, _CheckpointedFit(model))
    _private.drop_train_function(model)
    logger.info("memsave.keras: model %r trains with memsave (checkpoints=%r)",
                model.name, checkpoints)
    return model


def restore(model: keras.Model) -> keras.Model:
    """Undo :func:`checkpointed`: ``model.fit`` takes its gradients with the tape again.

    A no-op on a model that is not checkpointed. Returns ``model``.
    """
    if is_checkpointed(model):
        _private.delete_train_step(model)
        _private.delete_fit(model)
        _private.drop_train_function(model)
        logger.info("memsave.keras: model %r restored to Keras' train step", model.name)
    return model


def is_checkpointed(model) -> bool:
    """Whether :func:`checkpointed` is in effect on ``model``."""
    return isinstance(_private.instance_train_step(model), _CheckpointedStep)


def plan(
    model: keras.Model,
    x,
    y=None,
    *,
    checkpoints: str | Sequence[LayerRef] = "memory",
    strategy_options: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    memory_budget: int | float | None = None,
):
    """Forecast one ``fit`` train step's peak memory, plain and checkpointed, before training.

    Traces the train step :func:`checkpointed` gives the model (Keras'
    own step with memsave's gradients) on a batch shaped like ``x`` and
    ``y``, without running it, and returns the :class:`memsave.Plan` of
    its gradient call: ``predicted_peak_bytes`` is the allocator peak one
    checkpointed ``fit`` step is forecast to reach, ``baseline_peak_bytes``
    the same for plain ``fit``; both count the variables the step holds
    (weights, optimizer slots, metrics, moving statistics), the batch and
    the next batch, which fit's input pipeline prefetches while a step runs.
    Nothing is computed and the model is left as it was, except that what
    ``fit`` builds before its first step is built now (the optimizer's
    slots included).

    Parameters
    ----------
    model : keras.Model
        A compiled Keras 3 model on the TensorFlow backend that uses Keras'
        own ``train_step`` (as for :func:`checkpointed`).
    x, y
        A batch (arrays, tensors or ``tf.TensorSpec``; nested as ``fit``
        takes them), or a few samples of one when ``batch_size`` is given.
        Floats are cast to ``keras.config.floatx()``, as ``fit`` does. Or,
        as ``x`` alone, the ``tf.data.Dataset`` given to ``fit``: one of its
        batches, of the size ``fit`` runs it at (its static batch
        dimension, or what its last ``batch(b)`` gives; else pass
        ``batch_size``).
    checkpoints : str or sequence of keras.layers.Layer or str
        As for :func:`checkpointed`.
    strategy_options : mapping, optional
        As for :func:`checkpointed`.
    batch_size : int, optional
        The batch size to forecast for: replaces the leading dimension of
        every leaf of ``x`` and ``y``. Without it, the leading dimension of
        ``x`` (or the dataset's batch size) is the batch size (an unknown
        one is reported in the Plan's assumptions).
    memory_budget : int or float, optional
        As for :func:`checkpointed`: the plan of least recomputation whose
        forecast ``fit`` step peak fits (bytes, or a fraction of plain
        ``fit``'s forecast step peak).

    Returns
    -------
    memsave.Plan

    Raises
    ------
    KerasModelError
        When ``model`` is not a compiled Keras 3 model on the TensorFlow
        backend with Keras' own ``train_step``.
    EagerExecutionError
        When the model is compiled with ``run_eagerly=True``.
    UnknownStrategyError, CheckpointError
        As :func:`checkpointed`.
    MemoryBudgetError
        When ``memory_budget`` is invalid or below every plan's forecast.

    Notes
    -----
    The forecast is for one replica (no ``tf.distribute`` strategy); for a
    model compiled with ``jit_compile=True`` it is of the XLA-compiled step
    (see :mod:`memsave.xla`).

    Examples
    --------
    Pick the largest batch that fits in 4 GiB with checkpointing:

    >>> model.compile(optimizer="adam", loss="mse")  # doctest: +SKIP
    >>> for batch in (64, 128, 256, 512):  # doctest: +SKIP
    ...     p = memsave.keras.plan(model, x[:1], y[:1], batch_size=batch)
    ...     print(batch, p.baseline_peak_bytes >> 20, p.predicted_peak_bytes >> 20, "MiB")
    >>> print(memsave.keras.plan(model, x, y).summary())  # doctest: +SKIP
    """
    api = "memsave.keras.plan"
    _check_model(model, api)
    if not _private.compiled(model) or model.optimizer is None:
        raise KerasModelError(
            f"{api}: model {model.name!r} is not compiled; the forecast is of fit's train step, "
            "which needs the loss and the optimizer: call model.compile(optimizer=..., "
            "loss=...) first"
        )
    if model.run_eagerly:
        raise EagerExecutionError(_EAGER_MESSAGE.format(name=model.name))
    batch_size = _check_batch_size(batch_size, api, "x")
    x, y, batch_size = _unpack_dataset(x, y, batch_size, api)
    config = _Config(
        strategy=_check_checkpoints(checkpoints, api),
        layers=_resolve_layers(model, checkpoints, api),
        gradient_options=dict(
            strategy_options=_check_strategy_options(strategy_options, checkpoints, api),
            **({} if memory_budget is None else {"memory_budget": memory_budget}),
        ),
    )
    _check_planning(checkpoints, strategy_options, memory_budget, api)
    data = _batch_spec((x, y) if y is not None else (x,), batch_size, api)
    try:
        _private.build_as_fit_does(model, data)
    except ValueError as e:
        if y is not None:
            raise
        raise ArgumentError(
            f"{api}: model {model.name!r}'s loss could not be built without targets ({e}); "
            "pass y= as fit would get it") from e
    if not model.trainable_weights:
        raise KerasModelError(
            f"{api}: model {model.name!r} has no trainable weights, so fit takes no gradients: "
            "there is nothing to forecast"
        )

    planned = []

    def forward(data):
        loss, checkpoints = _forward_and_loss(model, config, data)
        planned.append(_memsave_plan(
            loss, model.trainable_weights, checkpoints=checkpoints, batch_size=batch_size,
            extra_resident_bytes=extra_resident_bytes(model) + _next_batch_bytes(data),
            **config.gradient_options))
        return loss

    # Traced as fit traces its step: with jit_compile, in an XLA context, so
    # that the forecast is XLA's (memsave.xla).
    tf.function(forward, autograph=False,
                jit_compile=bool(model.jit_compile)).get_concrete_function(data)
    return planned[0]


def extra_resident_bytes(model: keras.Model, allocator: Allocator | None = None) -> int:
    """Bytes of the variables a ``fit`` step holds besides those its gradient graph reads.

    memsave's forecast counts what the graph from the trainable weights to
    the loss reads; fit's step also holds the optimizer's slots and
    counters, the metrics' state and the non-trainable variables (moving
    statistics), all resident for the whole step. Each is counted as
    ``allocator`` (default: the device's) counts a buffer (on CPU, none
    under 256 KiB). A non-trainable variable read downstream of a trainable
    one (a frozen layer after a trained one) is counted twice: by the graph
    and here.
    """
    if allocator is None:
        allocator = device_model().allocator
    trainable = {id(v) for v in model.trainable_variables}
    seen: set = set()
    total = 0
    optimizer = getattr(model, "optimizer", None)  # Keras 3: no attribute until compiled
    optimizer = [] if optimizer is None else optimizer.variables
    for v in [*model.variables, *optimizer, *_private.metric_variables(model)]:
        if id(v) in trainable or id(v) in seen:
            continue
        seen.add(id(v))
        shape = tuple(v.shape)
        if all(isinstance(d, int) for d in shape):
            count = 1
            for d in shape:
                count *= d
            total += allocator.counted(count * tf.as_dtype(v.dtype).size)
    return total


def _check_batch_size(batch_size, api: str, default_from: str) -> int | None:
    """``batch_size`` as an int (a numpy integer is one), or None."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, numbers.Integral) or batch_size < 1):
        raise ArgumentError(f"{api}: batch_size={batch_size!r}; pass a positive int, or None to "
                            f"take the batch size from {default_from}")
    return None if batch_size is None else int(batch_size)


def _batch_known(data) -> bool:
    """Whether every leaf of a traced batch has a static first dimension."""
    return all(getattr(leaf, "shape", None) is None or not leaf.shape.rank
               or leaf.shape[0] is not None for leaf in tf.nest.flatten(data))


def _next_batch_bytes(data, batch_size: int | None = None,
                      allocator: Allocator | None = None) -> int:
    """Bytes of the batch ``fit``'s input pipeline holds ready while a step runs.

    Keras' data adapters end their ``tf.data`` pipelines in a prefetch: the
    next batch is made while the step runs, so fit's peak holds two batches
    (measured on a Dense stack with 1 MiB batches: plain fit's peak 1-3 MiB
    over its train_on_batch's). ``data`` is the step's batch (tensors or
    TensorSpecs); an unknown first dimension is ``batch_size``, and a leaf
    of another unknown dimension counts nothing.
    """
    if allocator is None:
        allocator = device_model().allocator
    total = 0
    for leaf in tf.nest.flatten(data):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            continue
        shape = tf.TensorShape(shape)
        if shape.rank and shape[0] is None and batch_size is not None:
            shape = tf.TensorShape([batch_size]).concatenate(shape[1:])
        if not shape.is_fully_defined():
            continue
        total += allocator.counted(shape.num_elements() * tf.as_dtype(dtype).size)
    return total


def _batch_spec(data: tuple, batch_size: int | None, api: str) -> tuple:
    """TensorSpecs of a batch as fit sees it: floats as floatx, batch dimension set."""
    floatx = tf.as_dtype(keras.config.floatx())

    def spec(leaf):
        if leaf is None:
            return None
        if isinstance(leaf, tf.TensorSpec):
            shape, dtype = leaf.shape, leaf.dtype
        else:
            try:
                t = leaf if isinstance(leaf, tf.Tensor) else tf.convert_to_tensor(leaf)
            except (TypeError, ValueError) as e:
                raise ArgumentError(
                    f"{api}: cannot read the shape of a batch entry of type "
                    f"{type(leaf).__name__} ({e}); pass arrays, tensors or tf.TensorSpec"
                ) from None
            shape, dtype = t.shape, t.dtype
        if dtype.is_floating and dtype != floatx:
            dtype = floatx
        if batch_size is not None:
            if shape.rank is None or shape.rank == 0:
                raise ArgumentError(f"{api}: batch_size={batch_size} needs every batch entry to have "
                                 f"a leading (batch) dimension; got shape {shape}")
            shape = tf.TensorShape([batch_size]).concatenate(shape[1:])
        return tf.TensorSpec(shape, dtype)

    return tuple(tf.nest.map_structure(spec, d) if d is not None else None for d in data)


# -- the train step ----------------------------------------------------------

_EAGER_MESSAGE = (
    "memsave.keras: model {name!r} runs its train step eagerly (run_eagerly=True), but "
    "memsave rewrites the traced graph of the step; compile with run_eagerly=False (the "
    "default), or memsave.keras.restore(model) to train eagerly without memsave"
)


@dataclasses.dataclass(frozen=True)
class _Config:
    strategy: str | None  # a strategy name, or None when layers are listed
    layers: tuple  # keras.layers.Layer whose outputs are the checkpoints
    gradient_options: dict


class _CheckpointedStep:
    """The instance's ``train_step``: a callable that knows it is memsave's.

    ``batch_size`` is what the gradients plan for where the traced batch
    has no static size: the user's, else the one :class:`_CheckpointedFit`
    reads from ``fit``'s arguments.
    """

    def __init__(self, step, config: _Config, batch_size: int | None = None):
        self._step = step
        self.config = config
        self.given_batch_size = batch_size
        self.batch_size = batch_size
        self.__name__ = "train_step"

    def __call__(self, data):
        return self._step(data, batch_size=self.batch_size)

    def __repr__(self) -> str:
        what = self.config.strategy or [layer.name for layer in self.config.layers]
        given = "".join(f", {k}={v!r}" for k, v in self.config.gradient_options.items()
                        if v is not None and v is not False)
        return f"<memsave.keras checkpointed train_step, checkpoints={what!r}{given}>"


class _CheckpointedFit:
    """The instance's ``fit``: Keras' own, after noting the batch size it runs at.

    Keras traces the step on its dataset's element spec, whose batch
    dimension is unknown whenever the last batch is partial; the step then
    plans for this batch size (:attr:`_CheckpointedStep.batch_size`). A
    trace planned for another size is dropped.
    """

    def __init__(self, model: keras.Model):
        self._model = weakref.ref(model)
        self.__name__ = "fit"
        self.__doc__ = type(model).fit.__doc__

    def __call__(self, *args, **kwargs):
        model = self._model()
        fit = type(model).fit
        step = _private.instance_train_step(model)
        if isinstance(step, _CheckpointedStep) and step.given_batch_size is None:
            signature = inspect.signature(fit)
            if not {"x", "batch_size"} <= set(signature.parameters):
                # An override taking (*args, **kwargs) passes them on to Keras' fit.
                signature = inspect.signature(keras.Model.fit)
            try:
                bound = signature.bind(model, *args, **kwargs).arguments
            except TypeError:
                bound = {}  # Keras' fit reports the bad call itself
            size = _fit_batch_size(bound.get("x"), bound.get("batch_size"))
            replicas = model.distribute_strategy.num_replicas_in_sync
            if size is not None and replicas > 1:  # each replica's step takes its share
                size = -(-size // replicas)
            if size != step.batch_size:
                step.batch_size = size
                _private.drop_train_function(model)
        return fit(model, *args, **kwargs)


def _unpack_dataset(x, y, batch_size: int | None, api: str) -> tuple:
    """``(x, y, batch_size)`` for a forecast: as given, unless ``x`` is a
    ``tf.data.Dataset``, which stands for one of its batches as ``fit``
    takes them: its element spec unpacked by Keras' own
    ``unpack_x_y_sample_weight`` (the weights take no part in the
    forecast), at the batch size ``fit`` runs it at
    (:func:`_fit_batch_size`) unless ``batch_size`` is given."""
    if not isinstance(x, tf.data.Dataset):
        return x, y, batch_size
    if y is not None:
        raise ArgumentError(f"{api}: x is a tf.data.Dataset, which yields the targets itself; "
                            "pass y=None, as fit takes it")
    try:
        bx, by, _ = keras.utils.unpack_x_y_sample_weight(x.element_spec)
    except ValueError as e:
        raise ArgumentError(f"{api}: the dataset's elements are not batches fit takes ({e})") from None
    size = batch_size if batch_size is not None else _fit_batch_size(x, None)
    return bx, by, size


def _fit_batch_size(x, batch_size) -> int | None:
    """The batch size ``fit(x, batch_size=batch_size)`` runs at, as far as its arguments tell."""
    if isinstance(x, tf.data.Dataset):
        leaves = tf.nest.flatten(x.element_spec)
        shape = getattr(leaves[0], "shape", None) if leaves else None
        static = shape[0] if shape is not None and shape.rank else None
        # dataset.batch(b) without drop_remainder: a None batch, b read from the pipeline
        return static if static is not None else _tf_private.dataset_batch_size(x)
    leaves = tf.nest.flatten(x)
    shapes = [getattr(v, "shape", None) for v in leaves]
    if not leaves or any(s is None or not tf.TensorShape(s).rank for s in shapes):
        return batch_size  # a generator, a PyDataset: they batch themselves
    size = batch_size or 32  # Keras' default for arrays
    rows = tf.TensorShape(shapes[0])[0]
    return min(size, int(rows)) if rows is not None else size


def _checkpointed_train_step(model: keras.Model, config: _Config, data,
                             batch_size: int | None = None):
    """Keras' TensorFlowTrainer.train_step with memsave's gradients (see module doc).

    The module's ``_memsave_gradients`` is looked up when the step is traced.
    """
    x, y, sample_weight, y_pred, loss, checkpoints = _forward_and_loss(
        model, config, data, with_outputs=True)
    if model.trainable_weights:
        trainable_weights = model.trainable_weights
        if batch_size is None and not _batch_known(data):
            logger.warning(
                "memsave.keras: fit traces model %r's step on batches of unknown size and "
                "its arguments give no batch size (a generator, a PyDataset, a dataset whose "
                "batching memsave cannot read): memsave plans for a batch of 1, where the "
                "weights outweigh every activation, and saves little; pass batch_size= to "
                "memsave.keras.checkpointed", model.name)
        if not model.optimizer.built:
            # apply_gradients would build the slots below; built now, the
            # budget counts them, as memsave.keras.plan does (fit traces
            # its step again once they exist, and that plan would differ).
            model.optimizer.build(trainable_weights)
        gradients = _memsave_gradients(
            loss, trainable_weights, checkpoints=checkpoints, batch_size=batch_size,
            extra_resident_bytes=extra_resident_bytes(model) + _next_batch_bytes(data, batch_size),
            **config.gradient_options
        )
        model.optimizer.apply_gradients(zip(gradients, trainable_weights))
    else:
        # Keras' own step warns with warnings.warn; so does this one, for the same filters.
        warnings.warn("The model does not have any trainable weights.")

    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _forward_and_loss(model: keras.Model, config: _Config, data, *, with_outputs: bool = False):
    """The train step up to its loss: ``(loss, checkpoints)`` for memsave's gradients.

    With ``with_outputs``: ``(x, y, sample_weight, y_pred, loss, checkpoints)``.
    The loss tracker is updated and the loss scaled, as Keras' step does.
    """
    if tf.executing_eagerly():
        raise EagerExecutionError(_EAGER_MESSAGE.format(name=model.name))
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    with _recording_outputs(config.layers) as outputs:
        if _private.call_has_training_arg(model):
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
    loss = _private.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    _private.loss_tracker(model).update_state(
        _private.unscale_loss_for_distribution(loss),
        sample_weight=tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0],
    )
    if model.optimizer is not None:
        loss = model.optimizer.scale_loss(loss)
    checkpoints = None
    if model.trainable_weights:
        checkpoints = config.strategy if config.strategy is not None else _checkpoint_tensors(
            config.layers, outputs, loss)
    if with_outputs:
        return x, y, sample_weight, y_pred, loss, checkpoints
    return loss, checkpoints


@contextlib.contextmanager
def _recording_outputs(layers: Sequence) -> Iterator[dict]:
    """Record the outputs of every call of ``layers`` made by this thread in the block.

    Yields ``{id(layer): [output, ...]}``. While any block is open, each
    listed layer's ``call`` is wrapped (see ``_private.wrap_call``); the
    wrapper appends to the recording of the thread calling it, so replicas
    of a MirroredStrategy (one thread each, which may interleave at
    cross-replica ops) each see their own outputs only.
    """
    recorded: dict = {id(layer): [] for layer in layers}
    previous = getattr(_recording, "current", None)
    _recording.current = recorded
    entered = []
    try:
        for layer in layers:
            _wrap(layer)
            entered.append(layer)
        yield recorded
    finally:
        for layer in reversed(entered):
            _unwrap(layer)
        _recording.current = previous


_recording = threading.local()
_wrapped_lock = threading.Lock()
_wrapped: dict = {}  # id(layer) -> [open blocks, what wrap_call returned]


def _wrap(layer) -> None:
    with _wrapped_lock:
        entry = _wrapped.get(id(layer))
        if entry is None:
            key = id(layer)

            def record(out):
                current = getattr(_recording, "current", None)
                if current is not None and key in current:
                    current[key].append(out)

            entry = _wrapped[key] = [0, _private.wrap_call(layer, record)]
        entry[0] += 1


def _unwrap(layer) -> None:
    with _wrapped_lock:
        entry = _wrapped[id(layer)]
        entry[0] -= 1
        if entry[0] == 0:
            _private.unwrap_call(layer, entry[1])
            del _wrapped[id(layer)]


def _checkpoint_tensors(layers: Sequence, recorded: dict, loss: tf.Tensor) -> list:
    """The floating outputs the step's forward pass (``loss``'s graph) got
    from ``layers`` and computed the loss from.

    Calls traced elsewhere are left out: Keras builds a layer the first
    time it is called by calling its sublayers in a scratch graph of its own
    (``compute_output_spec``), a subclassed model's during the first step.
    So are outputs the loss does not read (Keras' RNN runs its cell once
    outside the loop, for shapes only; a second output no loss reads); a
    layer none of whose outputs the loss reads is an error naming it.
    """
    graph = loss.graph
    out = []
    read = _ancestors(loss.op)
    for layer in layers:
        calls = recorded[id(layer)]
        if not calls:
            raise CheckpointError(
                f"memsave.keras: checkpoint layer {layer.name!r} was not called in the forward "
                "pass of the train step; list layers the model calls when training"
            )
        flat = [t for value in calls for t in tf.nest.flatten(value) if isinstance(t, tf.Tensor)]
        top = [t for t in flat if t.graph is graph]
        tensors = [t for t in top if t.op in read]
        if top and not tensors and len(top) == len(flat):
            raise CheckpointError(
                f"memsave.keras: checkpoint layer {layer.name!r}: the loss is not computed "
                "from its outputs (an output only metrics read, say); list layers the loss "
                "is computed from"
            )
        if not tensors:
            raise CheckpointError(
                f"memsave.keras: checkpoint layer {layer.name!r} runs "
                f"{'' if top else 'only '}inside a loop or function of the train step (an "
                "RNN's cell, say), whose outputs are not tensors of the step"
                + (", and its other calls' outputs do not reach the loss" if top else "")
                + "; list the layer that contains the loop"
            )
        out.extend(t for t in tensors if t.dtype.is_floating)
    return out


def _ancestors(op: tf.Operation) -> set:
    """``op`` and the ops of its graph it reads from, by data edges."""
    seen = {op}
    stack = [op]
    while stack:
        for t in stack.pop().inputs:
            if t.op not in seen:
                seen.add(t.op)
                stack.append(t.op)
    return seen


# -- validation --------------------------------------------------------------


def _check_model(model, api: str = "memsave.keras.checkpointed") -> None:
    if not isinstance(model, keras.Model):
        raise KerasModelError(
            f"{api}: expected a keras.Model (Keras 3), got {model!r} "
            f"({type(model).__module__}.{type(model).__qualname__}); for tf_keras or custom "
            "training loops call memsave.gradients(loss, variables) inside the tf.function"
        )
    if keras.backend.backend() != "tensorflow":
        raise KerasModelError(
            f"{api}: Keras runs on the {keras.backend.backend()!r} "
            "backend; memsave rewrites TensorFlow graphs: set KERAS_BACKEND=tensorflow"
        )
    instance_step = _private.instance_train_step(model)
    if instance_step is not _MISSING and not isinstance(instance_step, _CheckpointedStep):
        raise KerasModelError(
            f"{api}: model {model.name!r} has a train_step set on the "
            "instance, which memsave would replace; remove it, or call memsave.gradients "
            "in it instead of tape.gradient"
        )
    if _private.class_train_step(model) is not _private.stock_train_step():
        raise KerasModelError(
            f"{api}: {type(model).__qualname__} overrides train_step, "
            "which memsave would bypass; in your train_step compute the gradients with "
            "memsave.gradients(loss, self.trainable_weights, checkpoints='memory') instead "
            "of tape.gradient (fit traces it, so memsave can rewrite it)"
        )


#: What memsave.keras takes as checkpoints= besides a strategy name (for errors).
_LAYERS = "a list of the model's layers or layer names"


def _check_checkpoints(checkpoints, api: str = "memsave.keras.checkpointed") -> str | None:
    """The strategy name, or None for a list of layers; raise on anything else."""
    if isinstance(checkpoints, str):
        planners.get(checkpoints, api=api, instead=_LAYERS)  # now, not deep in fit
        return checkpoints
    if isinstance(checkpoints, Sequence) and checkpoints and all(
        isinstance(c, (str, keras.layers.Layer)) for c in checkpoints
    ):
        return None
    raise CheckpointError(
        f"{api}: checkpoints={checkpoints!r}; pass a strategy name "
        f"({', '.join(planners.available())}) or a non-empty list of the model's layers "
        "(or layer names) whose outputs to keep. Tensors do not exist before fit traces "
        "the step: tag them with tf.compat.v1.add_to_collection('checkpoints', t) in the "
        "model's call and use checkpoints='collection'"
    )


def _check_planning(checkpoints, options, memory_budget,
                    api: str = "memsave.keras.checkpointed") -> None:
    """Refuse now what memsave.gradients would refuse when fit traces the
    step: options the strategy does not take, a budget that is neither
    bytes nor a fraction, a budget beside a list of layers."""
    if isinstance(checkpoints, str):
        planners.check(checkpoints, budget=memory_budget, options=options, api=api,
                       instead=_LAYERS)
    elif memory_budget is not None:
        raise budget_refused("a list of layers", api)


def _check_strategy_options(options, checkpoints, api: str = "memsave.keras.checkpointed") -> dict | None:
    if options is None:
        return None
    if not isinstance(checkpoints, str):
        raise OptionsError(
            f"{api}: strategy_options apply to a strategy name only, "
            f"not to checkpoints={checkpoints!r}"
        )
    if not isinstance(options, Mapping):
        raise OptionsError(
            f"{api}: strategy_options={options!r}; pass a mapping "
            "such as {'num_checkpoints': 8}"
        )
    return dict(options)


def _resolve_layers(model: keras.Model, checkpoints, api: str = "memsave.keras.checkpointed") -> tuple:
    if isinstance(checkpoints, str):
        return ()
    by_name: dict = {}
    every = []
    stack = list(reversed(_private.sublayers(model)))
    while stack:
        layer = stack.pop()
        every.append(layer)
        by_name.setdefault(layer.name, layer)
        stack.extend(reversed(_private.sublayers(layer)))
    known = {id(layer) for layer in every}
    out = []
    for c in checkpoints:
        layer = by_name.get(c) if isinstance(c, str) else (c if id(c) in known else None)
        if layer is None:
            raise CheckpointError(
                f"{api}: checkpoint layer {c!r} is not a layer of model "
                f"{model.name!r}; its layers are {sorted(by_name)}"
            )
        if id(layer) not in {id(o) for o in out}:
            out.append(layer)
    return tuple(out)


# -- Private Keras API (all of it, in one place) -------------------------------
#
# Checked against Keras 3.15 (keras/src/backend/tensorflow/trainer.py,
# keras/src/trainers/trainer.py, keras/src/losses/loss.py).

_MISSING = object()


class _private:
    """Every use of Keras internals by this module."""

    @staticmethod
    def sublayers(layer) -> list:
        """The layers ``layer`` tracks itself, input layers left out: a model's,
        and a wrapper's (``TimeDistributed``, ``Bidirectional``) or a
        custom layer's inner layers, which ``layers`` does not list."""
        return [sub for sub in getattr(layer, "_layers", ())
                if not isinstance(sub, keras.layers.InputLayer)]

    @staticmethod
    def wrap_call(layer, record):
        """Make ``layer`` pass each output of its ``call`` to ``record``; returns the undo token.

        Keras' ``Operation.__call__`` looks ``self.call`` up on every call
        (keras/src/ops/operation.py), so an instance attribute wraps it
        without touching the class.
        """
        previous = vars(layer).get("call", _MISSING)
        call = layer.call

        @functools.wraps(call)
        def recording_call(*args, **kwargs):
            out = call(*args, **kwargs)
            record(out)
            return out

        object.__setattr__(layer, "call", recording_call)
        return previous

    @staticmethod
    def unwrap_call(layer, previous) -> None:
        if previous is _MISSING:
            object.__delattr__(layer, "call")
        else:
            object.__setattr__(layer, "call", previous)

    @staticmethod
    def stock_train_step():
        """Keras' TensorFlow ``train_step``, the one :func:`checkpointed` replaces."""
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        return TensorFlowTrainer.train_step

    @staticmethod
    def class_train_step(model):
        return type(model).train_step

    @staticmethod
    def instance_train_step(model):
        try:
            return vars(model).get("train_step", _MISSING)
        except TypeError:
            return _MISSING

    @staticmethod
    def set_train_step(model, step) -> None:
        # object.__setattr__: Layer.__setattr__ would offer the callable to
        # Keras' tracker (variables, layers, metrics); it is none of those.
        object.__setattr__(model, "train_step", step)

    @staticmethod
    def delete_train_step(model) -> None:
        object.__delattr__(model, "train_step")

    @staticmethod
    def set_fit(model, fit) -> None:
        object.__setattr__(model, "fit", fit)  # as set_train_step

    @staticmethod
    def delete_fit(model) -> None:
        if "fit" in vars(model):
            object.__delattr__(model, "fit")

    @staticmethod
    def drop_train_function(model) -> None:
        # fit calls make_train_function(), which reuses model.train_function
        # when it is set; compile() resets it the same way.
        model.train_function = None

    @staticmethod
    def compiled(model) -> bool:
        return bool(getattr(model, "compiled", False))

    @staticmethod
    def call_has_training_arg(model) -> bool:
        return model._call_has_training_arg  # pylint: disable=protected-access

    @staticmethod
    def compute_loss(model, **kwargs):
        # _compute_loss passes training=True only to compute_loss overrides
        # that accept it (the argument is new in Keras 3.3).
        return model._compute_loss(training=True, **kwargs)  # pylint: disable=protected-access

    @staticmethod
    def loss_tracker(model):
        return model._loss_tracker  # pylint: disable=protected-access

    @staticmethod
    def unscale_loss_for_distribution(loss):
        from keras.src.losses.loss import unscale_loss_for_distribution

        return unscale_loss_for_distribution(loss)

    @staticmethod
    def build_as_fit_does(model, data) -> None:
        """Build the model, its loss and metrics and the optimizer's slots, as fit does first.

        ``Trainer._symbolic_build`` is what ``fit`` calls before its first
        step, in the model's distribution strategy's scope (outside it, a
        model compiled under a ``tf.distribute`` strategy failed half way,
        leaving an optimizer marked built without its slots, so that a
        later plain ``fit`` failed too); it takes anything with a shape and
        dtype (TensorSpecs here).
        """
        with model.distribute_strategy.scope():
            model._symbolic_build(data_batch=data)  # pylint: disable=protected-access

    @staticmethod
    def metric_variables(model) -> list:
        return [v for m in model.metrics for v in m.variables]


from memsave.capacity import max_batch_size  # noqa: E402,F401  (re-exported: "will it fit?")
