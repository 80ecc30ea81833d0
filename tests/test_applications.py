"""Real Keras models under memsave: keras.applications CNNs and a Transformer.

Models nobody here wrote (``weights=None``, 32x32 inputs, 10 classes, every
``Dropout`` rate set to 0 so that two gradient computations see one mask):
``keras.applications.ResNet50``, ``MobileNetV2``, ``EfficientNetB0``, and a
two-block Transformer encoder built from ``keras.layers.MultiHeadAttention``.

Differential, two drivers:

* custom loop: one ``tf.function`` (with or without ``jit_compile``) runs
  the forward pass under a ``tf.GradientTape``, then asks both memsave
  (``memsave.plan(loss, weights, checkpoints=...)``, then
  ``memsave.gradients`` given that Plan: planned once, and the plan the test
  reads is the one built) and the tape for the gradients of the same loss:
  one forward pass, one call, so the values are compared on identical
  activations. (The fit cases plan inside ``memsave.gradients``.) For
  'collection' the step adds the outputs of chosen layers
  (:data:`CHECKPOINT_LAYERS`) to the ``'checkpoints'`` collection. The
  plan must recompute (steps > 0).
* ``fit``: one step of ``model.fit`` after ``memsave.keras.checkpointed``
  (for 'collection': the layer names of :data:`CHECKPOINT_LAYERS`) and one
  step of plain ``fit`` on a model with the same weights; an optimizer that
  records the gradients it is given (:class:`RecordingSGD`) gives both
  gradient lists. memsave must log that it recomputes (no fallback).

Tolerance: see GRADIENT_RTOL.

Matrix (each axis covered, not the product; 11 cases): every model under
'memory' and 'speed', whose plans depend on the graph; 'collection' (the
tensors the user tagged, whatever the graph) on a CNN with ``fit`` and on
the Transformer; every model with the custom loop, two CNNs and the
Transformer with ``fit``;
``jit_compile`` with every strategy and both drivers, on the two cheaper
models (XLA compiles of the ResNet50/EfficientNetB0 training step take
minutes on a 2-core CPU; experiments/applications.py covers them):

======================  ===================  ===========  ===========
model                   memory               speed        collection
======================  ===================  ===========  ===========
ResNet50                loop                 fit
MobileNetV2             loop, xla            loop         fit
EfficientNetB0          loop                 loop
Transformer             fit; loop, xla       loop, xla    fit, xla
======================  ===================  ===========  ===========

(ResNet50 and EfficientNetB0 under 'collection' in the custom loop, 13
and 14 s of the full suite's 10 minutes, were dropped: the rewrite of a
tagged plan is the rewrite 'memory''s plans exercise on the same models.
EfficientNetB0 'speed' runs in the custom loop, not ``fit``: 13 s instead
of 25, and ``fit``'s own path is the same for every model.)

ResNet50 and EfficientNetB0 under 'speed' are the graphs issue 10 found
cyclic ("N nodes in a cycle"); XFAIL lists cases that fail today, as
xfail(strict=True), and is empty since the fix of branch cycle was merged.

Memory: ResNet50 (64x64, batch 8, activations of 0.5-2 MiB) and the
Transformer (sequence 256, width 64, batch 4: 4 MiB attention maps) in a
custom loop, 'memory' and tf.gradients each in a fresh process
(tests/fresh.py): the allocator's peak of one step must
drop below MEMORY_MAX_RATIO of plain tf.gradients'.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsave
import memsave.keras
from fresh import step_peaks

NUM_CLASSES = 10
IMAGE_SIZE, BATCH = 32, 4
SEQ, D_MODEL, HEADS, FFN, BLOCKS = 16, 32, 4, 64, 2

# Tape and memsave in one graph compute the forward once and the backward
# from the same values: on MobileNetV2 (64x64, batch 4) tape, tf.gradients
# and memsave 'memory' in one tf.function gave bit-identical gradients (the
# recomputed kernels are the originals'). Separately optimized graphs and
# XLA differ more, because batch norm over a few positions amplifies
# rounding: experiments/applications.py measured, at 64x64 batch 4, plain
# tf.gradients vs the tape under XLA at 3.6e-4 on ResNet50 and memsave vs
# the tape at up to 4.1e-4 (ResNet50 'speed'). Here, at 32x32 batch 4, in
# one graph: EfficientNetB0 'memory' differed by 1.10e-4 (block1a_project_bn
# beta: Grappler/oneDNN fuse a copy differently from its original), the other
# 12 cases run passed at 1e-4. 1e-3 covers these measured 1e-4..4e-4
# rounding differences; a wrong mask or a missing gradient part is of order 1.
GRADIENT_RTOL = 1e-3
#: Gradients whose largest entry is below this fraction of the largest entry
#: of all gradients (a batch norm's beta followed by another batch norm:
#: zero but for rounding) are judged against that floor, not themselves.
ZERO_GRADIENT_FLOOR = 1e-3

# -- models --------------------------------------------------------------------


def _application(name):
    def build():
        model = getattr(keras.applications, name)(
            weights=None, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3), classes=NUM_CLASSES,
            classifier_activation=None,
        )
        for layer in model.layers:
            if isinstance(layer, keras.layers.Dropout):
                layer.rate = 0.0
        return model

    return build


def transformer(seq=SEQ, d_model=D_MODEL, heads=HEADS, ffn=FFN, blocks=BLOCKS):
    """Post-norm Transformer encoder classifier from keras.layers."""
    inputs = keras.Input((seq, d_model))
    h = keras.layers.Dense(d_model, name="embed")(inputs)
    for i in range(blocks):
        a = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f"mha_{i}")(h, h)
        h = keras.layers.LayerNormalization(name=f"ln_attn_{i}")(h + a)
        f = keras.layers.Dense(ffn, activation="gelu", name=f"ffn_in_{i}")(h)
        f = keras.layers.Dense(d_model, name=f"ffn_out_{i}")(f)
        h = keras.layers.LayerNormalization(name=f"ln_out_{i}")(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES, name="head")(h),
                       name="transformer")


MODELS = {
    "ResNet50": _application("ResNet50"),
    "MobileNetV2": _application("MobileNetV2"),
    "EfficientNetB0": _application("EfficientNetB0"),
    "Transformer": transformer,
}

#: Layers whose outputs are the 'collection' checkpoints: block ends, about
#: sqrt(number of blocks) of them, spread over the depth.
CHECKPOINT_LAYERS = {
    "MobileNetV2": ["block_2_add", "block_5_add", "block_9_add", "block_12_add"],
    "Transformer": ["ln_out_0"],
}


def _data(model_name, batch=BATCH):
    rng = np.random.RandomState(0)
    if model_name == "Transformer":
        x = rng.standard_normal((batch, SEQ, D_MODEL)).astype(np.float32)
    else:
        x = rng.standard_normal((batch, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    y = rng.randint(0, NUM_CLASSES, size=(batch,)).astype(np.int32)
    return x, y


def _build(model_name):
    keras.utils.set_random_seed(0)
    return MODELS[model_name]()


def assert_gradients_equal(ours, ref, names):
    assert len(ours) == len(ref) and all(g is not None for g in ours)
    top = max(float(np.max(np.abs(r))) for r in ref)
    assert top > 0, "every reference gradient is zero: the case tests nothing"
    for g, r, name in zip(ours, ref, names):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.all(np.isfinite(r)), f"reference gradient of {name} is not finite"
        scale = max(float(np.max(np.abs(r))), ZERO_GRADIENT_FLOOR * top)
        err = float(np.max(np.abs(g - r))) / scale
        assert err <= GRADIENT_RTOL, f"{name}: max|memsave - tape| = {err:.2e} of {scale:.3g}"


# -- the matrix ----------------------------------------------------------------

#: At 32x32 and batch 4 the weights' gradients (alive to the end of the step)
#: make the peak, and the simulator rightly forecasts that checkpointing saves
#: too little: 'memory' and 'speed' would fall back to tf.gradients. These
#: tests are about the rewrite's gradients on real graphs, so they keep any
#: plan; the memory tests below use sizes where the saving is real.
_KEEP_ANY_PLAN = {"min_saving_fraction": 0.0}
_KEEP_ANY_PLAN_STRATEGIES = ("memory", "speed")

LOOP, FIT = "loop", "fit"

CASES = [
    # model, strategy, driver, jit_compile
    ("ResNet50", "memory", LOOP, False),
    ("ResNet50", "speed", FIT, False),
    ("MobileNetV2", "memory", LOOP, True),
    ("MobileNetV2", "speed", LOOP, False),
    ("MobileNetV2", "collection", FIT, False),
    ("EfficientNetB0", "memory", LOOP, False),
    ("EfficientNetB0", "speed", LOOP, False),
    ("Transformer", "memory", FIT, False),
    ("Transformer", "memory", LOOP, True),
    ("Transformer", "speed", LOOP, True),
    ("Transformer", "collection", FIT, True),
]

#: Cases that fail today, with the reason; strict, so they flip once fixed.
#: Empty since branch cycle (6fa74bc) was merged: ResNet50 and EfficientNetB0
#: 'speed' failed with "N nodes in a cycle" before it (issue 10, item 1).
XFAIL: dict = {}

#: The cases of the fast tier; the others (the CNNs' graphs take 10-60 s of
#: CPU each to trace, rewrite and optimize, XLA longer) are marked slow.
FAST = {("Transformer", "memory", FIT, False)}


def _params():
    for model, strategy, driver, jit in CASES:
        marks = [] if (model, strategy, driver, jit) in FAST else [pytest.mark.slow]
        if (model, strategy, driver, jit) in XFAIL:
            marks.append(pytest.mark.xfail(reason=XFAIL[model, strategy, driver, jit],
                                           strict=True))
        jit_id = "xla" if jit else "graph"
        yield pytest.param(model, strategy, driver, jit, marks=marks,
                           id=f"{model}-{strategy}-{driver}-{jit_id}")


@pytest.mark.parametrize("model_name, strategy, driver, jit", list(_params()))
def test_gradients_match_gradient_tape(model_name, strategy, driver, jit, caplog):
    if driver == LOOP:
        ours, ref, names, plan = _custom_loop_gradients(model_name, strategy, jit)
        assert len(plan.steps) > 0 and plan.recomputed_ops > 0, plan.summary()
    else:
        with caplog.at_level(logging.INFO, logger="memsave"):
            ours, ref, names = _fit_gradients(model_name, strategy, jit)
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("memsave")]
        assert any("recomputing" in m for m in messages), messages
        assert not any("nothing to checkpoint" in m for m in messages), messages
    assert_gradients_equal(ours, ref, names)


def _custom_loop_gradients(model_name, strategy, jit):
    """memsave's and the tape's gradients of one forward pass, one tf.function."""
    model = _build(model_name)
    x, y = _data(model_name)
    tagged = [model.get_layer(n) for n in CHECKPOINT_LAYERS[model_name]] \
        if strategy == "collection" else []
    net = keras.Model(model.inputs, [model.output] + [l.output for l in tagged])
    weights = model.trainable_variables
    plans = []

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            outs = net(x, training=True)
            logits, *mid = outs if isinstance(outs, (list, tuple)) else [outs]
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        for t in mid:
            tf.compat.v1.add_to_collection("checkpoints", t)
        opts = _KEEP_ANY_PLAN if strategy in _KEEP_ANY_PLAN_STRATEGIES else None
        plans.append(memsave.plan(loss, weights, checkpoints=strategy, strategy_options=opts))
        ours = memsave.gradients(loss, weights, checkpoints=plans[-1])
        return ours, tape.gradient(loss, weights)

    ours, ref = step(tf.constant(x), tf.constant(y))
    return ([g.numpy() for g in ours], [g.numpy() for g in ref],
            [w.path for w in weights], plans[-1])


class RecordingSGD(keras.optimizers.SGD):
    """SGD that stores the gradients it is given in variables of its own."""

    def __init__(self, weights, **kwargs):
        super().__init__(**kwargs)
        self.recorded = {w.path: tf.Variable(tf.zeros(w.shape, w.dtype)) for w in weights}

    def apply_gradients(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        for g, w in grads_and_vars:
            self.recorded[w.path].assign(g)
        return super().apply_gradients(grads_and_vars)


def _fit_gradients(model_name, strategy, jit):
    """Gradients of one fit step through memsave and one of plain fit."""
    x, y = _data(model_name)
    grads = []
    for with_memsave in (True, False):
        model = _build(model_name)
        if with_memsave:
            checkpoints = CHECKPOINT_LAYERS[model_name] if strategy == "collection" else strategy
            opts = _KEEP_ANY_PLAN if strategy in _KEEP_ANY_PLAN_STRATEGIES else None
            memsave.keras.checkpointed(model, checkpoints, strategy_options=opts)
        opt = RecordingSGD(model.trainable_variables, learning_rate=0.0)
        model.compile(optimizer=opt, jit_compile=jit,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        names = [w.path for w in model.trainable_variables]
        grads.append([opt.recorded[n].numpy() for n in names])
    return grads[0], grads[1], names


# -- memory --------------------------------------------------------------------

#: name -> (model builder arguments, batch): activations well above the
#: allocator's 256 KiB threshold.
MEMORY_CASES = {
    # 64x64 input, batch 8: stage outputs of 0.5-2 MiB, weights ~94 MiB
    "ResNet50": dict(size=64, batch=8),
    # 4 heads x 256 x 256 attention maps of 4 MiB per block at batch 4
    "Transformer": dict(seq=256, batch=4),
}

#: 'memory' must keep the step peak at or below this fraction of plain
#: tf.gradients' (weights and batch included; peaks vary by a few MiB
#: between processes). Measured once each, fresh processes, 2026-11-30:
#: ResNet50 147.1 / 169.8 MiB = 0.87 (the ~94 MiB of weights, their
#: gradients and the update are in both peaks); Transformer 12.0 / 17.0 MiB
#: = 0.71. A memsave that saves nothing measures 1.0.
MEMORY_MAX_RATIO = {"ResNet50": 0.92, "Transformer": 0.8}


def measure_step_peak(model_name: str, method: str) -> int:
    """The allocator peak of one custom-loop step with ``method`` ('memory' or
    'tf.gradients'), run in a fresh process (tests/fresh.py).

    Each method has a process of its own: measured one after the other in
    one process, the first method's traced step left ~12 MiB allocated
    (ResNet50) that the second's peak would count.
    """
    case = MEMORY_CASES[model_name]
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    if model_name == "Transformer":
        model = transformer(seq=case["seq"])
        x = rng.standard_normal((case["batch"], case["seq"], D_MODEL)).astype(np.float32)
    else:
        model = keras.applications.ResNet50(
            weights=None, input_shape=(case["size"], case["size"], 3), classes=NUM_CLASSES,
            classifier_activation=None)
        x = rng.standard_normal((case["batch"], case["size"], case["size"], 3)).astype(np.float32)
    y = rng.randint(0, NUM_CLASSES, size=(len(x),)).astype(np.int32)
    x, y = tf.constant(x), tf.constant(y)
    weights = model.trainable_variables

    @tf.function
    def step(x, y):
        logits = model(x, training=True)
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        if method == "tf.gradients":
            grads = tf.gradients(loss, weights)
        else:
            grads = memsave.gradients(loss, weights, checkpoints=method)
        for w, g in zip(weights, grads):
            w.assign_sub(1e-3 * g)
        return loss

    step(x, y)  # warm-up: trace, optimize, allocate
    return step_peaks(lambda: step(x, y), 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", list(MEMORY_CASES))
def test_memory_strategy_cuts_the_step_peak(fresh, model_name):
    plain = fresh.call(measure_step_peak, model_name, "tf.gradients")
    ours = fresh.call(measure_step_peak, model_name, "memory")
    assert ours <= MEMORY_MAX_RATIO[model_name] * plain, (
        f"{model_name} 'memory': peak {ours / 2**20:.1f} MiB, tf.gradients "
        f"{plain / 2**20:.1f} MiB (ratio {ours / plain:.2f}, at most "
        f"{MEMORY_MAX_RATIO[model_name]})"
    )
