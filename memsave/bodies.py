"""What a call or a loop holds beyond its inputs and outputs (no TensorFlow).

A ``PartitionedCall`` or a ``While`` runs a function body
(:class:`memsave.graph.Body`). For the simulator it is one op, which holds,
besides its outputs, what its gradient keeps (while_v2's accumulators, one
buffer per trip; a call's intermediates), the items of the TensorLists a
loop fills, and the body's own transient peak while it runs; its gradient
adds the body's backward transient. :func:`body_figures` reads those
figures off a simulation of the body itself (plain backprop), once per body
and memory model.
"""

from __future__ import annotations

import dataclasses
import weakref

from memsave.costs import body_costs
from memsave.graph import Body
from memsave.memory_model import MemoryModel

__all__ = ["BodyFigures", "body_figures"]


@dataclasses.dataclass(frozen=True)
class BodyFigures:
    """Bytes a call or loop op holds beyond its inputs and outputs.

    Attributes
    ----------
    saved_bytes : int
        What its gradient keeps, for all trips (from the op until its gradient).
    stored_bytes : int
        The items the loop's TensorLists hold (as long as the lists live).
    forward_bytes, backward_bytes : int
        The body's transient peak above what it keeps, while the op runs and
        while its gradient runs (a loop's gradient also holds one trip's
        gradients beside the sums it carries).
    invariant_sums : int
        For a loop: the sums of each loop-invariant input's gradient its
        gradient holds at once, each started from zeros (a constant
        resident for the whole step when the shape is static): one for
        while_v2's gradient loop; two for a chunked one, whose loop of each
        chunk sums the gradients of the invariants that receive one beside
        the outer loop's sums (:mod:`memsave.loopmodel`). The simulator
        counts them, knowing which inputs receive a gradient.
    """

    saved_bytes: int
    stored_bytes: int
    forward_bytes: int
    backward_bytes: int
    invariant_sums: int = 1


_figures: "weakref.WeakKeyDictionary[Body, dict]" = weakref.WeakKeyDictionary()


def body_figures(body: Body, model: MemoryModel) -> BodyFigures:
    """Simulate the body once (plain backprop) and read its figures (cached)."""
    from memsave.simulate import simulate  # the simulator simulates bodies with this

    per = _figures.setdefault(body, {})
    if model in per:
        return per[model]
    bc = body_costs(body)
    fg = body.fg
    counted = model.allocator.counted

    def root(t: int) -> int:
        while bc.alias_of[t] is not None:
            t = bc.alias_of[t]
        return t

    saved_ids = set(body.saved)
    saved = sum(counted(bc.tensor_bytes[t]) for t in saved_ids)
    # (An item the gradient reads is kept once, with what it keeps.)
    stored = sum(counted(bc.tensor_bytes[t]) for t in body.stored if t not in saved_ids)
    outs = {root(t) for t in fg.ys if fg.tensors[root(t)].kind == "internal"}
    out_bytes = sum(counted(bc.tensor_bytes[t]) for t in outs if t not in saved_ids)
    trace = simulate(fg, None, bc, model=model)
    alive = [b for b, _ in trace.timeline]
    start = trace.backward_start
    forward_peak = max(alive[:start], default=trace.resident_bytes)
    backward_peak = max(alive[start:], default=trace.resident_bytes)
    forward = max(0, forward_peak - trace.resident_bytes - saved - stored - out_bytes)
    base = trace.resident_bytes if body.loop else trace.end_bytes
    backward = max(0, backward_peak - base - saved)
    found = per[model] = BodyFigures(
        saved_bytes=body.trips * saved, stored_bytes=body.trips * stored,
        forward_bytes=forward, backward_bytes=backward,
    )
    return found
