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

Start-up. A child of ``call`` is forked from a server process that has
imported TensorFlow once (``python tests/fresh.py --server``, one per test
process, started on its first call): importing TensorFlow costs 5 s of
CPU, and about 40 children run in a session. A fork of a process that has
only imported TensorFlow is still fresh in every way the tests read: its
allocator has counted nothing, its runtime (devices, thread pools, eager
context, v1/v2 behaviour) has not started, and it has imported neither
memsave nor memsave's Keras support. The server has this process's
environment, so a call with ``env`` (which may set what TensorFlow reads
when it is imported) starts a new interpreter instead, as every call does
with ``MEMSAVE_FRESH_START=spawn``. A forked child is not a child of the
test process: it reports its CPU time, which :attr:`Fresh.forked_cpu_s`
sums for ``--cpu-durations``.

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
import resource
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
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

#: How a call's child starts: "fork" (from the server that has imported
#: TensorFlow, where os.fork exists) or "spawn" (a new interpreter).
START = os.environ.get("MEMSAVE_FRESH_START") or ("fork" if hasattr(os, "fork") else "spawn")
if START not in ("fork", "spawn"):
    raise ValueError(f"MEMSAVE_FRESH_START must be 'fork' or 'spawn', not {START!r}")

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

    #: CPU seconds of the forked children this process has waited for (see
    #: the module docstring's "Start-up"; resource's RUSAGE_CHILDREN does not
    #: count them).
    forked_cpu_s: float = 0.0

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
                    launch = self._fork if START == "fork" and not extra else self._launch
                    record = launch(argv, what, timeout_s, self.env(**extra))
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
        return self._record(proc.returncode, proc.stdout, proc.stderr,
                            round(time.monotonic() - start, 1), what)

    @staticmethod
    def _record(returncode: int, stdout: str, stderr: str, seconds: float, what: str) -> dict:
        lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
        if returncode != 0 or not lines:
            return {"error": f"exit status {returncode} after {seconds} s"
                             f"{'' if lines else ', no result printed'}\n"
                             f"--- stdout:\n{_tail(stdout, 1000)}\n"
                             f"--- stderr:\n{_tail(stderr)}"}
        return {"result": json.loads(lines[-1][len(RESULT_MARKER):]), "seconds": seconds,
                "what": what}

    def _fork(self, argv: list[str], what: str, timeout_s: float, env: dict) -> dict:
        """As :meth:`_launch`, the child forked from the server (see "Start-up")."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="fresh-") as tmp:
            files = [os.path.join(tmp, name) for name in ("stdout", "stderr", "cpu")]
            status = _Server.call([*argv[2:5], *files], timeout_s)
            stdout, stderr, cpu = (open(f, errors="replace").read() if os.path.exists(f) else ""
                                   for f in files)
        Fresh.forked_cpu_s += float(cpu or 0)
        if status is None:
            return {"error": f"timed out after {timeout_s} s\n--- stdout:\n{_tail(stdout, 1000)}"
                             f"\n--- stderr:\n{_tail(stderr)}"}
        return self._record(status, stdout, stderr, round(time.monotonic() - start, 1), what)

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


def step_peaks(run: Callable[[], Any], calls: int, *, above_resident: bool = False) -> list[int]:
    """The CPU allocator's peak (bytes) during each of ``calls`` calls of
    ``run``, its statistics reset before each call: the measurement every
    memory test here takes. Call ``run`` once before, to trace and warm up;
    ``run`` should wait for its step (return numpy values, or call
    ``.numpy()``). With ``above_resident``, each peak less the bytes in use
    before the first call: what the step itself added."""
    import tensorflow as tf

    resident = tf.config.experimental.get_memory_info("CPU:0")["current"] if above_resident else 0
    peaks = []
    for _ in range(calls):
        tf.config.experimental.reset_memory_stats("CPU:0")
        run()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - resident)
    return peaks


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


class _Server:
    """This process's fork server: ``python fresh.py --server``, started on first use.

    Protocol, one JSON line each way per call: the request is ``[path, name,
    args_json, stdout_file, stderr_file, cpu_file]``; the server forks, answers
    the child's pid, waits for it and answers its exit status. The server
    ends when its stdin closes (this process exits).
    """

    _proc: subprocess.Popen | None = None
    _lock = threading.Lock()

    @classmethod
    def call(cls, request: list[str], timeout_s: float) -> int | None:
        """The child's exit status, or None when it was killed at ``timeout_s``."""
        with cls._lock:
            if cls._proc is None or cls._proc.poll() is not None:
                cls._proc = subprocess.Popen(
                    [sys.executable, str(TESTS / "fresh.py"), "--server"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    env=Fresh.env())
            proc = cls._proc
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            fd = proc.stdout.fileno()
            pid = int(_read_line(fd, None))
            status = _read_line(fd, time.monotonic() + timeout_s)
            if status is None:
                os.kill(pid, signal.SIGKILL)
                _read_line(fd, None)
                return None
            return int(status)


def _read_line(fd: int, deadline: float | None) -> str | None:
    """One line from ``fd``, or None at ``deadline`` (unbuffered: nothing read ahead)."""
    line = b""
    while not line.endswith(b"\n"):
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], wait)[0]:
            return None
        byte = os.read(fd, 1)
        if not byte:
            raise RuntimeError("fresh: the fork server exited")
        line += byte
    return line.decode()


def _serve() -> None:
    import tensorflow  # noqa: F401  (what every child would import first)

    for request in sys.stdin:
        pid = os.fork()
        if pid == 0:
            _forked(*json.loads(request))
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


def _forked(path: str, name: str, args_json: str, stdout: str, stderr: str, cpu: str) -> None:
    """A forked child: output to files, the call, its CPU time to ``cpu``; never returns."""
    for fd, file, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        target = os.open(file, flags)
        os.dup2(target, fd)
        os.close(target)
    code = 0
    try:
        _child(path, name, args_json)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # reported as an interpreter would: the traceback, status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    with open(cpu, "w") as f:
        f.write(str(sum(u.ru_utime + u.ru_stime for u in usage)))
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--server"]:
        _serve()
    else:
        _child(*sys.argv[1:4])
