"""What a while_v2 loop keeps under each way of differentiating it (no TensorFlow).

A :class:`LoopChoice` says how :func:`memsave.loops.prepare` makes a loop's
gradient keep its values; :func:`figures` forecasts the bytes that choice
holds, from the :class:`~memsave.graph.Body` that :mod:`memsave.extract`
reads, in the terms of the simulator's figures for a body
(:class:`memsave.bodies.BodyFigures`: what the gradient keeps from the
loop until it runs, the items of the loop's own TensorLists, and the
transient peaks of one trip forward and backward): the simulator takes
``figures(body, choice, model)`` for a loop in place of
:func:`memsave.bodies.body_figures` (``ForwardProgram(body_figures=)``,
filled by :meth:`memsave.problem.Problem.with_loops`).

The model, per trip (T trips; S: the state, the body inputs that change
from trip to trip; I: what while_v2 keeps of a trip, its ``saved``
tensors; K: values of random draws the gradient reads; L: the input
sequence the loop reads from a TensorList; G: the loop-invariant inputs
holding data that receive a gradient, e.g. a sequence the body gathers
from; F, B: the plain transient peaks of one trip forward and backward)::

    choice           kept until the gradient (M)  forward transient            backward transient
    plain            T (I + K)                    F                            B
    per_step         T (S + K) + L                max(2L - M, F + I - S)       B + I
    chunk(k)         ceil(T/k) S + L              max(2L - M, F + I - S + kS)  B + I + k S + L + G
    chunk(k, store)  ceil(T/k) S + L              max(2L - M, F + k I)         B + k I + L + G
    slots(s)         n S + L                      max(2L - M, F + I - S + xS)  B + I + x S + L + G

(``slots(s)``: chunks of s, s - 1, ..., 1 trips, n of them; x = max over
chunks j of (j + 1 + size_j) - n, what the widest chunk's states add to the
n stored: 1 when the chunks fill the triangle, see :meth:`LoopChoice.slots`.)

A per-step trip recomputes its intermediates (at most I alive at once) in
the backward loop; a chunk's backward first runs its k trips again, storing
their states (or, ``store``, every value their gradient reads), then goes
back over them. The input sequence (L) is read again by the recomputation,
so it lives until the gradient (plain keeps its items as part of I); it is
made from a tensor just before the loop, both alive then, before any state
is stored (``2L - M``: measured on a Keras LSTM, the start of the step
holds two to three copies of the time-major input). So do the other
loop-invariant inputs holding data (a sequence the body gathers from):
a gradient that runs trips again reads them (:func:`recomputing_costs`;
while_v2's reads only those its body's gradient does). A chunk's backward
is a while_v2 loop of its own inside the gradient loop: it sums the
gradients of the invariants (G) from zeros of its own, beside the outer
loop's sums, and those zeros are a constant of the gradient body, held for
the life of the step function (``BodyFigures.invariant_sums``: 2, while
the loop's own gradient holds one set; :mod:`memsave.simulate` counts G,
knowing which inputs receive a gradient), and, when the input sequence
needs a gradient, fills its gradient's list (L, :data:`CHUNK_LIST_GRADIENTS`). The
recomputation costs one forward of the loop per step (``per_step``,
``chunk(k, store)``) or two (``chunk(k)``, ``slots(s)``):
:func:`recomputed_trips`. The chunk schedules need the loop to have no op
that must not run twice (K = 0); :func:`memsave.loops.prepare` stores such a loop per step.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from typing import TYPE_CHECKING, Literal

from memsave.errors import LoopChoiceError

from memsave.bodies import BodyFigures, body_figures
from memsave.costs import body_costs

if TYPE_CHECKING:
    from collections.abc import Mapping

    from memsave.costs import Costs
    from memsave.graph import Body, ForwardGraph
    from memsave.memory_model import MemoryModel

__all__ = ["LoopChoice", "TripBytes", "trip_bytes", "figures", "stored_bytes", "recomputing_costs",
           "recomputed_trips",
           "chunk_size", "slot_count", "tapered_chunks", "candidates", "LoopForecast",
           "LoopDecision", "options"]


@dataclasses.dataclass(frozen=True)
class LoopChoice:
    """How a loop's gradient keeps its values.

    Build one with the class methods: :meth:`plain`, :meth:`per_step`,
    :meth:`chunk`, :meth:`slots`.

    Attributes
    ----------
    kind : {"plain", "per_step", "chunk", "slots"}
    k : int
        For ``chunk``: trips per chunk (the state is stored every k trips).
        For ``slots``: s, the trips of the first (largest) chunk.
    inner : {"per_step", "store"}
        For ``chunk``: how the backward pass of one chunk keeps its trips'
        values: their states, each trip recomputed again (``per_step``,
        the least memory), or every intermediate its gradient reads
        (``store``, one forward of the loop less).
    """

    kind: Literal["plain", "per_step", "chunk", "slots"] = "plain"
    k: int = 0
    inner: Literal["per_step", "store"] = "per_step"

    def __post_init__(self) -> None:
        if self.kind not in ("plain", "per_step", "chunk", "slots"):
            raise LoopChoiceError(
                f"LoopChoice: kind={self.kind!r}; expected 'plain', 'per_step', 'chunk' or 'slots'")
        if self.kind == "chunk" and (not _is_count(self.k) or self.k < 1):
            raise LoopChoiceError(
                f"LoopChoice.chunk: k={self.k!r}; expected an int >= 1 (trips per chunk)")
        if self.kind == "slots" and (not _is_count(self.k) or self.k < 1):
            raise LoopChoiceError(
                f"LoopChoice.slots: s={self.k!r}; expected an int >= 1 (states stored at once)")
        if self.inner not in ("per_step", "store"):
            raise LoopChoiceError(
                f"LoopChoice.chunk: inner={self.inner!r}; expected 'per_step' or 'store'")
        if self.kind == "slots" and self.inner != "per_step":
            raise LoopChoiceError("LoopChoice.slots: inner must be 'per_step'")
        object.__setattr__(self, "k", int(self.k))  # a numpy integer compares and prints as one

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

    @classmethod
    def slots(cls, s: int) -> "LoopChoice":
        """Store the state in tapered chunks: s, s - 1, ..., 1 trips (then 1 each).

        Like ``chunk(k)`` (each trip recomputed twice: its chunk, then
        itself), but the chunks shrink by one trip each, so that when the
        backward pass reaches chunk j, which stores its trips' states, only
        the j chunk states before it are still stored: about s states at
        once for up to s (s + 1) / 2 trips, where equal chunks hold
        ceil(T/k) + k, 2 sqrt(T) at best (T=1024: 46 states against 64).
        No schedule that runs each trip at most twice before its backward
        trip stores fewer: the chunk recomputed j-th from the end must
        store all its trips while the states of the j chunks before it
        wait, so T <= s + (s - 1) + ... + 1. :func:`slot_count` gives the
        smallest s for T trips.
        """
        return cls("slots", k=s)

    def __str__(self) -> str:
        if self.kind == "slots":
            return f"slots(s={self.k})"
        if self.kind == "chunk":
            return f"chunk(k={self.k}{'' if self.inner == 'per_step' else ', inner=store'})"
        return self.kind.replace("_", "-")


def _is_count(k) -> bool:
    """An integer (a numpy one too), not a bool."""
    return isinstance(k, numbers.Integral) and not isinstance(k, bool)


@dataclasses.dataclass(frozen=True)
class TripBytes:
    """Counted bytes of one trip of a loop (see the module docstring).

    Attributes
    ----------
    saved_bytes : int
        I: what while_v2's gradient keeps of a trip.
    state_bytes : int
        S: the loop state stored per trip by a per-step gradient.
    kept_bytes : int
        K: values of ops that must not run twice, stored whatever the choice.
    read_lists_bytes : int
        L: the TensorLists the loop reads (its input sequence), all trips.
    """

    saved_bytes: int
    state_bytes: int
    kept_bytes: int
    read_lists_bytes: int


def trip_bytes(body: "Body", model: "MemoryModel") -> TripBytes:
    """The per-trip figures of ``body`` as ``model``'s allocator counts them."""
    size = body_costs(body).tensor_bytes
    counted = model.allocator.counted
    return TripBytes(
        saved_bytes=sum(counted(size[t]) for t in body.saved),
        state_bytes=sum(counted(size[t]) for t in body.state),
        kept_bytes=sum(counted(b) for b in body.kept_bytes),
        read_lists_bytes=counted(body.read_lists_bytes),
    )


