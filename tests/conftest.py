"""Shared pytest fixtures for the memsave tests.

Fixtures only: model builders live in tests/zoo.py, helpers next to the tests
that use them. No global session and no global TensorFlow state is changed
here: every graph-mode run gets its own graph, entered and left by a context
manager, and its own session, closed after the run.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import pytest
import tensorflow as tf

SESSION = "session"
FUNCTION = "function"


class SparseValue(NamedTuple):
    """The evaluated value of a tf.IndexedSlices (dense_shape may be None)."""

    values: np.ndarray
    indices: np.ndarray
    dense_shape: Any

    def to_dense(self, shape=None):
        """Scatter-add into a dense array (duplicate indices are summed)."""
        shape = tuple(self.dense_shape if self.dense_shape is not None else shape)
        dense = np.zeros(shape, dtype=np.float64)
        np.add.at(dense, self.indices, self.values.astype(np.float64))
        return dense


class Evaluator:
    """Build a computation in one mode and return its values as numpy.

    ``evaluate(mode, setup, body)``:

    * mode ``"session"``: in a fresh ``tf.compat.v1.Graph``, ``state =
      setup()`` then ``out = body(state)``; variables are initialized and
      ``out`` is fetched by ONE ``session.run``.
    * mode ``"function"``: ``state = setup()`` runs eagerly (create variables
      there: a tf.function may not create them on every trace), then
      ``body(state)`` is traced in one ``tf.function`` that is called ONCE.

    Either way every tensor of ``out`` comes from the same execution, so ops
    with random state (dropout) have one value for all of them. ``out`` is
    any tf.nest structure; tensors become numpy arrays, tf.IndexedSlices
    become :class:`SparseValue`, None and other Python leaves are returned as
    they are (values seen while tracing).
    """

    SparseValue = SparseValue
    modes = (SESSION, FUNCTION)

    def __call__(self, mode: str, setup: Callable[[], Any], body: Callable[[Any], Any]):
        if mode == SESSION:
            return self._session(setup, body)
        if mode == FUNCTION:
            return self._function(setup, body)
        raise ValueError(f"evaluate: mode={mode!r}; expected one of {self.modes}")

    @staticmethod
    def _flatten(out):
        leaves = tf.nest.flatten(out)
        fetches, recipes = [], []
        for leaf in leaves:
            if isinstance(leaf, tf.IndexedSlices):
                parts = [leaf.values, leaf.indices]
                if leaf.dense_shape is not None:
                    parts.append(leaf.dense_shape)
                recipes.append(("sparse", len(fetches), len(parts)))
                fetches.extend(parts)
            elif isinstance(leaf, (tf.Tensor, tf.Variable)):
                recipes.append(("dense", len(fetches), 1))
                fetches.append(leaf)
            else:
                recipes.append(("python", leaf, 0))
        return fetches, recipes

    @staticmethod
    def _unflatten(out, recipes, values):
        leaves = []
        for kind, where, count in recipes:
            if kind == "python":
                leaves.append(where)
            elif kind == "dense":
                leaves.append(np.asarray(values[where]))
            else:
                parts = [np.asarray(v) for v in values[where:where + count]]
                shape = tuple(parts[2].tolist()) if count == 3 else None
                leaves.append(SparseValue(parts[0], parts[1], shape))
        return tf.nest.pack_sequence_as(out, leaves)

    def _session(self, setup, body):
        g = tf.compat.v1.Graph()
        with g.as_default():
            out = body(setup())
            fetches, recipes = self._flatten(out)
            init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(init)
            values = sess.run(fetches)
        return self._unflatten(out, recipes, values)

    def _function(self, setup, body):
        state = setup()
        traced = {}

        @tf.function
        def run():
            out = body(state)
            fetches, recipes = self._flatten(out)
            traced.update(out=out, recipes=recipes)
            return fetches

        values = [v.numpy() for v in run()]
        return self._unflatten(traced["out"], traced["recipes"], values)


@pytest.fixture
def evaluate():
    """An :class:`Evaluator`: run a computation as a Session graph or a tf.function."""
    return Evaluator()


@pytest.fixture
def graph():
    """A fresh tf.compat.v1.Graph, installed as the default graph for the test."""
    g = tf.compat.v1.Graph()
    with g.as_default():
        yield g


@pytest.fixture
def session(graph):
    """A tf.compat.v1.Session on the test's `graph`, closed after the test."""
    with tf.compat.v1.Session(graph=graph) as sess:
        yield sess


@pytest.fixture
def rng():
    """A seeded numpy RandomState, so random test data is reproducible."""
    return np.random.RandomState(0)
