"""Issue 10.1 check: 'speed' on keras.applications CNNs builds and runs.

For each model: (a) a custom tf.function step that takes memsave.gradients
(checkpoints='speed') and GradientTape's gradients on the same forward pass
and applies memsave's with SGD; (b) memsave.keras.checkpointed(model, 'speed')
+ fit for one step from the same initial weights as a plain fit step (SGD
without momentum, dropout off), comparing the weight updates.

Prints the relative error ||a - b|| / ||b|| over all variables together, and
the largest one per variable among the variables whose reference norm is
above SMALL_GRADIENT_FRACTION of the total: the bias of a conv followed by
batch normalization (training mode) has a gradient that is mathematically
zero, so its computed value (1e-8 of the total on ResNet50) is rounding noise
and its per-variable relative error means nothing.

    python experiments/real_model_cycle_check.py ResNet50 EfficientNetB0 --batch 8
"""

from __future__ import annotations

import argparse
import time

import keras
import numpy as np
import tensorflow as tf

import memsave
import memsave.keras

def _without_dropout(model):
    # Dropout draws new masks in each model: two fits would not compare.
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


BUILDERS = {
    "ResNet50": lambda: keras.applications.ResNet50(
        weights=None, input_shape=(64, 64, 3), classes=10),
    "EfficientNetB0": lambda: _without_dropout(keras.applications.EfficientNetB0(
        weights=None, input_shape=(64, 64, 3), classes=10)),
}


#: Variables whose reference gradient norm is below this fraction of the
#: total are left out of the per-variable maximum (see the module docstring).
SMALL_GRADIENT_FRACTION = 1e-4


def errors(ours, ref):
    """(relative error over all variables, max per-variable relative error)."""
    ours = [np.ravel(np.asarray(o, np.float64)) for o in ours]
    ref = [np.ravel(np.asarray(r, np.float64)) for r in ref]
    total = np.sqrt(sum(np.sum(r * r) for r in ref))
    diff = np.sqrt(sum(np.sum((o - r) ** 2) for o, r in zip(ours, ref)))
    per_var = [np.linalg.norm(o - r) / np.linalg.norm(r) for o, r in zip(ours, ref)
               if np.linalg.norm(r) > SMALL_GRADIENT_FRACTION * total]
    return diff / total, max(per_var)


def custom_loop(name, x, y, checkpoints):
    model = BUILDERS[name]()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    opt = keras.optimizers.SGD(0.01)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        ref = tape.gradient(loss, model.trainable_variables)
        ours = memsave.gradients(loss, model.trainable_variables, checkpoints=checkpoints)
        plan = memsave.plan(loss, model.trainable_variables, checkpoints=checkpoints)
        opt.apply_gradients(zip(ours, model.trainable_variables))
        return loss, ref, ours, tf.constant([len(plan.steps), plan.recomputed_ops])

    t0 = time.time()
    loss, ref, ours, built = step(x, y)
    print(f"{name}: plan has {built[0]} steps, {built[1]} recomputed ops", flush=True)
    total, per_var = errors([o.numpy() for o in ours], [r.numpy() for r in ref])
    print(f"{name} batch {len(x)} custom loop {checkpoints!r}: loss {float(loss):.4f}, "
          f"rel err vs GradientTape {total:.1e} (all variables), {per_var:.1e} "
          f"(max per variable) ({time.time() - t0:.0f} s)", flush=True)
    return total, per_var


def fit_step(name, x, y, checkpoints):
    weights = None
    deltas = []
    for use_memsave in (False, True):
        keras.utils.set_random_seed(0)
        model = BUILDERS[name]()
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        if use_memsave:
            memsave.keras.checkpointed(model, checkpoints)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss="sparse_categorical_crossentropy")
        hist = model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
        deltas.append([a - b for a, b in zip(model.get_weights(), weights)])
        loss = hist.history["loss"][0]
    # Trainable weights move by lr * gradient; BN moving statistics equally.
    total, per_var = errors(deltas[1], deltas[0])
    print(f"{name} batch {len(x)} fit {checkpoints!r}: loss {loss:.4f}, weight updates' "
          f"rel err vs plain fit {total:.1e} (all variables), {per_var:.1e} "
          f"(max per variable)", flush=True)
    return total, per_var


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=list(BUILDERS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--checkpoints", default="speed")
    args = parser.parse_args()
    rs = np.random.RandomState(0)
    x = rs.rand(args.batch, 64, 64, 3).astype(np.float32)
    y = rs.randint(0, 10, size=args.batch).astype(np.int32)
    for name in args.models:
        custom_loop(name, tf.constant(x), tf.constant(y), args.checkpoints)
        fit_step(name, x, y, args.checkpoints)


if __name__ == "__main__":
    main()
