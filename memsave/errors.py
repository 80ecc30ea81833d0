"""Exceptions raised by memsave.

Every exception memsave raises on purpose derives from :class:`MemsaveError`,
so ``except memsave.MemsaveError`` catches them all. Each subclass also
derives from the built-in exception a caller of ``tf.gradients`` would expect
(``ValueError`` for bad arguments, ``RuntimeError`` for eager mode), so code
written against ``tf.gradients`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "MemsaveError",
    "EagerExecutionError",
    "GraphMismatchError",
    "CheckpointError",
    "UnknownStrategyError",
    "MemoryBudgetError",
    "OptionsError",
    "ArgumentError",
    "PatchError",
    "DeviceProfileError",
    "LoopChoiceError",
]


class MemsaveError(Exception):
    """Base class of every error memsave raises on purpose."""

    # Raised while a tf.function traces, an error passes through autograph,
    # which re-creates it from its message: a class with its own __init__
    # (MemoryBudgetError) came out as a StagingError, without its
    # attributes. TensorFlow's own errors opt out this way
    # (op_selector.UnliftableError); ours reach the caller as raised.
    ag_pass_through = True


class EagerExecutionError(MemsaveError, RuntimeError):
    """memsave.gradients was called while executing eagerly."""


class GraphMismatchError(MemsaveError, ValueError):
    """ys, xs, grad_ys or checkpoints do not all live in one graph."""


class CheckpointError(MemsaveError, ValueError):
    """A checkpoint given by the user cannot be used."""


class UnknownStrategyError(MemsaveError, ValueError):
    """``checkpoints=`` names no registered strategy."""


class OptionsError(MemsaveError, TypeError, ValueError):
    """``strategy_options=`` (or a planner's keyword) holds an option the
    planner does not take, a value it cannot use, or an option that needs
    another one (a solver without a budget)."""


class ArgumentError(MemsaveError, ValueError, TypeError):
    """An argument of a memsave call is invalid (an empty ``ys``, a batch size
    that is not a positive int, ...): the message says what is allowed."""


class PatchError(MemsaveError, RuntimeError):
    """``memsave.patch`` was undone out of order (patches nest like with-blocks)."""


class MemoryBudgetError(MemsaveError, ValueError):
    """``memory_budget=`` is invalid, or below the smallest forecast peak.

    Attributes
    ----------
    min_peak_bytes : int or None
        The smallest forecast peak memsave found for this graph (None when
        the value itself was invalid).
    """

    def __init__(self, message: str, min_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_peak_bytes = min_peak_bytes


class DeviceProfileError(MemsaveError, ValueError):
    """A :class:`memsave.timemodel.DeviceProfile` was given an invalid figure."""


class LoopChoiceError(MemsaveError, ValueError):
    """memsave.loops was given something other than a While op and a LoopChoice."""
