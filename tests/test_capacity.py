"""memsave.keras.max_batch_size ("will it fit?") and the search behind it.

The search is tested on hand-made forecast curves with exact answers (and
its probe counts against bisection's); max_batch_size on small Keras
models against its contract, re-checked with memsave.keras.plan:
``padded(b) <= memory < padded(b + 1)``, ``padded`` being the forecast
times ``1 + margin``; its errors; and, in one slow test, the answers run
for one real fit step in fresh processes, whose allocator peak must be at
most the memory asked for.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import memsave.keras
from memsave.capacity import (
    FORECAST_MARGIN_CHECKPOINTED,
    FORECAST_MARGIN_PLAIN,
    MAX_BATCH_SIZE,
    CapacityError,
    Forecasts,
    NoBatchFitsError,
    _search,
    parse_bytes,
)
from memsave.errors import MemoryBudgetError, MemsaveError
from memsave.keras import KerasModelError

MiB = 2**20

#: The module-scoped model and answers are built once, on one worker (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("test_capacity")

# -- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    (4096, 4096), ("4096", 4096), ("1B", 1), ("8GiB", 8 * 2**30), ("8 gib", 8 * 2**30),
    ("512MiB", 512 * MiB), ("1.5KiB", 1536), ("2GB", 2 * 10**9), ("3MB", 3 * 10**6),
    ("1kb", 1000), ("1TiB", 2**40), (".5MiB", MiB // 2), (np.int64(4096), 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected and type(parse_bytes(text)) is int


@pytest.mark.parametrize("bad", ["", "GiB", "8XB", "8 GiB extra", "-1GiB", "1e3", 0, -5, "0",
                                 "0.1B", True, 2.5, None, np.int64(0), np.bool_(True)])
def test_parse_bytes_rejects(bad):
    with pytest.raises(CapacityError, match="memory=") as e:
        parse_bytes(bad, what="memory")
    assert isinstance(e.value, MemsaveError)
    assert repr(bad) in str(e.value)


# -- the search, on hand-made forecast curves ----------------------------------------------------


class Curve:
    """A forecast curve ``padded(b)`` that counts its probes (each would be a trace)."""

    def __init__(self, f):
        self.f = f
        self.probes: list[int] = []

    def __call__(self, b: int) -> float:
        assert 1 <= b <= MAX_BATCH_SIZE, b
        self.probes.append(b)
        return self.f(b)


def _exact(f, memory):
    """The largest b with f(b) <= memory, for a nondecreasing f (bisection, uncounted)."""
    if f(1) > memory:
        return 0
    lo, hi = 1, 2
    while f(hi) <= memory:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if f(mid) <= memory else (lo, mid)
    return lo


def _allocator(b, resident=50e6, per_sample=3e5, threshold=256 * 1024):
    """Resident bytes plus ten tensors per layer of 3 layers; each counted only above 256 KiB."""
    return resident + sum(per_sample * b * k / 30 for k in range(1, 31)
                          if per_sample * b * k / 30 >= threshold)


CURVES = {
    "affine": lambda b: 1e8 + 3.7e6 * b,
    "threshold": _allocator,
    "steps": lambda b: 1e6 * (1 + b // 64) * 64,   # flat stretches, as a strategy's choices
    "convex": lambda b: 1e6 + 1e3 * b * b,
}


@pytest.mark.parametrize("name", sorted(CURVES))
@pytest.mark.parametrize("memory", [2e8, 1e9, 1e11])
@pytest.mark.parametrize("start", [1, 32, 100_000])
def test_search_finds_the_largest_batch(name, memory, start):
    f = CURVES[name]
    curve = Curve(f)
    b = _search(curve, memory, start=start)
    assert b == _exact(f, memory)
    if b:
        assert f(b) <= memory < f(b + 1)
    # every probe is a trace: at most about twice what doubling then bisection spends
    # (about 2 log2(b)): growth at least doubles, and every second probe in the bracket
    # at least halves it
    assert len(curve.probes) <= 2 * 2 * math.ceil(math.log2(max(b, 2))) + 2, curve.probes
    assert len(set(curve.probes)) == len(curve.probes), "a batch was probed twice"


def test_search_on_an_affine_forecast_takes_few_probes():
    """Regula falsi closes an affine forecast's bracket in a probe or two past the growth."""
    f = CURVES["affine"]
    for memory in (5e8, 3e9, 4e10):
        curve = Curve(f)
        b = _search(curve, memory)
        assert b == _exact(f, memory)
        assert len(curve.probes) <= 6, curve.probes
        # bisection from 1 would spend about 2 log2(b) probes
        assert len(curve.probes) < 2 * math.log2(b)


