"""What a while_v2 loop keeps under each way of differentiating it (no TensorFlow).

A :class:`LoopChoice` says how :func:`memsave.loops.prepare` makes a loop's
gradient keep its values; :func:`figures` forecasts the bytes that choice
holds, from the :class:`~memsave.graph.Body` that :mod:`memsave.extract`
reads, in the terms of the simulator's figures for a body
(:class:`memsave.simulate.BodyFigures`: what the gradient keeps from the
loop until it runs, the items of the loop's own TensorLists, and the
transient peaks of one trip forward and backward), so that the simulator
can ask ``figures(body, choice, allocator)`` where it asks
``_body_figures(body, allocator)`` today.

The model, per trip (T trips; S: the state, the body inputs that change
from trip to trip; I: what while_v2 keeps of a trip, its ``saved``
tensors; K: values of random draws the gradient reads; L: the input
sequence the loop reads from a TensorList; F, B: the plain transient peaks
of one trip forward and backward)::

    choice           kept until the gradient (M)  forward transient            backward transient
    plain            T (I + K)                    F                            B
    per_step         T (S + K) + L                max(2L - M, F + I - S)       B + I
    chunk(k)         ceil(T/k) S + L              max(2L - M, F + I - S + kS)  B + I + k S
    chunk(k, store)  ceil(T/k) S + L              max(2L - M, F + k I)         B + k I

A per-step trip recomputes its intermediates (at most I alive at once) in
the backward loop; a chunk's backward first runs its k trips again, storing
their states (or, ``store``, every value their gradient reads), then goes
back over them. The input sequence (L) is read again by the recomputation,
so it lives until the gradient (plain keeps its items as part of I); it is
made from a tensor just before the loop, both alive then, before any state
is stored (``2L - M``: measured on a Keras LSTM, the start of the step
holds two to three copies of the time-major input). The
recomputation costs one forward of the loop per step (``per_step``,
``chunk(k, store)``) or two (``chunk(k)``): :func:`recomputed_trips`.
Both chunk schedules need the loop to have no op that must not run twice
(K = 0); :func:`memsave.loops.prepare` stores such a loop per step.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING, Literal

from memsave.errors import LoopChoiceError

if TYPE_CHECKING:  # the simulator imports this module
    from memsave.graph import Body
    from memsave.simulate import Allocator, BodyFigures

__all__ = ["LoopChoice", "TripBytes", "trip_bytes", "figures", "recomputed_trips",
           "chunk_size", "candidates"]


@dataclasses.dataclass(frozen=True)
class LoopChoice:
    """How a loop's gradient keeps its values.

    Build one with the class methods: :meth:`plain`, :meth:`per_step`,
    :meth:`chunk`.

    Attributes
    ----------
    kind : {"plain", "per_step", "chunk"}
    k : int
        For ``chunk``: trips per chunk (the state is stored every k trips).
    inner : {"per_step", "store"}
        For ``chunk``: how the backward pass of one chunk keeps its trips'
        values: their states, each trip recomputed again (``per_step``,
        the least memory), or every intermediate its gradient reads
        (``store``, one forward of the loop less).
    """

    kind: Literal["plain", "per_step", "chunk"] = "plain"
    k: int = 0
    inner: Literal["per_step", "store"] = "per_step"

    def __post_init__(self) -> None:
        if self.kind not in ("plain", "per_step", "chunk"):
            raise LoopChoiceError(
                f"LoopChoice: kind={self.kind!r}; expected 'plain', 'per_step' or 'chunk'")
        if self.kind == "chunk" and (not isinstance(self.k, int) or self.k < 1):
            raise LoopChoiceError(
                f"LoopChoice.chunk: k={self.k!r}; expected an int >= 1 (trips per chunk)")
        if self.inner not in ("per_step", "store"):
            raise LoopChoiceError(
                f"LoopChoice.chunk: inner={self.inner!r}; expected 'per_step' or 'store'")

    @classmethod
    def plain(cls) -> "LoopChoice":
        """while_v2's own gradient: every trip keeps what its gradient reads."""
        return cls("plain")

    @classmethod
    def per_step(cls) -> "LoopChoice":
        """Store the loop state each trip; recompute the trip backwards."""
        return cls("per_step")

    @classmethod
    def chunk(cls, k: int, *, inner: Literal["per_step", "store"] = "per_step") -> "LoopChoice":
        """Store the loop state every ``k`` trips; recompute a chunk backwards."""
        return cls("chunk", k=k, inner=inner)

    def __str__(self) -> str:
        if self.kind == "chunk":
            return f"chunk(k={self.k}{'' if self.inner == 'per_step' else ', inner=store'})"
        return self.kind.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class TripBytes:
    """Counted bytes of one trip of a loop (see the module docstring).

    Attributes
    ----------
    saved_B : int
        I: what while_v2's gradient keeps of a trip.
    state_B : int
        S: the loop state stored per trip by a per-step gradient.
    kept_B : int
        K: values of ops that must not run twice, stored whatever the choice.
    read_lists_B : int
        L: the TensorLists the loop reads (its input sequence), all trips.
    """

    saved_B: int
    state_B: int
    kept_B: int
    read_lists_B: int


