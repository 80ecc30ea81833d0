"""memsave: gradient checkpointing for TensorFlow 2, done as a graph rewrite.

``memsave.gradients(ys, xs, checkpoints=...)`` is a drop-in for
``tf.gradients`` that keeps a few forward tensors and recomputes the rest
during the backward pass, so activation memory grows like sqrt(depth).

The names below load on first use (PEP 562), so ``import memsave`` itself
does not import TensorFlow: ``python -m memsave --help`` answers at once,
and a missing TensorFlow is reported here, by name, before anything else.
``memsave.keras`` (Keras 3 ``fit`` through memsave) loads Keras when it is
first used (``memsave.keras`` or ``import memsave.keras``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if importlib.util.find_spec("tensorflow") is None:  # pragma: no cover - depends on the environment
    raise ImportError(
        "memsave needs TensorFlow >= 2.16, which is not installed. Install it: "
        "pip install tensorflow-cpu (CPU only) or tensorflow (with GPU support); or, in "
        "memsave's checkout, pip install '.[tensorflow-cpu]' or '.[tensorflow]'."
    )

__version__ = "0.1.0"

#: Public name -> the module that defines it (a module's own name: the module).
_WHERE = {
    "gradients": "memsave.api",
    "gradients_memory": "memsave.api",
    "gradients_speed": "memsave.api",
    "gradients_collection": "memsave.api",
    "plan": "memsave.api",
    "Plan": "memsave.record",
    "patch": "memsave.patching",
    "unpatch": "memsave.patching",
    "Patch": "memsave.patching",
    "Problem": "memsave.problem",
    "MemoryModel": "memsave.memory_model",
    "planners": "memsave.planners",
    "strategies": "memsave.strategies",
    "costs": "memsave.costs",
    "simulate": "memsave.simulate",
    "keras": "memsave.keras",
    "MemsaveError": "memsave.errors",
    "EagerExecutionError": "memsave.errors",
    "GraphMismatchError": "memsave.errors",
    "CheckpointError": "memsave.errors",
    "UnknownStrategyError": "memsave.errors",
    "MemoryBudgetError": "memsave.errors",
    "OptionsError": "memsave.errors",
    "ArgumentError": "memsave.errors",
    "PatchError": "memsave.errors",
    "DeviceProfileError": "memsave.errors",
    "LoopChoiceError": "memsave.errors",
}

__all__ = [name for name in _WHERE if name != "keras"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'memsave' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where == f"memsave.{name}" else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from memsave import costs, keras, planners, simulate, strategies
    from memsave.api import gradients, gradients_collection, gradients_memory, gradients_speed, plan
    from memsave.errors import (
        ArgumentError,
        CheckpointError,
        DeviceProfileError,
        EagerExecutionError,
        GraphMismatchError,
        LoopChoiceError,
        MemoryBudgetError,
        MemsaveError,
        OptionsError,
        PatchError,
        UnknownStrategyError,
    )
    from memsave.memory_model import MemoryModel
    from memsave.patching import Patch, patch, unpatch
    from memsave.problem import Problem
    from memsave.record import Plan
