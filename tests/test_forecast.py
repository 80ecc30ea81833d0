"""memsave forecasts a step's real allocator peak before running it (issue 8).

For a few small models of experiments/forecast.py's registry (tensors of
0.5-2 MiB, above the CPU allocator's 256 KiB counting threshold), plain
``tf.gradients`` (Keras: plain ``fit``) and memsave ``'memory'``, the
forecast (``memsave.plan(...).baseline_peak_bytes`` /
``.predicted_peak_bytes``; Keras: ``memsave.keras.plan``) must be within
MAX_ERROR of the allocator peak of one step measured in a fresh process
(the benchmark's own measurement: warm-up call, reset_memory_stats, one
call, get_memory_info('CPU:0')['peak'], median of REPEATS calls; both
methods in one process, each with a graph of its own).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _load_benchmark():
    """experiments/forecast.py, loaded from its file (experiments/ is not a package)."""
    name = "memsave_forecast_benchmark"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / "forecast.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


forecast = _load_benchmark()

#: issue 8: |predicted - measured| / measured on every model.
MAX_ERROR = forecast.MAX_ERROR

#: Measured calls in the measuring process; their median is the measured peak
#: (a single call's peak moves by a MiB or two with the order of ready ops).
REPEATS = 3

CASES = [
    ("zoo_mlp", forecast.FUNCTION),  # 16 tanh layers, [1024, 256] float32
    ("zoo_mlp", forecast.SESSION),
    ("zoo_cnn", forecast.FUNCTION),  # conv/relu/pool, [64, 32, 32, 8] float32
    ("keras_mlp", forecast.FIT),  # Sequential, 6 x Dense(512), batch 1024, adam
    # a tf.while_loop RNN: while_v2 accumulators, one buffer per trip (was -37%)
    ("zoo_rnn_while", forecast.FUNCTION),
    # a tf.function called 4 times: what its gradient keeps of its insides (was -26%)
    ("zoo_nested_function", forecast.FUNCTION),
]
METHODS = (forecast.PLAIN, "memory")


def measure(model: str, mode: str) -> dict:
    """{method: result} for METHODS, measured one after the other (in a fresh process)."""
    return forecast.measure(model, mode, list(METHODS), repeats=REPEATS)


def measure_one(model: str, mode: str, method: str) -> dict:
    """The result of one method, measured alone (in a fresh process)."""
    return forecast.measure(model, mode, [method], repeats=REPEATS)[method]


def _measured(fresh, model: str, mode: str, method: str) -> int:
    result = fresh.call(measure, model, mode, timeout_s=900)[method]
    if "error" in result:
        pytest.fail(f"measuring {model} {mode} {method} failed: {result['error']}")
    return result["peak_bytes"]


@functools.lru_cache(maxsize=None)
def _predicted(model: str, mode: str) -> dict:
    return forecast.predict(model, mode, list(METHODS))


@pytest.mark.parametrize("model, mode", CASES)
def test_every_case_has_a_forecast_that_checkpointing_lowers(model, mode):
    # The forecasts alone (no measurement): each is a peak, not an error, of
    # a step big enough for the allocator to count, and memsave's plan is
    # forecast below plain's (else the comparison with the measured peak
    # would test the fallback to tf.gradients).
    predicted = _predicted(model, mode)
    for method in METHODS:
        assert not isinstance(predicted[method], dict), f"{model} {mode} {method}: {predicted}"
        assert predicted[method] > 4 * MiB, (model, mode, method, predicted)
    assert predicted["memory"] < predicted[forecast.PLAIN], (model, mode, predicted)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model, mode", CASES)
def test_forecast_is_close_to_the_measured_peak(fresh, model, mode, method):
    predicted = _predicted(model, mode)[method]
    assert not isinstance(predicted, dict), f"{model} {mode} {method}: {predicted['error']}"
    measured = _measured(fresh, model, mode, method)
    error = (predicted - measured) / measured
    assert abs(error) <= MAX_ERROR, (
        f"{model} ({mode}, {method}): forecast {predicted / MiB:.1f} MiB, measured "
        f"{measured / MiB:.1f} MiB: {100 * error:+.1f}% (allowed +-{100 * MAX_ERROR:.0f}%)"
    )


@pytest.mark.slow
def test_the_models_are_big_enough_for_the_allocator_to_count(fresh):
    # Every case's step must hold far more than the 256 KiB below which the
    # CPU allocator counts nothing, or the comparison would measure noise
    # (the smallest, zoo_cnn, measures 8-9 MiB).
    for model, mode in CASES:
        assert _measured(fresh, model, mode, forecast.PLAIN) > 4 * MiB, (model, mode)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["memory", "speed"])
def test_checkpointed_dense_layers_on_a_sequence_are_forecast(fresh, method):
    # Dense layers on a sequence written ``h @ w`` (a broadcast BatchMatMulV2,
    # whose weight gradient is a 32 MiB product here): a recompute step's
    # first weight product ran beside the previous step's, both alive
    # (measured -20% under 'memory', -27% under 'speed'; now within 1.2%).
    # Checkpointed plans only: plain tf.gradients' own executor sometimes
    # runs two of its products at once too (97-125 MiB against a forecast
    # of 93.5), an order memsave does not set.
    model, mode = "zoo_seq_dense", forecast.FUNCTION
    predicted = forecast.predict(model, mode, [method])[method]
    assert not isinstance(predicted, dict), predicted
    result = fresh.call(measure_one, model, mode, method, timeout_s=900)
    assert "error" not in result, result
    error = (predicted - result["peak_bytes"]) / result["peak_bytes"]
    assert abs(error) <= MAX_ERROR, (method, predicted / MiB, result["peak_bytes"] / MiB)
