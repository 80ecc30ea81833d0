"""Run test code in a fresh Python process: one harness for every test that needs one.

A test needs a fresh process when what it checks depends on the whole
process: an allocator peak counts every live tensor in it (other tests leave
some); TensorFlow state is fixed when the runtime starts (logical devices, a
multi-worker cluster, ``tf.compat.v1.disable_v2_behavior()``); or the thing
under test is the command line or an installed package.

:class:`Fresh` (the session fixture ``fresh`` of tests/conftest.py) offers:

``fresh.call(function, *args, timeout_s=..., env=None)``
    Runs ``function(*args)`` in a fresh interpreter and returns its result.
    ``function`` is a module-level function of a module under tests/ (a test
    module or a helper); ``args`` and the result are JSON values. The child
    imports that module by its path, as pytest does (tests/ on sys.path, the
    module under its file's stem), so module-level code runs there too: keep
    it cheap, and set up process-wide TensorFlow state inside the function.
    Each distinct call runs once per test session, whichever test asks first,
    also across pytest-xdist workers (a file cache with a lock per call):
    tests that read one measurement share one process. A failure (an
    exception in the child, a non-zero exit, a timeout) is cached as well:
    every later test that needs it fails with the same report at once,
    without relaunching it.

``fresh.run(argv, *, timeout_s=..., **kwargs)``
    ``subprocess.run`` (text, output captured) that always has a timeout; a
    process that outlives it fails the test with the tail of its output.
    For commands that are not a function call: ``python -m memsave``,
    ``pip``, ``python -m build``.

``fresh.command(function, *args)`` and ``fresh.env(**extra)``
    The argv and environment of a call, for tests that start processes
    themselves (several at once, e.g. the workers of one cluster); they
    must wait with a deadline of their own.

Several measurements in one process: a child function may measure several
things one after the other (each method of a model, each mode), which saves
a TensorFlow start-up (5-10 s on 2 cores) per measurement. It must not let
one measurement disturb the next: :func:`one_after_another` runs them in
order and fails if one starts with more bytes allocated than the first did
(a tensor the previous one left alive would be counted in the next peak).
Measurements that change process-wide state, or whose counting depends on
the allocator's pool being fresh, keep a process of their own.

Parallel runs (``./run_all_tests.sh`` runs pytest-xdist workers): an
allocator peak is per process, so measurements in fresh processes stay
honest while other tests run; no unit test has a timing threshold. Tests of
one module that share an expensive module-scoped fixture built in the test
process keep to one worker with ``pytestmark =
pytest.mark.xdist_group("<module>")`` (the runner distributes with
``--dist loadgroup``); fixtures built with ``fresh.call`` need no group,
their result is shared through the cache.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, calls may run twice across workers
    fcntl = None

TESTS = Path(__file__).resolve().parent

#: Seconds a child process may take unless the caller says otherwise: the
#: slowest measurement here takes about 2 minutes on 2 busy cores.
DEFAULT_TIMEOUT_S = 600

#: The child prints its result on one line that starts with this marker
#: (whatever else it prints, TensorFlow's notices included, is ignored).
RESULT_MARKER = "@@fresh-result@@ "

#: Output kept in a failure report.
TAIL_CHARS = 4000


def _tail(text: str | bytes | None, n: int = TAIL_CHARS) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-n:]


class Fresh:
    """Calls and commands in fresh processes, with a cache shared by the session's workers."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._memo: dict[str, dict] = {}  # key -> record, read or written this process
        self._failed: set[str] = set()  # keys whose failure was reported here already

    # -- the pieces of a call --------------------------------------------------------

    @staticmethod
    def env(**extra: str) -> dict:
        """The environment of a child: this one, TensorFlow's C++ INFO lines off, plus ``extra``."""
        return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)

    @staticmethod
    def command(function: Callable, *args: Any) -> list[str]:
        """argv that runs ``function(*args)`` in a fresh interpreter (see :meth:`call`)."""
        path = Path(inspect.getfile(function)).resolve()
        name = function.__name__
        if function.__qualname__ != name or getattr(sys.modules.get(function.__module__), name,
                                                     None) is not function:
            raise TypeError(f"fresh: {function.__qualname__} is not a module-level function "
                            f"of {path.name}: the child looks it up by name in its module")
        return [sys.executable, str(TESTS / "fresh.py"), str(path), name, json.dumps(list(args))]

    # -- call --------------------------------------------------------------------

    def call(self, function: Callable, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
             env: dict | None = None) -> Any:
        """``function(*args)`` run once per session in a fresh process; its JSON result."""
        argv = self.command(function, *args)
        what = f"{Path(argv[2]).name}::{argv[3]}({', '.join(map(repr, args))})"
        extra = {k: v for k, v in (env or {}).items()}
        key = hashlib.sha1(json.dumps([argv[2:], sorted(extra.items())]).encode()).hexdigest()
        record = self._memo.get(key)
        if record is None:
            with self._locked(key):
                path = self.cache_dir / f"{key}.json"
                if path.exists():
                    record = json.loads(path.read_text())
                    record["cached"] = True
                else:
                    record = self._launch(argv, what, timeout_s, self.env(**extra))
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(record))
                    os.replace(tmp, path)
            self._memo[key] = record
        if "error" in record:
            again = (" (earlier in this session; not run again)"
                     if record.get("cached") or key in self._failed else "")
            self._failed.add(key)
            pytest.fail(f"fresh process {what} failed{again}:\n{record['error']}", pytrace=False)
        return record["result"]

    @contextlib.contextmanager
    def _locked(self, key: str):
        if fcntl is None:
            yield
            return
        with open(self.cache_dir / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _launch(self, argv: list[str], what: str, timeout_s: float, env: dict) -> dict:
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            return {"error": f"timed out after {timeout_s} s\n--- stdout:\n{_tail(e.stdout, 1000)}"
                             f"\n--- stderr:\n{_tail(e.stderr)}"}
        seconds = round(time.monotonic() - start, 1)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
        if proc.returncode != 0 or not lines:
            return {"error": f"exit status {proc.returncode} after {seconds} s"
                             f"{'' if lines else ', no result printed'}\n"
                             f"--- stdout:\n{_tail(proc.stdout, 1000)}\n"
                             f"--- stderr:\n{_tail(proc.stderr)}"}
        return {"result": json.loads(lines[-1][len(RESULT_MARKER):]), "seconds": seconds,
                "what": what}

    # -- run ---------------------------------------------------------------------

    @staticmethod
    def run(argv: list, *, timeout_s: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, capture_output=True, text=True, **kwargs)`` with a timeout."""
        argv = [str(a) for a in argv]
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{' '.join(argv)[:300]}: timed out after {timeout_s} s\n"
                        f"--- stdout:\n{_tail(e.stdout, 1000)}\n--- stderr:\n{_tail(e.stderr)}",
                        pytrace=False)


# -- in the child -----------------------------------------------------------------------


def allocated_bytes() -> int:
    """Bytes the CPU allocator holds for live tensors now (after collecting garbage)."""
    import tensorflow as tf

    gc.collect()
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


def one_after_another(measurements: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each measurement in turn in this process; {name: result}.

    Before each one, garbage is collected and the allocator's live bytes
    compared with those before the first: a measurement that starts with
    more (a tensor, a variable or a model the previous one left alive, which
    the next peak would count) raises instead of measuring.
    """
    results = {}
    start = None
    for name, measure in measurements.items():
        now = allocated_bytes()
        if start is None:
            start = now
        elif now > start:
            raise RuntimeError(
                f"{name}: {now - start} bytes are still allocated from the measurements before "
                f"it ({', '.join(results)}); they would be counted in its peak")
        results[name] = measure()
    return results


def _child(path: str, name: str, args_json: str) -> None:
    sys.path.insert(0, str(Path(path).parent))
    stem = Path(path).stem
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    spec.loader.exec_module(module)
    result = getattr(module, name)(*json.loads(args_json))
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    _child(*sys.argv[1:4])