def test_search_reuses_known_batches():
    f = CURVES["threshold"]
    first = Curve(f)
    b = _search(first, 1e9)
    again = Curve(f)
    assert _search(again, 1e9, known=first.probes) == b
    probed = [p for p in again.probes if p not in first.probes]
    assert probed == [], "known batches are free: nothing new to probe for the same memory"


def test_search_when_nothing_fits_and_when_everything_does():
    assert _search(Curve(lambda b: 10.0 * b + 5), 1) == 0
    curve = Curve(lambda b: 1.0)
    assert _search(curve, 1e9) == MAX_BATCH_SIZE
    assert len(curve.probes) < 12, "growth by up to GROWTH_LIMIT a probe reaches the cap soon"


def test_search_on_a_non_monotone_forecast_keeps_the_contract():
    f = lambda b: 1e6 * b + (5e8 if 300 <= b < 320 else 0)  # noqa: E731 - a bump
    for start in (1, 500):
        b = _search(Curve(f), 9e8, start=start)
        assert f(b) <= 9e8 < f(b + 1)


def test_search_treats_an_unmet_budget_as_not_fitting():
    f = lambda b: 1e6 * b if b < 700 else math.inf  # noqa: E731 - budget unmet from 700
    assert _search(Curve(f), 1e12) == 699


# -- max_batch_size on Keras models ----------------------------------------------------------


def _mlp(depth=12, width=256, compiled=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + [keras.layers.Dense(10)], name=f"mlp{depth}x{width}")
    if compiled:
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
    return model


def _sample(width=256):
    return np.zeros((1, width), np.float32), np.zeros((1,), np.int32)


@pytest.fixture(scope="module")
def mlp():
    return _mlp()


MEMORY = 64 * MiB


@pytest.fixture(scope="module")
def answers(mlp):
    """max_batch_size's answers for the MLP in MEMORY: {checkpoints: batch}."""
    x, y = _sample()
    return {c: memsave.keras.max_batch_size(mlp, x, y, memory=MEMORY, checkpoints=c)
            for c in (None, "memory")}


@pytest.mark.parametrize("checkpoints", [None, "memory"])
def test_answer_meets_the_contract(mlp, answers, checkpoints):
    """padded(b) <= memory < padded(b + 1), forecast anew by memsave.keras.plan."""
    b = answers[checkpoints]
    x, y = _sample()

    def padded(batch):
        p = memsave.keras.plan(mlp, x, y, checkpoints=checkpoints or "collection",
                               batch_size=batch)
        if checkpoints is None:
            return p.baseline_peak_bytes * (1 + FORECAST_MARGIN_PLAIN)
        margin = FORECAST_MARGIN_CHECKPOINTED if p.recomputed_ops else FORECAST_MARGIN_PLAIN
        return p.predicted_peak_bytes * (1 + margin)

    assert b > 100, "the tensors at this batch are well above the allocator's 256 KiB"
    assert padded(b) <= MEMORY < padded(b + 1)
    if checkpoints is not None:
        assert memsave.keras.plan(mlp, x, y, batch_size=b).recomputed_ops > 0, (
            "the memsave answer is for a checkpointed step")


def test_memsave_fits_a_larger_batch_than_plain(answers):
    assert answers["memory"] > 1.3 * answers[None], answers


