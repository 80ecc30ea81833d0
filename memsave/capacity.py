"""Will it fit? The largest batch whose forecast ``fit`` step fits in memory.

:func:`max_batch_size` answers "at what batch size does my Keras model
train in this much memory?" from :func:`memsave.keras.plan`'s forecast of
one ``fit`` step, without running one. ``memsave.keras.max_batch_size`` is
this function.

Data flow::

    max_batch_size(model, x, y, memory=..., checkpoints=..., memory_budget=...)
      -> validate: a compiled Keras model, a positive memory (bytes or "8GiB"),
         x and y with a leading batch dimension
      -> search over b (see _search): forecast(b) = memsave.keras.plan(model,
         x, y, batch_size=b) (one trace of the train step each, cached by b)
      -> the largest b whose padded forecast fits, with the padded forecast of
         b + 1 over: forecast(b) * (1 + margin) <= memory < forecast(b + 1) * (1 + margin)

This module imports Keras (through :mod:`memsave.keras`) only when
:func:`max_batch_size` runs: the command line (:mod:`memsave.cli`) reads
its arguments with :func:`parse_bytes` and the constants without Keras.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

from memsave.errors import MemoryBudgetError, MemsaveError

__all__ = [
    "max_batch_size",
    "parse_bytes",
    "FORECAST_MARGIN_PLAIN",
    "FORECAST_MARGIN_CHECKPOINTED",
    "default_margin",
    "MAX_BATCH_SIZE",
    "CapacityError",
    "NoBatchFitsError",
]

logger = logging.getLogger(__name__)

#: The forecast's known error, covered: a batch fits when its forecast peak
#: times ``1 + margin`` is at most the memory. The margin of plain ``fit``'s
#: forecast. One real ``fit`` step (its data iterator's copies of the batch
#: included) at the largest batch found peaked at 1.07-1.20x the forecast
#: on MobileNetV2 96x96, a 4-block Transformer encoder and a 48-layer MLP
#: (three runs of experiments/will_it_fit.py; the Transformer varies most
#: from process to process), 1.05x and 1.10x on ResNet50 and
#: EfficientNetB0 64x64 (held out); the largest shortfall among the
#: forecast's own test models is 1.24x (a Keras Transformer's plain step
#: at batch 16, experiments/forecast.py). On a busy machine the executor
#: runs ops in another order and holds more at once: the test suite's MLP
#: (12 x Dense 256, 64 MiB) peaked at 1.07-1.21x, alone or beside other
#: processes, and over 1.25x once in the full suite under xdist.
FORECAST_MARGIN_PLAIN = 0.35

#: The margin of memsave's (checkpointed) forecast, less accurate at large
#: batches: on the same runs real steps peaked at 1.22-1.30x (MLP),
#: 1.25-1.36x (Transformer: the executor holds one or two more
#: attention-sized tensors than the forecast's order, varying from call to
#: call) and 1.37-1.41x (MobileNetV2: Grappler's memory optimizer
#: (SchedulingPass) turns an AddN of three or more gradients in a recomputed
#: segment into a TemporaryVariable accumulator, and constant folding turns
#: its ZerosLike initial value into a batch-sized constant that the step
#: function holds, 108 MiB at batch 128) the forecast; 1.34x and 1.12x on
#: ResNet50 and EfficientNetB0 (held out). The test suite's MLP peaked at
#: 1.30-1.41x alone and 1.10-1.52x with three other fit steps running
#: beside it (the order of a recomputed segment and the optimizer's updates
#: varies with load).
FORECAST_MARGIN_CHECKPOINTED = 0.6

#: The largest batch :func:`max_batch_size` reports: TensorFlow computes
#: shapes in int32 in many kernels, so no larger batch can run. A model
#: whose forecast at this batch still fits gets this answer.
MAX_BATCH_SIZE = 2**31 - 1

#: Before a batch that does not fit is known, each new probe is at most this
#: many times the largest batch known to fit (and at least twice it).
GROWTH_LIMIT = 64

_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


class CapacityError(MemsaveError, ValueError):
    """:func:`max_batch_size` was given a value it cannot use."""


class NoBatchFitsError(CapacityError):
    """Not even a batch of one is forecast to fit in the memory given.

    Attributes
    ----------
    batch_1_peak_bytes : int
        What a batch of one is forecast to need: the forecast peak of its
        ``fit`` step, or the weights and the batch with every buffer counted
        where those are more (the forecast leaves out buffers under the
        allocator's counting threshold).
    memory_bytes : int
        The memory asked for.
    """

    def __init__(self, message: str, batch_1_peak_bytes: int, memory_bytes: int) -> None:
        super().__init__(message)
        self.batch_1_peak_bytes = batch_1_peak_bytes
        self.memory_bytes = memory_bytes


# -- public API ------------------------------------------------------------


def max_batch_size(
    model,
    x,
    y=None,
    *,
    memory: int | str,
    checkpoints: str | None = "memory",
    memory_budget: int | float | None = None,
    margin: float | None = None,
) -> int:
    """The largest batch size whose forecast ``fit`` step fits in ``memory``.

    Searches over :func:`memsave.keras.plan`'s forecast of one ``fit``
    train step (no step runs) for the largest batch ``b`` with
    ``forecast(b) * (1 + margin) <= memory`` and ``forecast(b + 1) * (1 +
    margin) > memory``.

    Parameters
    ----------
    model : keras.Model
        A compiled Keras 3 model on the TensorFlow backend (as for
        :func:`memsave.keras.plan`).
    x, y
        A batch, or a few samples of one (arrays, tensors or
        ``tf.TensorSpec``, nested as ``fit`` takes them): the shape after
        the leading (batch) dimension and the dtype are read, and the
        search starts at the leading dimension of ``x``. Or, as ``x``
        alone, a ``tf.data.Dataset`` (as for :func:`memsave.keras.plan`):
        the search starts at its batch size.
    memory : int or str
        The memory a step may use: bytes, or a size such as ``"8GiB"``,
        ``"512MiB"``, ``"2GB"`` (see :func:`parse_bytes`). The allocator's
        peak counts everything the step holds: weights, optimizer slots and
        the batch included. A batch fits only if the weights and the batch
        fit too with every buffer counted: the CPU allocator leaves out
        buffers under 256 KiB, so a small model's forecast peak may be 0
        bytes.
    checkpoints : str or None
        ``None`` for plain ``fit``; else a strategy name, the step
        :func:`memsave.keras.checkpointed` gives the model.
    memory_budget : int or float, optional
        As for :func:`memsave.keras.plan` (with ``checkpoints='memory'``):
        each batch's checkpoints are planned to this budget, and a batch
        whose budget cannot be met does not fit. A fraction may be unmet
        at small batches (a fraction of a small peak leaves less than the
        weights need) and met at larger ones: pass a batch in ``x`` that
        meets it, where the search starts.
    margin : float, optional
        The forecast's error to cover, as a fraction of the forecast;
        0 trusts the forecast exactly. Default :data:`FORECAST_MARGIN_PLAIN`
        (0.35) with ``checkpoints=None``, and at batches where memsave's
        plan recomputes nothing (its step is plain fit's); else
        :data:`FORECAST_MARGIN_CHECKPOINTED` (0.6).

    Returns
    -------
    int
        The batch size, at most :data:`MAX_BATCH_SIZE`.

    Raises
    ------
    NoBatchFitsError
        When a batch of one is forecast over ``memory``; it carries that
        forecast (``batch_1_peak_bytes``).
    CapacityError
        When ``memory`` is not a positive size, ``margin`` is negative, or
        a leaf of ``x`` or ``y`` has no leading (batch) dimension.
    KerasModelError
        When ``model`` is not a compiled Keras 3 model (and as
        :func:`memsave.keras.plan`).
    MemoryBudgetError
        When ``memory_budget`` is given with ``checkpoints=None``, or is
        invalid.

    Notes
    -----
    Each forecast traces the train step once (seconds on a large model),
    so the search spends few: a growth phase (each probe at most
    :data:`GROWTH_LIMIT` times the largest batch known to fit) until a
    batch does not fit, then a bracket ``[fits, does not fit]`` narrowed
    by interpolating the forecast (nearly affine in the batch once its
    tensors are above the allocator's counting threshold), with a
    bisection whenever an interpolation fails to halve the bracket.
    The answer satisfies the contract above even where the forecast is
    not monotone in the batch (a strategy may choose differently at
    each), but it is then not necessarily the largest such batch.

    Huge answers: the forecast counts the batch itself, resident for the
    whole step, so no batch over ``memory / bytes of one sample of x and
    y`` fits (once the batch is over the allocator's 256 KiB counting
    threshold), and the growth phase reaches that bound within about
    ``log2(memory)`` probes. Answers are capped at
    :data:`MAX_BATCH_SIZE` (TensorFlow's int32 shape arithmetic), which
    is returned when it fits: only a model whose sample is a few bytes,
    given gigabytes, gets there.

    Examples
    --------
    >>> model.compile(optimizer="adam", loss="mse")  # doctest: +SKIP
    >>> memsave.keras.max_batch_size(model, x, y, memory="4GiB", checkpoints=None)  # doctest: +SKIP
    212
    >>> memsave.keras.max_batch_size(model, x, y, memory="4GiB")  # doctest: +SKIP
    540
    """
    api = "memsave.keras.max_batch_size"
    memory_bytes = parse_bytes(memory, what="memory", api=api)
    if margin is not None:
        _check_margin(margin, api)
    forecasts = Forecasts(model, x, y, checkpoints=checkpoints, memory_budget=memory_budget,
                          api=api)
    return forecasts.max_batch_size(memory_bytes, plain=checkpoints is None, margin=margin,
                                    start=forecasts.given_batch_size)


def parse_bytes(value: int | str, *, what: str = "memory", api: str = "memsave") -> int:
    """Bytes from an int or a size: ``"8GiB"``, ``"1.5 GB"``, ``"512MiB"``, ``"4096"``.

    Units (case-insensitive): B, KiB, MiB, GiB, TiB (powers of 1024); KB,
    MB, GB, TB (powers of 1000); none means bytes. Raises
    :class:`CapacityError` for anything else, or a size under one byte.
    """
    allowed = "B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)"
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise CapacityError(
            f"{api}: {what}={value!r}; pass a number of bytes (int) or a size such as '8GiB' "
            f"(units {allowed})")
    if isinstance(value, numbers.Integral):  # a numpy integer is one
        size = int(value)
    else:
        m = _SIZE.fullmatch(value)
        unit = m and _UNITS.get(m.group(2).lower())
        if not m or unit is None:
            raise CapacityError(
                f"{api}: {what}={value!r} is not a size; write a number and a unit, such as "
                f"'8GiB' or '512MB' (units {allowed}; none means bytes)")
        size = math.floor(float(m.group(1)) * unit)
    if size < 1:
        raise CapacityError(f"{api}: {what}={value!r}; it must be at least one byte")
    return size


# -- forecasts by batch size ---------------------------------------------------


class Forecasts:
    """Forecast peaks of one model's ``fit`` step, by batch size, each traced once.

    ``peak(b, plain=False)`` is memsave's forecast (the plan's
    ``predicted_peak_bytes``), ``peak(b, plain=True)`` plain ``fit``'s
    (``baseline_peak_bytes``): one trace gives both, so a caller that
    wants both answers (the command line) pays once per batch, and each
    search starts from every batch already traced. ``checkpoints=None``
    plans with ``'collection'`` (no strategy runs, nothing is kept; the
    plain figure is the same) and has no memsave figure.
    """

    def __init__(self, model, x, y=None, *, checkpoints: str | None = "memory",
                 memory_budget: int | float | None = None,
                 api: str = "memsave.keras.max_batch_size"):
        import memsave.keras  # Keras is imported here, on first use

        self._keras_plan = memsave.keras.plan
        self.api = api
        self.checkpoints = checkpoints
        self.memory_budget = memory_budget
        self.model = model
        _check_compiled(model, api)
        if checkpoints is None and memory_budget is not None:
            raise MemoryBudgetError(
                f"{api}: memory_budget={memory_budget!r} plans memsave's checkpoints, but "
                "checkpoints=None asks for plain fit; pass checkpoints='memory' with the budget, "
                "or drop the budget")
        x, y, size = memsave.keras._unpack_dataset(x, y, None, api)
        self.x, self.y = _check_batch_dimension((x, y), api)
        #: A dataset's batch size, else the leading dimension of x's first
        #: entry (1 when unknown): where a search starts.
        self.given_batch_size = size or _leading_dimension(self.x)
        self._plans: dict[int, Any] = {}  # batch -> Plan, or the MemoryBudgetError it raised

    @property
    def traces(self) -> int:
        """How many batch sizes have been traced (and planned)."""
        return len(self._plans)

    def plan(self, batch_size: int):
        """The :class:`memsave.Plan` at ``batch_size`` (cached); None when its budget is unmet."""
        if batch_size not in self._plans:
            options = {} if self.memory_budget is None else {"memory_budget": self.memory_budget}
            try:
                p = self._keras_plan(self.model, self.x, self.y, batch_size=batch_size,
                                     checkpoints=self.checkpoints or "collection", **options)
            except MemoryBudgetError as e:
                if e.min_peak_bytes is None:  # the budget itself is invalid
                    raise
                p = e
            self._plans[batch_size] = p
            logger.info("%s: batch %d: %s", self.api, batch_size, p if isinstance(p, Exception)
                        else f"forecast peak {p.baseline_peak_bytes:,} bytes plain, "
                             f"{p.predicted_peak_bytes:,} bytes checkpointed")
        p = self._plans[batch_size]
        return None if isinstance(p, Exception) else p

    def unmet(self, batch_size: int) -> MemoryBudgetError | None:
        """The error planning ``batch_size`` to the memory budget raised, if it did."""
        p = self._plans.get(batch_size)
        return p if isinstance(p, MemoryBudgetError) else None

    def peak(self, batch_size: int, *, plain: bool) -> float:
        """The forecast peak in bytes (plain fit's, or memsave's); inf when the budget is unmet."""
        p = self.plan(batch_size)
        if p is None:
            return math.inf
        return p.baseline_peak_bytes if plain else p.predicted_peak_bytes

    def margin(self, batch_size: int, *, plain: bool, margin: float | None = None) -> float:
        """The margin the forecast at ``batch_size`` is padded by: ``margin``, or the default.

        The default is :data:`FORECAST_MARGIN_PLAIN` for plain fit, and for
        a memsave plan that recomputes nothing (its step is plain fit's);
        :data:`FORECAST_MARGIN_CHECKPOINTED` for one that recomputes.
        """
        if margin is not None:
            return margin
        p = self.plan(batch_size)
        return default_margin(plain or p is None or p.recomputed_ops == 0)

    def padded_peak(self, batch_size: int, *, plain: bool, margin: float | None = None) -> float:
        """What must fit in the memory: the forecast peak times ``1 +``
        :meth:`margin`, and at least :meth:`resident` (whose buffers the
        CPU allocator's peak may leave out: under 256 KiB each). Measured
        bug it fixes: a 16 x Dense(128) model (1.0 MiB of weights) was
        said to train batch 511 in memory=1 byte."""
        return max(self.peak(batch_size, plain=plain)
                   * (1.0 + self.margin(batch_size, plain=plain, margin=margin)),
                   self.resident(batch_size))

    def resident(self, batch_size: int) -> int:
        """Bytes of the weights and the batch (the forecast's variables and
        inputs), every buffer counted (0 when the budget is unmet at
        ``batch_size``). A lower bound: what the optimizer's slots hold
        is as the device's allocator counts it."""
        p = self.plan(batch_size)
        if p is None:
            return 0
        problem = p.problem
        return problem.forecast(None, model=problem.judge).resident_bytes

    def max_batch_size(self, memory_bytes: int, *, plain: bool, margin: float | None = None,
                       start: int = 1) -> int:
        """:func:`max_batch_size` on these forecasts (``plain``: plain fit's).

        The search starts from the batches already traced, else at ``start``.
        """
        if not plain and self.checkpoints is None:
            raise CapacityError(f"{self.api}: checkpoints=None has no memsave forecast; "
                                "ask for plain=True")
        if margin is not None:
            _check_margin(margin, self.api)
        b = _search(lambda b: self.padded_peak(b, plain=plain, margin=margin), memory_bytes,
                    known=sorted(self._plans), start=start)
        if b == 0:
            raise self._no_batch_fits(memory_bytes, plain, self.margin(1, plain=plain, margin=margin))
        return b

    def _no_batch_fits(self, memory_bytes: int, plain: bool, margin: float) -> NoBatchFitsError:
        memory = f"memory={memory_bytes:,} bytes ({_mib(memory_bytes)})"
        p = self.plan(1)
        if p is None:
            e = self._plans[1]
            return NoBatchFitsError(
                f"{self.api}: no batch fits in {memory}: with a batch of 1, memory_budget="
                f"{self.memory_budget!r} is below the smallest forecast peak "
                f"({e.min_peak_bytes:,} bytes); raise the budget or drop it",
                e.min_peak_bytes, memory_bytes)
        what = "plain fit" if plain else f"memsave (checkpoints={self.checkpoints!r})"
        peak = p.baseline_peak_bytes if plain else p.predicted_peak_bytes
        resident = self.resident(1)
        if resident > peak * (1 + margin):
            return NoBatchFitsError(
                f"{self.api}: no batch fits in {memory}: with a batch of 1, the weights "
                f"and the batch alone hold {resident:,} bytes "
                f"({_mib(resident)}), every buffer counted ({what}'s forecast peak, "
                f"{peak:,} bytes, leaves out buffers under the allocator's counting "
                "threshold); give more memory", resident, memory_bytes)
        return NoBatchFitsError(
            f"{self.api}: no batch fits in {memory}: with a batch of 1, {what} is forecast to "
            f"peak at {peak:,} bytes ({_mib(peak)}; {_mib(peak * (1 + margin))} with the "
            f"{margin:.0%} margin), of which {_mib(p.resident_bytes)} is resident (weights, "
            "optimizer slots, the batch); give more memory"
            + (", or use checkpoints='memory'" if plain else ""),
            peak, memory_bytes)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


# -- the search ------------------------------------------------------------------


def _search(padded: Callable[[int], float], memory_bytes: int, *, known=(), start: int = 1) -> int:
    """The largest batch ``b`` the search finds with ``padded(b) <= memory_bytes < padded(b + 1)``.

    0 when batch 1 does not fit; :data:`MAX_BATCH_SIZE` when it fits.
    ``padded(b)`` is one forecast (a trace) unless ``b`` is in ``known``
    (batches already forecast, whose figures are free): they seed the
    bracket; without them the first probe is ``start``.

    The bracket ``lo`` (fits, or 0) < ``hi`` (does not fit) shrinks until
    ``hi == lo + 1``. Until a batch that does not fit is seen, each probe
    grows ``lo``: to where the line through the two largest fitting
    batches crosses the memory (plus one, so it is expected not to fit),
    at least doubling and at most :data:`GROWTH_LIMIT` times; with one
    fitting batch (or a flat line: every tensor under the allocator's
    counting threshold) by the limit. Inside a bracket each probe is
    where the line through its ends crosses the memory (regula falsi),
    and the midpoint after a probe that did not halve the bracket: at
    most about twice the probes of bisection, and one or two past the
    growth when the forecast is affine in the batch (4-5 in all from
    batch 1, where doubling and bisection spend about 2 log2 of the
    answer). Each bracket end is a probed fact, so the answer meets the
    contract even where the forecast is not monotone.
    """
    seen: dict[int, float] = {b: padded(b) for b in known}
    hi = min((b for b, f in seen.items() if f > memory_bytes), default=None)
    lo = max((b for b, f in seen.items() if f <= memory_bytes and (hi is None or b < hi)), default=0)

    def probe(b: int) -> None:
        nonlocal lo, hi
        seen[b] = padded(b)
        if seen[b] <= memory_bytes:
            lo = b
        else:
            hi = b

    if not seen:
        probe(max(1, min(start, MAX_BATCH_SIZE)))
    halved = True
    while not (hi is not None and hi <= lo + 1) and lo < MAX_BATCH_SIZE:
        if lo == 0:  # nothing known to fit: try the smallest batch
            probe(1)
        elif hi is None:  # grow
            last = sorted(b for b in seen if b <= lo)[-2:]
            guess = _crossing(seen, last[0], last[-1], memory_bytes)
            b = GROWTH_LIMIT * lo if guess is None else math.floor(guess) + 1
            probe(min(max(b, 2 * lo), GROWTH_LIMIT * lo, MAX_BATCH_SIZE))
        else:  # narrow
            width = hi - lo
            guess = _crossing(seen, lo, hi, memory_bytes) if halved else None
            b = (lo + hi) // 2 if guess is None else math.floor(guess)
            probe(min(max(b, lo + 1), hi - 1))
            halved = hi - lo <= width // 2
    return lo


def _crossing(seen: dict[int, float], b0: int, b1: int, memory_bytes: int) -> float | None:
    """Where the line through ``(b0, seen[b0])`` and ``(b1, seen[b1])`` reaches ``memory_bytes``.

    None when ``b0 == b1``, or when the line does not rise (or a point is
    infinite: a budget that cannot be met).
    """
    if b0 == b1:
        return None
    f0, f1 = seen[b0], seen[b1]
    if not (math.isfinite(f0) and math.isfinite(f1)) or f1 <= f0:
        return None
    return b0 + (memory_bytes - f0) * (b1 - b0) / (f1 - f0)


# -- validation --------------------------------------------------------------


def default_margin(plain: bool) -> float:
    """The margin :func:`max_batch_size` applies by default: plain fit's, or memsave's."""
    return FORECAST_MARGIN_PLAIN if plain else FORECAST_MARGIN_CHECKPOINTED


def _check_margin(margin, api: str) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0 \
            or not math.isfinite(margin):
        raise CapacityError(
            f"{api}: margin={margin!r}; pass a finite fraction of the forecast >= 0, or None "
            f"for the forecast's known error ({FORECAST_MARGIN_PLAIN} for plain fit, "
            f"{FORECAST_MARGIN_CHECKPOINTED} checkpointed)")


def _check_compiled(model, api: str) -> None:
    import keras

    from memsave.keras import KerasModelError

    if not isinstance(model, keras.Model):
        raise KerasModelError(
            f"{api}: expected a compiled keras.Model (Keras 3), got {type(model).__name__}")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise KerasModelError(
            f"{api}: model {model.name!r} is not compiled; the forecast is of fit's train "
            "step, which needs the loss and the optimizer: call model.compile(optimizer=..., "
            "loss=...) first")


def _leading_dimension(x) -> int:
    import tensorflow as tf

    leaves = [leaf for leaf in tf.nest.flatten(x) if leaf is not None]
    shape = getattr(leaves[0], "shape", None) if leaves else None
    first = tf.TensorShape(shape)[0] if shape is not None else None
    return first if isinstance(first, int) and first >= 1 else 1


def _check_batch_dimension(data: tuple, api: str) -> tuple:
    """``data`` as given, once every leaf has a leading (batch) dimension."""
    import tensorflow as tf

    for name, part in zip(("x", "y"), data):
        if part is None:
            continue
        for leaf in tf.nest.flatten(part):
            if leaf is None:
                continue
            shape = leaf.shape if hasattr(leaf, "shape") else None
            if shape is None:
                try:
                    shape = tf.convert_to_tensor(leaf).shape
                except (TypeError, ValueError) as e:
                    raise CapacityError(
                        f"{api}: cannot read the shape of an entry of {name} of type "
                        f"{type(leaf).__name__} ({e}); pass arrays, tensors or tf.TensorSpec"
                    ) from None
            shape = tf.TensorShape(shape)
            if shape.rank is None or shape.rank == 0:
                raise CapacityError(
                    f"{api}: an entry of {name} has shape {shape}, with no leading batch "
                    f"dimension; pass a batch (or one sample with a batch dimension, e.g. "
                    f"{name}[None] or {name}[:1])")
    return data