def recomputing_costs(fg: "ForwardGraph", costs: "Costs",
                      choices: "Mapping[int, LoopChoice]") -> "Costs":
    """``costs`` with the gradient of each loop ``choices`` does not leave
    plain reading every loop-invariant input of the loop that holds data.

    The trips the gradient runs again read them (a sequence the body
    gathers from, which while_v2's own gradient reads only for its shape):
    they stay alive until the gradient runs, or a plan recomputes them
    before it (measured on an 8-trip while RNN gathering from a [8, 512,
    256] sequence: the per-step step held the sequence through the loop's
    gradient, 4 MiB above the forecast without it).
    """
    gradient, reads = list(costs.gradient), list(costs.gradient_reads)
    for i, choice in choices.items():
        op = fg.ops[i]
        if choice.kind == "plain" or op.body is None or not op.body.loop:
            continue
        use = gradient[i]
        more = [j for j in op.body.invariant if j < len(op.inputs)
                and fg.tensors[op.inputs[j]].dtype not in ("resource", "variant")]
        positions = tuple(sorted(set(use.reads_inputs) | set(more)))
        gradient[i] = dataclasses.replace(use, reads_inputs=positions)
        reads[i] = (tuple(op.inputs[j] for j in positions), reads[i][1])
    return dataclasses.replace(costs, gradient=tuple(gradient), gradient_reads=tuple(reads))


