"""memsave: gradient checkpointing for TensorFlow 2, done as a graph rewrite.

``memsave.gradients(ys, xs, checkpoints=...)`` is a drop-in for
``tf.gradients`` that keeps a few forward tensors and recomputes the rest
during the backward pass, so activation memory grows like sqrt(depth).

``memsave.keras`` (Keras 3 ``fit`` through memsave) is imported on first
use (``memsave.keras`` or ``import memsave.keras``), not by ``import memsave``.
"""

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "memsave needs TensorFlow >= 2.16, which is not installed. Install one of: "
        "pip install 'memsave[tensorflow-cpu]' (CPU only), 'memsave[tensorflow]' "
        "(with GPU support), or tf-nightly."
    ) from e

from memsave import costs, planners, simulate, strategies
from memsave.errors import (
    CheckpointError,
    EagerExecutionError,
    GraphMismatchError,
    MemoryBudgetError,
    MemsaveError,
    OptionsError,
    UnknownStrategyError,
)
from memsave.api import (
    gradients,
    gradients_collection,
    gradients_memory,
    gradients_speed,
    plan,
)
from memsave.memory_model import MemoryModel
from memsave.problem import Problem
from memsave.record import Plan
from memsave.patch import Patch, patch, unpatch

__version__ = "0.1.0"


def __getattr__(name: str):
    # memsave.keras imports Keras: load it only when asked for (PEP 562).
    if name == "keras":
        import importlib

        return importlib.import_module("memsave.keras")
    raise AttributeError(f"module 'memsave' has no attribute {name!r}")


__all__ = [
    "gradients",
    "gradients_memory",
    "gradients_speed",
    "gradients_collection",
    "plan",
    "Plan",
    "patch",
    "unpatch",
    "Patch",
    "Problem",
    "MemoryModel",
    "planners",
    "strategies",
    "costs",
    "simulate",
    "MemsaveError",
    "EagerExecutionError",
    "GraphMismatchError",
    "CheckpointError",
    "UnknownStrategyError",
    "MemoryBudgetError",
    "OptionsError",
]
