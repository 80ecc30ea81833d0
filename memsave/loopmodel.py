"""What a while_v2 loop keeps under each way of differentiating it (no TensorFlow).

A :class:`LoopChoice` says how :func:`memsave.loops.prepare` makes a loop's
gradient keep its values; :func:`figures` forecasts the bytes that choice
holds, from the :class:`~memsave.graph.Body` that :mod:`memsave.extract`
reads, in the same terms as the simulator's plain figures
(:class:`memsave.simulate.BodyFigures`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from memsave.errors import LoopChoiceError

__all__ = ["LoopChoice"]


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