def figures(body: "Body", choice: LoopChoice, model: "MemoryModel", *,
            read_outputs: "frozenset[int] | None" = None) -> BodyFigures:
    """What ``body``'s op holds when its gradient is built as ``choice`` says.

    Parameters
    ----------
    body : Body
        A loop's body (``body.loop``); a call's body has one choice, plain.
    choice : LoopChoice
    model : MemoryModel
    read_outputs : frozenset of int, optional
        The loop's output positions the enclosing graph reads (None: all).
        Under a gradient memsave builds, the TensorLists of the others are
        freed when the loop ends (:func:`stored_bytes`).

    Returns
    -------
    BodyFigures
        ``saved_bytes`` (kept from the loop until its gradient, all trips),
        ``stored_bytes`` (items of the loop's own TensorLists), ``forward_bytes`` and
        ``backward_bytes`` (transient peaks of one trip), as the simulator's.

    Examples
    --------
    >>> f = figures(body, LoopChoice.chunk(32), MemoryModel())  # doctest: +SKIP
    >>> f.saved_bytes  # the state every 32 trips, and the input sequence  # doctest: +SKIP
    """
    if not body.loop:
        return body_figures(body, model)
    plain = body_figures(_differentiated(body), model)
    per = trip_bytes(body, model)
    trips = body.trips
    if choice.kind == "plain":
        return plain
    one_trip = max(0, per.saved_bytes - per.state_bytes)  # a trip's recomputed intermediates
    if choice.kind == "per_step" or per.kept_bytes:
        saved_bytes = trips * (per.state_bytes + per.kept_bytes) + per.read_lists_bytes
        return BodyFigures(
            saved_bytes=saved_bytes,
            stored_bytes=stored_bytes(body, model, stored_states=trips, read_outputs=read_outputs),
            forward_bytes=max(_start_bytes(per, saved_bytes), plain.forward_bytes + one_trip),
            backward_bytes=plain.backward_bytes + per.saved_bytes)
    chunks = -(-trips // choice.k)
    k = min(choice.k, max(trips, 1))
    if choice.kind == "slots":
        sizes = tapered_chunks(choice.k, trips)
        chunks = len(sizes)
        # What the widest chunk's states add to the chunk states stored
        # (``x`` in the module docstring), forward and backward.
        k = max((j + 1 + n for j, n in enumerate(sizes)), default=1) - chunks
    if choice.inner == "store":
        forward_bytes = plain.forward_bytes + k * per.saved_bytes
        backward_bytes = plain.backward_bytes + k * per.saved_bytes
    else:
        forward_bytes = plain.forward_bytes + one_trip + k * per.state_bytes
        backward_bytes = plain.backward_bytes + per.saved_bytes + k * per.state_bytes
    # An input sequence that needs a gradient: each chunk's backward builds
    # the gradient of the whole list, added to the sum over the chunks
    # (CHUNK_LIST_GRADIENTS of its size alive beside the trip's values).
    backward_bytes += CHUNK_LIST_GRADIENTS * per.read_lists_bytes
    # The chunk's own sums of the invariants' gradients (G), beside the
    # outer loop's (measured on an 8-trip while RNN gathering from a [8,
    # 512, 256] sequence: four sequence-sized buffers through the chunked
    # gradient, the sequence, the outer sum, the chunk's sum and the new
    # outer sum; and one more resident, the chunk's zeros): the simulator
    # adds them (``invariant_sums``), which knows what receives a gradient.
    saved_bytes = chunks * per.state_bytes + per.read_lists_bytes
    return BodyFigures(saved_bytes=saved_bytes,
                       stored_bytes=stored_bytes(body, model, stored_states=chunks,
                                                 read_outputs=read_outputs),
                       forward_bytes=max(_start_bytes(per, saved_bytes), forward_bytes),
                       backward_bytes=backward_bytes, invariant_sums=2)


def stored_bytes(body: "Body", model: "MemoryModel", *, stored_states: int,
                 read_outputs: "frozenset[int] | None" = None) -> int:
    """The items of a loop's TensorLists (``body.stored``, every trip) that
    count beside what its gradient keeps, when memsave builds the gradient.

    Three differences from while_v2's (``BodyFigures.stored_bytes`` of the
    plain body). An item its gradient reads too (in ``body.saved``: a
    ``tanh`` written out) counts here: while_v2's gradient keeps it once,
    with its accumulators, memsave's recomputes it while the list holds it
    (measured on a ``tf.map_fn`` of three Dense+tanh layers, T=64, batch
    1024, per step: 112 MiB above resident, 64 forecast without them). A
    list the enclosing graph does not read (its output
    position not in ``read_outputs``) is freed when the loop ends: memsave's
    gradient reads nothing of it (:mod:`memsave._tf_while`: the zeros of
    its gradient are unset items, its length the one it came in with). And
    an item that is also the next trip's state (``body.stored_state``: a
    ``tf.scan``'s output is its carried value) is the buffer the gradient
    stores as state, ``stored_states`` times (T per step, one per chunk):
    counted once. Measured on a ``tf.scan`` of an LSTM cell over (h, c),
    T=200, batch 1024, loss on the last h: the step held the stored states,
    the h list and its stack, no c list.
    """
    size = body_costs(body).tensor_bytes
    counted = model.allocator.counted
    positions = body.stored_outputs or (-1,) * len(body.stored)
    shared = set(body.stored_state)
    items = state = 0
    for t, k in zip(body.stored, positions):
        if read_outputs is not None and k >= 0 and k not in read_outputs:
            continue
        items += counted(size[t])
        if t in shared:
            state += counted(size[t])
    return max(0, body.trips * items - min(stored_states, body.trips) * state)


#: Copies of a chunked loop's input sequence that its gradient holds at
#: once when the sequence needs a gradient (a stacked RNN's second layer,
#: an RNN after a Dense), beside the sequence itself: the gradient's list,
#: filled chunk by chunk. Measured on an LSTM(128, return_sequences=True)
#: -> GRU(128), T=128, batch 1024, both chunk(k=11): the items of the GRU's
#: input list and of its gradient's list, 64 MiB each, at the peak (the
#: TensorFlow profiler's allocations), 148 MiB above resident against 158.5
#: forecast. (It was 2, and 272 MiB measured, while each chunk's gradient
#: started from ``zeros_like`` of the list: memsave._tf_while._lazy_zeros.)
CHUNK_LIST_GRADIENTS = 1


def _start_bytes(per: TripBytes, saved_bytes: int) -> int:
    """The excess of the loop's start over what it keeps to its end.

    The input sequence's TensorList is made from a tensor just before the
    loop (Keras: a time-major transpose, then an unstack): two copies (2 L)
    are alive then, before any state is stored. The simulator holds
    ``saved_bytes`` and the forward transient together at the op, so the
    transient is what 2 L exceeds ``saved_bytes`` by.
    """
    return max(0, 2 * per.read_lists_bytes - saved_bytes)


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
    if choice.kind == "slots" or (choice.kind == "chunk" and choice.inner == "per_step"):
        return 2 * body.trips
    return body.trips


def tapered_chunks(s: int, trips: int) -> list[int]:
    """The chunk sizes of ``LoopChoice.slots(s)`` for ``trips`` trips: s,
    s - 1, ..., 1, then 1 each; the last one what is left."""
    sizes = []
    while trips > 0:
        n = min(trips, max(1, s - len(sizes)))
        sizes.append(n)
        trips -= n
    return sizes


def slot_count(trips: int) -> int:
    """The smallest s whose tapered chunks (:meth:`LoopChoice.slots`) cover
    ``trips`` trips: s (s + 1) / 2 >= trips."""
    s = max(1, math.isqrt(2 * max(trips, 1)))
    while s * (s + 1) // 2 < trips:
        s += 1
    while s > 1 and (s - 1) * s // 2 >= trips:
        s -= 1
    return s


def chunk_size(body: "Body", model: "MemoryModel", *, inner: str = "per_step") -> int:
    """The k that minimizes what a chunked gradient keeps at its peak.

    ``ceil(T/k) S + k X`` (X = S for ``inner="per_step"``, I for ``store``)
    is smallest near ``k = sqrt(T S / X)``: sqrt(T) trips per chunk when
    each trip is recomputed again.
    """
    per = trip_bytes(body, model)
    per_k = per.state_bytes if inner == "per_step" else per.saved_bytes
    if body.trips <= 1 or per.state_bytes <= 0 or per_k <= 0:
        return max(1, body.trips)
    k = math.sqrt(body.trips * per.state_bytes / per_k)
    return max(1, min(body.trips, round(k)))


def candidates(body: "Body", model: "MemoryModel") -> list[LoopChoice]:
    """The choices worth forecasting for ``body``: plain (alone when the loop
    is ``pinned``), per step, and, when
    the loop makes more than a few trips and nothing in it must not run
    twice (``body.once``: :func:`memsave.loops.prepare` stores such a loop
    per step), the chunk sizes :func:`chunk_size` gives (both inner
    schedules) and the tapered chunks of :func:`slot_count`."""
    if not body.loop or body.pinned:
        return [LoopChoice.plain()]
    out = [LoopChoice.plain(), LoopChoice.per_step()]
    if body.trips >= MIN_TRIPS_TO_CHUNK and not body.once:
        for inner in ("per_step", "store"):
            k = chunk_size(body, model, inner=inner)
            if 1 < k < body.trips:
                out.append(LoopChoice.chunk(k, inner=inner))
        s = slot_count(body.trips)
        if 1 < s < body.trips:
            out.append(LoopChoice.slots(s))
    return out


#: Fewest trips for which chunks are forecast: below it, the stored states
#: of a chunked loop hardly differ from a per-step one's.
MIN_TRIPS_TO_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class LoopForecast:
    """One way of differentiating a loop, forecast.

    Attributes
    ----------
    choice : LoopChoice
    kept_bytes : int
        What the gradient keeps from the loop until it runs, all trips
        (:func:`figures`' ``saved_bytes``), as the device's allocator counts.
    recompute_flops : int
        FLOPs of the trips its gradient runs again (:func:`recomputed_trips`
        times one trip's forward).
    """

    choice: LoopChoice
    kept_bytes: int
    recompute_flops: int


@dataclasses.dataclass(frozen=True)
class LoopDecision:
    """What the plan does with one loop of the differentiated graph.

    Attributes
    ----------
    op : int
        The While op's index in the forward graph.
    name : str
        Its TensorFlow name (what :func:`memsave.loops.prepare` is applied to).
    trips : int
        T, the trips it makes (1 when not known at trace time: ``trips_known``).
    trips_known : bool
    state_bytes : int
        S: the loop state, bytes per trip (what a per-step gradient stores).
    trip_bytes : int
        I: what while_v2's gradient keeps of a trip.
    forecasts : tuple of LoopForecast
        Every choice the planner weighed.
    chosen : LoopForecast
        The one it took.
    pinned : str
        Why the loop keeps while_v2's gradient whatever the plan (its body
        reads a variable the step writes: ``Body.pinned``), "" if it need not.
    """

    op: int
    name: str
    trips: int
    trips_known: bool
    state_bytes: int
    trip_bytes: int
    forecasts: tuple[LoopForecast, ...]
    chosen: LoopForecast | None = None
    pinned: str = ""

    @property
    def choice(self) -> LoopChoice:
        return LoopChoice.plain() if self.chosen is None else self.chosen.choice

    @property
    def k(self) -> int:
        """Trips per chunk: k for a chunk (the first, largest, for slots), 1
        per step, 0 plain."""
        c = self.choice
        return c.k if c.kind in ("chunk", "slots") else (1 if c.kind == "per_step" else 0)

    def taking(self, choice: LoopChoice) -> "LoopDecision":
        """This decision with ``choice`` (one of ``forecasts``) chosen."""
        found = next(f for f in self.forecasts if f.choice == choice)
        return dataclasses.replace(self, chosen=found)


def options(fg: "ForwardGraph", costs: "Costs", model: "MemoryModel") -> tuple[LoopDecision, ...]:
    """The loops of ``fg`` (While ops of the graph itself, not of function
    bodies) with every choice :func:`candidates` gives, forecast; nothing chosen."""
    out = []
    for op in fg.ops:
        body = op.body
        if body is None or not body.loop:
            continue
        per = trip_bytes(body, model)
        trip_flops = body_costs(body).forward_flops
        forecasts = tuple(
            LoopForecast(choice=c, kept_bytes=figures(body, c, model).saved_bytes,
                         recompute_flops=recomputed_trips(body, c) * trip_flops)
            for c in candidates(body, model))
        out.append(LoopDecision(op=op.index, name=op.name, trips=body.trips,
                                trips_known=body.trips_known, state_bytes=per.state_bytes,
                                trip_bytes=per.saved_bytes, forecasts=forecasts,
                                pinned=body.pinned))
    return tuple(out)
