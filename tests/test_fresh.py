"""The fresh-process harness of the tests (tests/fresh.py).

Its children import this module, which imports neither TensorFlow nor
memsave (a forked child has TensorFlow imported already, see fresh.py's
"Start-up").
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from fresh import Fresh, one_after_another


def pid_and_launches(log: str) -> list:
    """This process's id, and how many processes have run this function with ``log``."""
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    with open(log) as f:
        return [os.getpid(), len(f.read().split())]


def fails(log: str) -> None:
    with open(log, "a") as f:
        f.write("launched\n")
    raise ValueError("this measurement failed")


def sleeps(seconds: float) -> None:
    print("started", flush=True)
    time.sleep(seconds)


def runtime_state(test_pid: int) -> dict:
    """What a child finds: TensorFlow's runtime not started, nothing allocated, no memsave."""
    import tensorflow as tf

    memsave_loaded = any(name.startswith("memsave") for name in sys.modules)
    cpu = tf.config.list_physical_devices("CPU")[0]
    # Raises RuntimeError once the runtime has started.
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    before = tf.config.experimental.get_memory_info("CPU:0")
    x = tf.ones([1 << 20])  # 4 MiB
    return {"memsave_loaded": memsave_loaded, "before": before,
            "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"],
            "logical_cpus": len(tf.config.list_logical_devices("CPU")),
            "sum": float(tf.reduce_sum(x)),
            "child_of_the_test_process": os.getppid() == test_pid}


@pytest.fixture
def private(tmp_path):
    """A Fresh with a cache of its own (not the session's)."""
    return Fresh(tmp_path / "cache")


def test_a_call_runs_once_in_another_process_and_is_shared(private, tmp_path):
    log = str(tmp_path / "launches")
    pid, launches = private.call(pid_and_launches, log)
    assert pid != os.getpid() and launches == 1
    assert private.call(pid_and_launches, log) == [pid, 1]
    # Another Fresh on the same cache (a second xdist worker) reads the result.
    assert Fresh(private.cache_dir).call(pid_and_launches, log) == [pid, 1]
    assert open(log).read().split() == [str(pid)]


def test_a_failure_is_cached_and_every_caller_fails(private, tmp_path):
    log = str(tmp_path / "launches")
    with pytest.raises(pytest.fail.Exception, match="this measurement failed") as first:
        private.call(fails, log)
    assert "not run again" not in str(first.value)
    for caller in (private, Fresh(private.cache_dir)):
        with pytest.raises(pytest.fail.Exception, match="not run again") as again:
            caller.call(fails, log)
        assert "this measurement failed" in str(again.value)
    assert open(log).read().split() == ["launched"], "the failed call was launched again"


def test_a_call_past_its_timeout_fails_with_its_output(private):
    with pytest.raises(pytest.fail.Exception, match="(?s)timed out after 2 s.*started"):
        private.call(sleeps, 60, timeout_s=2)
    with pytest.raises(pytest.fail.Exception, match="(?s)timed out after 2 s.*started"):
        Fresh.run([sys.executable, "-c", "print('started', flush=True); import time; "
                                         "time.sleep(60)"], timeout_s=2)


def test_only_module_level_functions_can_be_called(private):
    def local():
        return 1

    with pytest.raises(TypeError, match="not a module-level function"):
        private.call(local)


def test_one_after_another_refuses_a_measurement_left_tensors_behind():
    import tensorflow as tf

    kept = []

    def leaks():
        kept.append(tf.zeros([1 << 20]))  # 4 MiB, above the allocator's counting floor
        return 1

    assert one_after_another({"a": lambda: 1, "b": lambda: 2}) == {"a": 1, "b": 2}
    with pytest.raises(RuntimeError, match=r"second: \d+ bytes are still allocated.*first"):
        one_after_another({"first": leaks, "second": lambda: 2})
    assert np.asarray(kept[0]).sum() == 0


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_child_starts_fresh(private, monkeypatch, start):
    import fresh

    monkeypatch.setattr(fresh, "START", start)
    state = private.call(runtime_state, os.getpid())
    assert state["before"] == {"current": 0, "peak": 0}
    assert state["peak"] == 4 << 20 and state["sum"] == 1 << 20
    assert state["logical_cpus"] == 2 and not state["memsave_loaded"]
    # A forked child's parent is the fork server.
    assert state["child_of_the_test_process"] == (start == "spawn")
    if start == "fork":
        assert fresh.Fresh.forked_cpu_s > 0