def test_explicit_margin_is_the_contract(mlp):
    x, y = _sample()
    b = memsave.keras.max_batch_size(mlp, x, y, memory=MEMORY, checkpoints=None, margin=0)
    peak = lambda n: memsave.keras.plan(mlp, x, y, batch_size=n).baseline_peak_bytes  # noqa: E731
    assert peak(b) <= MEMORY < peak(b + 1)


def test_memory_as_a_size_string(mlp, answers):
    x, y = _sample()
    assert memsave.keras.max_batch_size(mlp, x, y, memory="64MiB", checkpoints=None) == answers[None]


def test_a_dataset_is_searched_from_its_batch_size(mlp, answers):
    """A tf.data.Dataset as x stands for its batches: the search starts at
    its batch size (1 here, as the sample's) and gives the same answer."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(_sample()).batch(1)
    assert memsave.keras.max_batch_size(mlp, dataset, memory=MEMORY, checkpoints=None) == answers[None]


def test_forecasts_share_traces():
    """Both answers from one Forecasts cost fewer traces than two searches."""
    model, (x, y) = _mlp(depth=4), _sample()
    both = Forecasts(model, x, y, checkpoints="memory")
    both.max_batch_size(MEMORY // 4, plain=True)
    plain_traces = both.traces
    both.max_batch_size(MEMORY // 4, plain=False)
    alone = Forecasts(model, x, y, checkpoints="memory")
    alone.max_batch_size(MEMORY // 4, plain=False)
    assert both.traces - plain_traces < alone.traces, (both.traces, plain_traces, alone.traces)


def test_memory_budget_is_passed_through(mlp, answers):
    """memory_budget reaches memsave.plan through memsave.keras.plan: a budgeted plan at each batch."""
    x, y = _sample()
    p = memsave.keras.plan(mlp, x, y, batch_size=4096, memory_budget=0.6)
    assert p.budget_bytes is not None and p.solver is not None
    with pytest.raises(NoBatchFitsError, match="memory_budget=0.6 is below"):
        # at batch 1 every tensor is under the allocator's threshold: nothing to save
        memsave.keras.max_batch_size(mlp, x, y, memory=MEMORY, memory_budget=0.6)
    # A budget of 0.6 first fits from a batch of about 4096 (forecast 41.5
    # MiB there, 66 MiB with the checkpointed margin): search in 96 MiB.
    memory = 96 * MiB
    x, y = np.zeros((4096, 256), np.float32), np.zeros((4096,), np.int32)
    b = memsave.keras.max_batch_size(mlp, x, y, memory=memory, memory_budget=0.6)
    budgeted = memsave.keras.plan(mlp, x, y, batch_size=b, memory_budget=0.6)
    assert budgeted.budget_bytes is not None
    assert budgeted.predicted_peak_bytes * (1 + FORECAST_MARGIN_CHECKPOINTED) <= memory
    over = memsave.keras.plan(mlp, x, y, batch_size=b + 1, memory_budget=0.6)
    assert over.predicted_peak_bytes * (1 + FORECAST_MARGIN_CHECKPOINTED) > memory


# -- errors ----------------------------------------------------------------------------------


def test_not_compiled():
    x, y = _sample()
    with pytest.raises(KerasModelError, match="not compiled.*model.compile"):
        memsave.keras.max_batch_size(_mlp(compiled=False), x, y, memory="1GiB")


def test_not_a_model():
    x, y = _sample()
    with pytest.raises(KerasModelError, match="keras.Model"):
        memsave.keras.max_batch_size(object(), x, y, memory="1GiB")


@pytest.mark.parametrize("memory", ["lots", "8XB", 0, -1, "0GiB", 1.5e9])
def test_bad_memory(mlp, memory):
    x, y = _sample()
    with pytest.raises(CapacityError, match=r"memory=") as e:
        memsave.keras.max_batch_size(mlp, x, y, memory=memory)
    assert repr(memory) in str(e.value)


def test_no_batch_fits_says_what_batch_1_needs(mlp):
    x, y = _sample()
    with pytest.raises(NoBatchFitsError, match=r"batch of 1.*forecast to peak at") as e:
        memsave.keras.max_batch_size(mlp, x, y, memory="4MiB", checkpoints=None)
    p = memsave.keras.plan(mlp, x, y, batch_size=1)
    assert e.value.batch_1_peak_bytes == p.baseline_peak_bytes
    assert f"{p.baseline_peak_bytes:,} bytes" in str(e.value)
    assert e.value.memory_bytes == 4 * MiB


def test_no_batch_fits_where_the_weights_alone_do_not():
    """Every buffer of this model at small batches is under the CPU
    allocator's 256 KiB, so its forecast peak there is 0 bytes: memory=1
    byte was answered with batch 511. The weights must fit too, every
    buffer counted."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((128,))]
                             + [keras.layers.Dense(128, activation="relu") for _ in range(16)]
                             + [keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((1, 128), np.float32), np.zeros((1, 1), np.float32)
    weights = sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    for checkpoints in (None, "memory"):
        with pytest.raises(NoBatchFitsError, match="the weights and the batch alone hold") as e:
            memsave.keras.max_batch_size(model, x, y, memory=weights // 2, checkpoints=checkpoints)
        # The allocator's forecast counts none of them (0 bytes); what batch 1
        # needs is the weights and the batch, every buffer counted (the CLI
        # printed "none (1: 0.0 MiB)").
        assert e.value.batch_1_peak_bytes >= weights
    assert memsave.keras.max_batch_size(model, x, y, memory="64MiB", checkpoints=None) > 511


def test_x_without_a_batch_dimension(mlp):
    with pytest.raises(CapacityError, match="no leading batch dimension"):
        memsave.keras.max_batch_size(mlp, np.float32(1.0), np.zeros((1,), np.int32), memory="1GiB")


def test_budget_with_plain_fit(mlp):
    x, y = _sample()
    with pytest.raises(MemoryBudgetError, match="checkpoints=None"):
        memsave.keras.max_batch_size(mlp, x, y, memory="1GiB", checkpoints=None, memory_budget=0.5)


@pytest.mark.parametrize("margin", [-0.1, "10%", True, float("inf"), float("nan")])
def test_bad_margin(mlp, margin):
    x, y = _sample()
    with pytest.raises(CapacityError, match="margin="):
        memsave.keras.max_batch_size(mlp, x, y, memory="1GiB", margin=margin)


# -- the answers, run --------------------------------------------------------------------------

def measure_fit_step(checkpoints: str | None, batch: int) -> int:
    """The allocator peak of one real fit step of _mlp() at ``batch`` (run in a fresh process).

    A warm-up fit of one step first (tracing, the optimizer's slots), then a
    second whose callback resets the allocator's statistics when the batch
    begins and reads the peak when it ends: the step, its data iterator
    included, as a user's ``fit`` runs it.
    """
    import tensorflow as tf

    model = _mlp()
    if checkpoints is not None:
        memsave.keras.checkpointed(model, checkpoints)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 256)).astype(np.float32)
    y = rng.integers(0, 10, size=(batch,)).astype(np.int32)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    class Peak(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, batch, logs=None):
            self.peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]

    peak = Peak()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[peak])
    return peak.peak


@pytest.mark.slow
def test_answers_fit_when_run(fresh, answers):
    """Each answer, run for one real fit step in a fresh process, peaks at most at the memory.

    A process each, as a user's would be: the cap is absolute, and a pool
    the allocator grew for another model may count the same step smaller.
    """
    peaks = {c: fresh.call(measure_fit_step, c, b) for c, b in answers.items()}
    for checkpoints, peak in peaks.items():
        assert peak <= MEMORY, (checkpoints, answers[checkpoints], peak / MiB)
    # and the answers are not so cautious that the memory goes mostly unused
    assert min(peaks.values()) > MEMORY / 2, {k: v / MiB for k, v in peaks.items()}
