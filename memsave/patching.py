"""Route every alias of tf.gradients through memsave, reversibly.

``tf.gradients`` is bound under many names in a TensorFlow process
(``tf.gradients``, ``tf.compat.v1.gradients``, the ``tensorflow._api``
copies, ``tensorflow.python.ops.gradients`` which tf.compat.v1 optimizers
call, ``gradients_impl`` itself, ...). :func:`patch` finds every module
attribute bound to the stock function, replaces it with a wrapper of the
same signature that calls :func:`memsave.gradients`, and remembers what it
replaced; leaving the ``with`` block (or :meth:`Patch.undo`) puts each back.
memsave itself calls the original it saved at import, so it never recurses.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from memsave import _tf_private, planners
from memsave.errors import ArgumentError, PatchError
from memsave.api import gradients as _memsave_gradients, not_checkpoints
from memsave.costs import check_batch_size
from memsave.planners.budget import check_budget
from memsave.record import Plan

__all__ = ["Patch", "patch", "unpatch"]

_lock = threading.Lock()
_active: list["Patch"] = []

_ORIGINAL_V1 = _tf_private.original_gradients
_ORIGINAL_V2 = _tf_private.original_gradients_v2


def _wrappers(checkpoints, strategy_options, memory_budget=None, batch_size=None):
    @tf.autograph.experimental.do_not_convert
    @functools.wraps(_ORIGINAL_V1)
    def gradients_v1(ys, xs, grad_ys=None, name="gradients", colocate_gradients_with_ops=False,
                     gate_gradients=False, aggregation_method=None, stop_gradients=None,
                     unconnected_gradients=tf.UnconnectedGradients.NONE):
        return _memsave_gradients(
            ys, xs, grad_ys, checkpoints, name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients,
            strategy_options=strategy_options, memory_budget=memory_budget,
            batch_size=batch_size,
        )

    @tf.autograph.experimental.do_not_convert
    @functools.wraps(_ORIGINAL_V2)
    def gradients_v2(ys, xs, grad_ys=None, name="gradients", gate_gradients=False,
                     aggregation_method=None, stop_gradients=None,
                     unconnected_gradients=tf.UnconnectedGradients.NONE):
        # TF2's tf.gradients always colocates each gradient op with its forward op.
        return gradients_v1(ys, xs, grad_ys, name, True, gate_gradients, aggregation_method,
                            stop_gradients, unconnected_gradients)

    gradients_v1.memsave_checkpoints = checkpoints
    gradients_v2.memsave_checkpoints = checkpoints
    # Which signature each has, for a patch applied over this one.
    gradients_v1.memsave_signature = "v1"
    gradients_v2.memsave_signature = "v2"
    return gradients_v1, gradients_v2


def _aliases():
    """(module, attribute, original) for every binding of the stock functions."""
    found = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith("tensorflow"):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            if value is _ORIGINAL_V1 or value is _ORIGINAL_V2:
                found.append((module, attr, value))
    return found


class Patch:
    """An applied patch; a context manager that undoes itself on exit.

    Entering one that was undone (a second ``with`` block on the same
    object) applies it again; entering one that is applied nests, and only
    the outermost block's exit undoes it.
    """

    def __init__(self, checkpoints, strategy_options: Mapping[str, Any] | None = None,
                 memory_budget: int | float | None = None, batch_size: int | None = None):
        self.checkpoints = checkpoints
        self._settings = (checkpoints, strategy_options, memory_budget, batch_size)
        self._undone = True
        self._entered = 0  # with-blocks open on this patch
        self._apply()

    def _apply(self) -> None:
        v1, v2 = _wrappers(*self._settings)
        with _lock:
            self._saved = []
            for module, attr, value in _aliases():
                setattr(module, attr, v1 if value is _ORIGINAL_V1 else v2)
                self._saved.append((module, attr, value))
            # A patch applied over another replaces the other's wrappers too.
            for outer in _active:
                for module, attr, _ in outer._saved:
                    current = vars(module).get(attr)
                    if hasattr(current, "memsave_signature"):
                        wrapper = v1 if current.memsave_signature == "v1" else v2
                        self._saved.append((module, attr, current))
                        setattr(module, attr, wrapper)
            _active.append(self)
            self._undone = False

    @property
    def aliases(self) -> int:
        """How many module attributes this patch replaced."""
        return len(self._saved)

    def undo(self) -> None:
        """Put back what this patch replaced. Patches undo in reverse order."""
        with _lock:
            if self._undone:
                return
            if _active[-1] is not self:
                raise PatchError(
                    "memsave.patch: undo the innermost patch first (patches nest like "
                    "with-blocks)"
                )
            for module, attr, value in reversed(self._saved):
                setattr(module, attr, value)
            _active.pop()
            self._undone = True

    def __enter__(self) -> "Patch":
        if self._undone:
            self._apply()
        self._entered += 1
        return self

    def __call__(self, fn):
        """``@memsave.patch(...)`` on a function: patched while it runs, each
        call (the patch made by the decoration itself is undone at once)."""
        self.undo()
        if not callable(fn):
            raise ArgumentError(
                f"memsave.patch(...) decorates a function, got {type(fn).__name__}; use it as "
                "a context manager (with memsave.patch(...):) or a decorator (@memsave.patch())")
        settings = self._settings

        @functools.wraps(fn)
        def patched(*args, **kwargs):
            with Patch(*settings):
                return fn(*args, **kwargs)

        return patched

    def __exit__(self, *exc) -> None:
        self._entered -= 1
        if not self._entered:
            self.undo()


def patch(checkpoints="memory", *, strategy_options: Mapping[str, Any] | None = None,
          memory_budget: int | float | None = None, batch_size: int | None = None) -> Patch:
    """Make tf.gradients (every alias) and tf.compat.v1 optimizers use memsave.

    Use as a context manager::

        with memsave.patch(checkpoints="memory"):
            train_op = tf.compat.v1.train.AdamOptimizer().minimize(loss)

    as a decorator (patched while the function runs)::

        @memsave.patch(checkpoints="memory")
        def build_train_op(loss): ...

    or call it and later :func:`unpatch` (or ``p.undo()``). ``memory_budget``
    is passed to every :func:`memsave.gradients` call (bytes, or a fraction
    of each call's forecast plain peak), and so is ``batch_size``: the size
    to plan for where the graph's batch dimension is unknown (a
    ``placeholder`` of shape ``[None, ...]``), without which memsave plans
    for a batch of 1 and saves little.

    Raises
    ------
    CheckpointError
        ``checkpoints`` is neither a strategy name, a list of tensors nor a
        Plan.
    UnknownStrategyError
        ``checkpoints`` names no registered strategy (here, not at the
        first patched call).
    OptionsError, MemoryBudgetError
        ``strategy_options`` the strategy does not take (or values it
        refuses), a ``memory_budget`` that is neither bytes nor a fraction:
        here too.
    """
    if isinstance(checkpoints, str):
        planners.check(checkpoints, budget=memory_budget, options=strategy_options,
                       api="memsave.patch")
    elif not isinstance(checkpoints, (list, tuple, Plan)):
        raise not_checkpoints(checkpoints, "memsave.patch")
    elif memory_budget is not None:
        check_budget(memory_budget, api="memsave.patch")
    check_batch_size(batch_size, api="memsave.patch")
    return Patch(checkpoints, strategy_options, memory_budget, batch_size)


def unpatch() -> None:
    """Undo the most recent :func:`patch` still applied (no-op when none is)."""
    with _lock:
        last = _active[-1] if _active else None
    if last is not None:
        last.undo()