def trip_bytes(body: "Body", allocator: "Allocator") -> TripBytes:
    """The per-trip figures of ``body`` as ``allocator`` counts them."""
    from memsave.costs import body_costs  # noqa: PLC0415 - keeps this module importable first

    size = body_costs(body).tensor_B
    counted = allocator.counted
    return TripBytes(
        saved_B=sum(counted(size[t]) for t in body.saved),
        state_B=sum(counted(size[t]) for t in body.state),
        kept_B=sum(counted(size[t]) for t in body.kept),
        read_lists_B=counted(body.read_lists_B),
    )


def figures(body: "Body", choice: LoopChoice, allocator: "Allocator") -> "BodyFigures":
    """What ``body``'s op holds when its gradient is built as ``choice`` says.

    Parameters
    ----------
    body : Body
        A loop's body (``body.loop``); a call's body has one choice, plain.
    choice : LoopChoice
    allocator : Allocator

    Returns
    -------
    BodyFigures
        ``saved_B`` (kept from the loop until its gradient, all trips),
        ``stored_B`` (items of the loop's own TensorLists), ``forward_B`` and
        ``backward_B`` (transient peaks of one trip), as the simulator's.

    Examples
    --------
    >>> f = figures(body, LoopChoice.chunk(32), CPU_ONEDNN)  # doctest: +SKIP
    >>> f.saved_B  # the state every 32 trips, and the input sequence  # doctest: +SKIP
    """
    from memsave import simulate  # noqa: PLC0415 - the simulator imports this module

    if not body.loop:
        return simulate._body_figures(body, allocator)  # pylint: disable=protected-access
    plain = simulate._body_figures(_differentiated(body), allocator)  # pylint: disable=protected-access
    per = trip_bytes(body, allocator)
    trips = body.trips
    if choice.kind == "plain":
        # while_v2 also keeps the values of random draws (not in ``saved``).
        return dataclasses.replace(plain, saved_B=plain.saved_B + trips * per.kept_B)
    one_trip = max(0, per.saved_B - per.state_B)  # a trip's recomputed intermediates
    if choice.kind == "per_step" or per.kept_B:
        saved_B = trips * (per.state_B + per.kept_B) + per.read_lists_B
        return simulate.BodyFigures(
            saved_B=saved_B, stored_B=plain.stored_B,
            forward_B=max(_start_B(per, saved_B), plain.forward_B + one_trip),
            backward_B=plain.backward_B + per.saved_B)
    chunks = -(-trips // choice.k)
    k = min(choice.k, max(trips, 1))
    if choice.inner == "store":
        forward_B = plain.forward_B + k * per.saved_B
        backward_B = plain.backward_B + k * per.saved_B
    else:
        forward_B = plain.forward_B + one_trip + k * per.state_B
        backward_B = plain.backward_B + per.saved_B + k * per.state_B
    saved_B = chunks * per.state_B + per.read_lists_B
    return simulate.BodyFigures(saved_B=saved_B, stored_B=plain.stored_B,
                                forward_B=max(_start_B(per, saved_B), forward_B),
                                backward_B=backward_B)


def _start_B(per: TripBytes, saved_B: int) -> int:
    """The excess of the loop's start over what it keeps to its end.

    The input sequence's TensorList is made from a tensor just before the
    loop (Keras: a time-major transpose, then an unstack): two copies (2 L)
    are alive then, before any state is stored. The simulator holds
    ``saved_B`` and the forward transient together at the op, so the
    transient is what 2 L exceeds ``saved_B`` by.
    """
    return max(0, 2 * per.read_lists_B - saved_B)


_differentiated_bodies: "weakref.WeakKeyDictionary[Body, Body]" = weakref.WeakKeyDictionary()


def _differentiated(body: "Body") -> "Body":
    """``body`` with its ``no_gradient`` inputs out of its xs: the body as
    its gradient runs (no per-trip gradient of a loop's input sequence, a
    constant it reads by index, ...). Cached per body."""
    if not body.no_gradient:
        return body
    found = _differentiated_bodies.get(body)
    if found is None:
        skip = set(body.no_gradient)
        # (the body passes them through: they are outputs too, whose
        # incoming gradient would be a buffer of their size)
        fg = dataclasses.replace(body.fg, xs=tuple(x for x in body.fg.xs if x not in skip),
                                 ys=tuple(y for y in body.fg.ys if y not in skip))
        found = _differentiated_bodies[body] = dataclasses.replace(body, fg=fg)
    return found


def recomputed_trips(body: "Body", choice: LoopChoice) -> int:
    """Trips of the body the gradient runs again: 0 (plain), T (per step,
    chunk with ``store``) or 2T (chunk: the chunk, then each trip)."""
    if not body.loop or choice.kind == "plain":
        return 0
    if choice.kind == "chunk" and choice.inner == "per_step":
        return 2 * body.trips
    return body.trips


def chunk_size(body: "Body", allocator: "Allocator", *, inner: str = "per_step") -> int:
    """The k that minimizes what a chunked gradient keeps at its peak.

    ``ceil(T/k) S + k X`` (X = S for ``inner="per_step"``, I for ``store``)
    is smallest near ``k = sqrt(T S / X)``: sqrt(T) trips per chunk when
    each trip is recomputed again.
    """
    per = trip_bytes(body, allocator)
    per_k = per.state_B if inner == "per_step" else per.saved_B
    if body.trips <= 1 or per.state_B <= 0 or per_k <= 0:
        return max(1, body.trips)
    k = math.sqrt(body.trips * per.state_B / per_k)
    return max(1, min(body.trips, round(k)))


def candidates(body: "Body", allocator: "Allocator") -> list[LoopChoice]:
    """The choices worth forecasting for ``body``: plain, per step, and the
    chunk sizes :func:`chunk_size` gives (both inner schedules) when the
    loop makes more than a few trips and nothing in it must not run twice."""
    if not body.loop:
        return [LoopChoice.plain()]
    out = [LoopChoice.plain(), LoopChoice.per_step()]
    if body.trips >= MIN_TRIPS_TO_CHUNK and not body.kept:
        for inner in ("per_step", "store"):
            k = chunk_size(body, allocator, inner=inner)
            if 1 < k < body.trips:
                out.append(LoopChoice.chunk(k, inner=inner))
    return out


#: Fewest trips for which chunks are forecast: below it, the stored states
#: of a chunked loop hardly differ from a per-step one's.
MIN_TRIPS_TO_CHUNK = 8
