"""Shared pytest fixtures for the memsave tests, and the ``--cpu-durations`` report.

Fixtures and one report only: model builders live in tests/zoo.py, helpers
next to the tests that use them. No global session and no global TensorFlow state is changed
here: every graph-mode run gets its own graph, entered and left by a context
manager, and its own session, closed after the run.

How the suite stays fast enough to run often (a test file added later
should follow the same rules):

* Tiers. ``./run_all_tests.sh -m "not slow"`` is the fast tier: every
  module keeps tests in it, and it runs in a few minutes. A test that takes
  more than about 5 s of CPU is marked ``@pytest.mark.slow``; it still runs
  in the full suite, ``./run_all_tests.sh``, which CI runs. Mark the test,
  not the module, so that each module keeps a fast check. Wall times on a
  shared machine say little: ``--cpu-durations=N`` lists the N tests that
  used the most CPU time (the test process's threads, the processes it
  waited for and fresh's forked children; setup and teardown included; 0
  lists all) and their sum.
* Fresh processes. A test that must run something in a fresh process (an
  allocator peak, process-wide TensorFlow state, a command) uses the
  session fixture ``fresh`` (:class:`fresh.Fresh`, see tests/fresh.py):
  ``fresh.call(function, *args)`` runs a module-level function in a child
  (forked from a server that has imported TensorFlow) once per session,
  shares its JSON result with every test that asks for it (also across
  parallel workers), caches failures too, and has a timeout;
  ``fresh.run(argv)`` runs a command with a timeout. A child may make
  several measurements one after the other (``fresh.one_after_another``),
  which checks that none leaves tensors for the next to count.
* Shared fixtures. Build what is expensive (a model, its forecasts, a
  measurement) once, in a module- or session-scoped fixture, and make tests
  read it rather than rebuild it.
* Parallel workers. ``./run_all_tests.sh`` runs pytest-xdist with
  ``--dist loadgroup``: tests are spread over the workers one by one, except
  those marked ``pytest.mark.xdist_group(name)``, which run on one worker
  together. Give a module with an expensive module-scoped fixture built in
  the test process (not through ``fresh``) ``pytestmark =
  pytest.mark.xdist_group("<module>")``, or each worker builds it. Tests
  that use ``fresh`` get a group per module automatically (see
  :func:`pytest_collection_modifyitems`).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable, NamedTuple

# The CPU allocator keeps the statistics the memory tests read
# (get_memory_info) only with oneDNN on, which TensorFlow turns on by default
# only on CPUs with AVX-512 or newer (an AMD EPYC without it: every peak
# measurement fails, "Allocator stats not available"); it is also the
# allocator memsave's CPU memory model describes. Before TensorFlow is
# imported; fresh processes inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from fresh import Fresh

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
      Autograph is off there: ``body`` is traced as written. With it on,
      autograph converted the tests' own Python (model builders, the op
      counting helpers) statement by statement: 40% of
      tests/test_gradients_zoo.py's time. memsave under autograph is tested
      where users meet it: test steps decorated with plain ``@tf.function``
      (tests/test_loops.py, tests/test_budget.py's errors through autograph)
      and the docs' examples.

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

        @tf.function(autograph=False)
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


@pytest.fixture(scope="session")
def fresh(tmp_path_factory) -> Fresh:
    """Run code in fresh processes, each call once per session (see tests/fresh.py)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, shared by its workers
    return Fresh(root / "fresh")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """Tests of one module that use ``fresh`` run on one worker (``--dist
    loadgroup``), unless they name a group of their own: they often share a
    measurement, and a worker that asked for one another worker is making
    waits for it, idle (a shared Keras fit measurement took 40 s of CPU)."""
    for item in items:
        if "fresh" in getattr(item, "fixturenames", ()) and \
                item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"fresh:{item.module.__name__}"))


def pytest_collection_finish(session):
    """Refuse to run where ``--dist loadgroup`` cannot group.

    pytest-xdist 3.8 groups a test by writing ``@<group>`` into
    ``Item._nodeid``; pytest 9.2 no longer reads that attribute, so every
    group is silently ignored (pytest-dev/pytest-xdist#1386): each worker
    then builds the module fixtures a group shares, and waits for the
    ``fresh`` measurements another worker is making.
    """
    for item in session.items:
        written = item.__dict__.get("_nodeid")
        if written and "@" in written and written != item.nodeid:
            raise pytest.UsageError(
                "pytest-xdist's --dist loadgroup cannot group tests with this pytest "
                f"(pytest-dev/pytest-xdist#1386: {written!r} reads as {item.nodeid!r}); "
                "install pytest<9.2 (scripts/bootstrap.sh does)")


# -- --cpu-durations -------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations", type=int, default=None, metavar="N",
        help="list the N tests that used the most CPU time, this process's and its "
             "children's (0: all), and the sum over every test")


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime + Fresh.forked_cpu_s


def _timed_phase(item):
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_s", _cpu_seconds() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed_phase(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed_phase(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _timed_phase(item)


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None:
        return
    # Each phase's report carries the properties recorded so far: keep the largest
    # count of cpu_s entries seen per test (the teardown report has all three).
    phases: dict[str, list[float]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            props = [v for k, v in getattr(report, "user_properties", ()) if k == "cpu_s"]
            if len(props) > len(phases.get(getattr(report, "nodeid", ""), ())):
                phases[report.nodeid] = props
    totals = sorted(((sum(v), k) for k, v in phases.items()), reverse=True)
    terminalreporter.write_sep("=", f"CPU seconds per test (sum of {len(totals)} tests: "
                                    f"{sum(t for t, _ in totals):.1f} s)")
    for seconds, nodeid in totals[:n or None]:
        terminalreporter.write_line(f"{seconds:8.2f}s {nodeid}")
