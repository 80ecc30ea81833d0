"""Keras 3 ``model.fit`` with memsave: one line before ``compile``.

Any Keras 3 model (Sequential, functional or subclassed) keeps its code;
``memsave.keras.checkpointed`` makes ``fit`` compute the train step's
gradients with memsave instead of the tape::

    import memsave.keras

    model = memsave.keras.checkpointed(model, checkpoints="memory")
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, epochs=3)
    memsave.keras.restore(model)       # plain fit again

Callbacks, metrics, validation, ``jit_compile=True``, mixed precision
(``keras.mixed_precision.set_global_policy("mixed_float16")``, whose loss
scaling Keras' optimizer does as usual) and tf.distribute strategies work
as with plain ``fit``.

The script builds a deep MLP, trains it from the same weights with plain
``fit`` and with the checkpointed one, and prints each run's losses and the
CPU allocator's peak during the training epochs
(``tf.config.experimental.get_memory_info``; the first epoch traces the
step and is left out). The peak also holds what checkpointing cannot
remove: the float32 weights, Adam's two slots and the gradients (8 MiB at
the default size) and the input batches; with 16-bit activations
(``--policy``) these weigh twice as much against the activations, so the
ratio rises (measured at the defaults, plain / memsave MiB: float32 41 /
15, 0.37x; ``--jit-compile`` 72 / 15, 0.21x; mixed_float16 28 / 13, 0.46x;
mixed_bfloat16 21 / 13.5, 0.64x). Deeper models save more (``--layers``).
Runs in well under a minute on 2 CPU cores::

    python experiments/examples/keras_fit.py
    python experiments/examples/keras_fit.py --layers 64 --jit-compile
    python experiments/examples/keras_fit.py --policy mixed_bfloat16
"""

from __future__ import annotations

import argparse
import os

# Peaks are read from the CPU allocator's statistics, kept only with oneDNN
# on (off by default on CPUs without AVX-512): see experiments/allocator.py.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import memsave.keras  # noqa: E402

MiB = 1 << 20


def build_model(layers: int, width: int) -> keras.Model:
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(layers):
        h = keras.layers.Dense(width, activation="tanh")(h)
    # Keep the regression head in float32 under mixed precision.
    outputs = keras.layers.Dense(1, dtype="float32")(h)
    return keras.Model(inputs, outputs)


def train(model, x, y, args) -> tuple[list, float]:
    """Fit: one epoch to trace, then ``args.epochs`` measured ones. (losses, peak MiB)."""
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse",
                  jit_compile=args.jit_compile)
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / MiB
    return history.history["loss"], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="Dense/tanh layers (32)")
    parser.add_argument("--width", type=int, default=128, help="units per layer (128)")
    parser.add_argument("--batch", type=int, default=2048, help="batch size (2048)")
    parser.add_argument("--steps", type=int, default=4, help="batches per epoch (4)")
    parser.add_argument("--epochs", type=int, default=2, help="measured epochs (2)")
    parser.add_argument("--checkpoints", default="memory", help="memsave strategy ('memory')")
    parser.add_argument("--jit-compile", action="store_true", help="compile with XLA")
    parser.add_argument("--policy", default="float32",
                        help="Keras dtype policy: float32, mixed_float16, mixed_bfloat16")
    args = parser.parse_args()

    keras.mixed_precision.set_global_policy(args.policy)
    rs = np.random.RandomState(0)
    x = rs.randn(args.steps * args.batch, args.width).astype(np.float32)
    y = np.tanh(x[:, :1]).astype(np.float32)

    keras.utils.set_random_seed(0)
    model = build_model(args.layers, args.width)
    initial = model.get_weights()

    plain_losses, plain_peak = train(model, x, y, args)

    model.set_weights(initial)
    memsave.keras.checkpointed(model, checkpoints=args.checkpoints)
    ours_losses, ours_peak = train(model, x, y, args)

    print(f"{args.layers} layers x {args.width} units, batch {args.batch}, policy {args.policy}, "
          f"jit_compile={args.jit_compile}")
    print(f"plain fit   peak {plain_peak:7.1f} MiB  losses {np.round(plain_losses, 5).tolist()}")
    ratio = f"({ours_peak / plain_peak:.2f}x)" if plain_peak else ""
    print(f"memsave fit peak {ours_peak:7.1f} MiB  losses {np.round(ours_losses, 5).tolist()}  "
          f"{ratio}")


if __name__ == "__main__":
    main()
