"""The three models of the memory/speed study, from raw TF ops.

Each model is a :class:`Model`: deterministic numpy initial weights for a
given size, a synthetic batch, and a ``loss(params, x, y, arch)`` that
builds the forward pass. The :class:`Arch` hooks are how gradient methods
that need the model's cooperation get it, without the model knowing the
methods:

- ``arch.chain(fns, h, group)`` runs a list of blocks ``h -> h``; under
  ``tf.recompute_grad`` it wraps each run of ``group`` consecutive blocks in
  one recomputed function (the hand-made segments a user would write);
- ``arch.tag(t)`` marks a tensor a user would tag for
  ``checkpoints='collection'``.

Models:

- ``resnet``: the CIFAR ResNet (He et al. 2016): 3 stages of ``n`` basic
  blocks (conv-BN-ReLU-conv-BN + shortcut, then ReLU), 16/32/64 channels,
  depth 6n+2 (n=18 is ResNet-110). Every block output is tagged; recompute
  groups are round(sqrt(3n)) consecutive blocks.
- ``mlp``: a chain of ``n`` dense ``tanh(h @ w)`` layers and a softmax
  head. Every round(sqrt(n))-th layer output is tagged (tagging every layer
  keeps everything); recompute groups are the same round(sqrt(n)) layers.
- ``unet``: a U-Net-like encoder/decoder with long skips and ``n``
  conv-BN-ReLU layers per stack, 4 levels (16/32/64/128 channels at 32, 16,
  8, 4 pixels). The skip of each level is taken *before* that level's
  encoder stack and added *after* the decoder stack of that level, so every
  layer between the stem and the final sum is bypassed by some skip: the
  only articulation points are the stem's three tensors and the small head.
  Stack outputs are tagged; each stack is one recompute group.

All losses are the mean softmax cross-entropy over 10 classes; batch norm
runs in training mode without moving averages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import tensorflow as tf

CHECKPOINT_COLLECTION = "checkpoints"
NUM_CLASSES = 10


class Arch:
    """Plain forward pass: blocks run in order, nothing tagged."""

    def chain(self, fns: list[Callable], h: tf.Tensor, group: int) -> tf.Tensor:
        for f in fns:
            h = f(h)
        return h

    def tag(self, t: tf.Tensor) -> tf.Tensor:
        return t


class TaggingArch(Arch):
    """Adds tagged tensors to the 'checkpoints' collection of the graph being traced."""

    def tag(self, t: tf.Tensor) -> tf.Tensor:
        tf.compat.v1.add_to_collection(CHECKPOINT_COLLECTION, t)
        return t


class RecomputeArch(Arch):
    """Wraps each run of ``group`` consecutive blocks in ``tf.recompute_grad``.

    The blocks read their weights from the enclosing Python scope (captured
    ``tf.Variable``s), which is how tf.recompute_grad expects them: its
    gradient function receives the variables the block read and returns
    their gradients, so a GradientTape over the whole step sees them.
    """

    def chain(self, fns: list[Callable], h: tf.Tensor, group: int) -> tf.Tensor:
        for start in range(0, len(fns), group):
            seg = fns[start:start + group]

            def run(h, seg=seg):
                for f in seg:
                    h = f(h)
                return h

            h = tf.recompute_grad(run)(h)
        return h


def sqrt_group(n: int) -> int:
    return max(1, round(math.sqrt(n)))


# -- shared layers ----------------------------------------------------------------------


def _conv(x, w, stride=1):
    return tf.nn.conv2d(x, w, strides=stride, padding="SAME")


def _bn(x, gamma, beta):
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, epsilon=1e-5, is_training=True)
    return y


def _xent(logits, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


class _Init:
    """Deterministic He-normal weights, in creation order."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}

    def conv(self, name, k, c_in, c_out):
        std = math.sqrt(2.0 / (k * k * c_in))
        self.params[name] = self.rng.normal(0.0, std, (k, k, c_in, c_out)).astype(np.float32)

    def bn(self, name, c):
        self.params[name + "/gamma"] = np.ones(c, np.float32)
        self.params[name + "/beta"] = np.zeros(c, np.float32)

    def dense(self, name, c_in, c_out, gain=1.0):
        std = gain / math.sqrt(c_in)
        self.params[name] = self.rng.normal(0.0, std, (c_in, c_out)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    size_name: str  # what ``size`` counts, e.g. "blocks/stage"
    depth: Callable[[int], int]  # weighted layers at a size
    label: Callable[[int], str]  # e.g. "ResNet-110"
    init: Callable[[int, int], dict[str, np.ndarray]]  # (size, seed) -> params
    batch: Callable[[int, int], tuple[np.ndarray, np.ndarray]]  # (batch, seed) -> x, y
    loss: Callable  # (size, params, x, y, arch) -> scalar
    # How the study sweeps it (experiments/registry.py reads these):
    title: str = ""  # plot and table title, ``{b}`` is the batch size
    sizes: tuple[int, ...] = ()  # default sweep of ``size``
    batch_size: int = 32  # default batch
    size_flag: str = ""  # the study's command-line flag for the sweep, e.g. "--unet-convs"
    size_help: str = ""


# -- ResNet -----------------------------------------------------------------------------

RESNET_WIDTHS = (16, 32, 64)


def resnet_init(n: int, seed: int) -> dict[str, np.ndarray]:
    p = _Init(seed)
    p.conv("stem/conv", 3, 3, RESNET_WIDTHS[0])
    p.bn("stem/bn", RESNET_WIDTHS[0])
    c_in = RESNET_WIDTHS[0]
    for s, width in enumerate(RESNET_WIDTHS):
        for b in range(n):
            pre = f"s{s}b{b}"
            p.conv(pre + "/conv1", 3, c_in, width)
            p.bn(pre + "/bn1", width)
            p.conv(pre + "/conv2", 3, width, width)
            p.bn(pre + "/bn2", width)
            if c_in != width:
                p.conv(pre + "/proj", 1, c_in, width)
                p.bn(pre + "/proj_bn", width)
            c_in = width
    p.dense("head/w", c_in, NUM_CLASSES)
    p.params["head/b"] = np.zeros(NUM_CLASSES, np.float32)
    return p.params


def resnet_loss(n, p, x, y, arch: Arch):
    h = tf.nn.relu(_bn(_conv(x, p["stem/conv"]), p["stem/bn/gamma"], p["stem/bn/beta"]))
    arch.tag(h)
    blocks = []
    c_in = RESNET_WIDTHS[0]
    for s, width in enumerate(RESNET_WIDTHS):
        for b in range(n):
            pre = f"s{s}b{b}"
            stride = 2 if (s > 0 and b == 0) else 1
            proj = c_in != width

            def block(h, pre=pre, stride=stride, proj=proj):
                r = _conv(h, p[pre + "/conv1"], stride)
                r = tf.nn.relu(_bn(r, p[pre + "/bn1/gamma"], p[pre + "/bn1/beta"]))
                r = _bn(_conv(r, p[pre + "/conv2"]), p[pre + "/bn2/gamma"], p[pre + "/bn2/beta"])
                if proj:
                    sc = _conv(h, p[pre + "/proj"], stride)
                    sc = _bn(sc, p[pre + "/proj_bn/gamma"], p[pre + "/proj_bn/beta"])
                else:
                    sc = h
                return arch.tag(tf.nn.relu(r + sc))

            blocks.append(block)
            c_in = width
    h = arch.chain(blocks, h, sqrt_group(len(blocks)))
    logits = tf.matmul(tf.reduce_mean(h, axis=[1, 2]), p["head/w"]) + p["head/b"]
    return _xent(logits, y)


def image_batch(batch: int, seed: int):
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(size=(batch, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=batch).astype(np.int32)
    return x, y


RESNET = Model(
    name="resnet", size_name="blocks/stage",
    depth=lambda n: 6 * n + 2, label=lambda n: f"ResNet-{6 * n + 2}",
    init=resnet_init, batch=image_batch, loss=resnet_loss,
    title="CIFAR ResNet (batch {b})", sizes=(1, 3, 9, 18), batch_size=32,
    size_flag="--blocks-per-stage", size_help="ResNet sweep (depth 6n+2; 18 is ResNet-110)",
)


# -- MLP chain --------------------------------------------------------------------------

MLP_WIDTH = 128
MLP_IN = 64


def mlp_init(n: int, seed: int) -> dict[str, np.ndarray]:
    p = _Init(seed)
    p.dense("in", MLP_IN, MLP_WIDTH)
    for i in range(n):
        # gain ~1.1 keeps tanh activations from vanishing over a deep chain
        p.dense(f"l{i}", MLP_WIDTH, MLP_WIDTH, gain=1.1)
    p.dense("head/w", MLP_WIDTH, NUM_CLASSES)
    return p.params


def mlp_loss(n, p, x, y, arch: Arch):
    h = tf.tanh(tf.matmul(x, p["in"]))
    g = sqrt_group(n)
    layers = []
    for i in range(n):
        def layer(h, i=i):
            h = tf.tanh(tf.matmul(h, p[f"l{i}"]))
            return arch.tag(h) if (i + 1) % g == 0 and i + 1 < n else h
        layers.append(layer)
    h = arch.chain(layers, h, g)
    return _xent(tf.matmul(h, p["head/w"]), y)


def mlp_batch(batch: int, seed: int):
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(size=(batch, MLP_IN)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=batch).astype(np.int32)
    return x, y


MLP = Model(
    name="mlp", size_name="layers",
    depth=lambda n: n + 2, label=lambda n: f"MLP-{n}",
    init=mlp_init, batch=mlp_batch, loss=mlp_loss,
    title="MLP chain (batch {b})", sizes=(16, 32, 64, 128), batch_size=1024,
    size_flag="--mlp-layers", size_help="MLP chain sweep",
)


# -- U-Net-like net with long skips -----------------------------------------------------

UNET_WIDTHS = (16, 32, 64, 128)  # levels at 32, 16, 8 and (bottleneck) 4 pixels


def unet_init(n: int, seed: int) -> dict[str, np.ndarray]:
    p = _Init(seed)
    w0 = UNET_WIDTHS[0]
    p.conv("stem", 3, 3, w0)
    p.bn("stem_bn", w0)
    for lvl, w in enumerate(UNET_WIDTHS):
        if lvl > 0:
            p.conv(f"down{lvl}", 3, UNET_WIDTHS[lvl - 1], w)
            p.bn(f"down{lvl}_bn", w)
        for i in range(n):
            p.conv(f"enc{lvl}_{i}", 3, w, w)
            p.bn(f"enc{lvl}_{i}_bn", w)
    for lvl in reversed(range(len(UNET_WIDTHS) - 1)):
        w = UNET_WIDTHS[lvl]
        p.conv(f"up{lvl}", 1, UNET_WIDTHS[lvl + 1], w)
        for i in range(n):
            p.conv(f"dec{lvl}_{i}", 3, w, w)
            p.bn(f"dec{lvl}_{i}_bn", w)
    p.dense("head/w", w0, NUM_CLASSES)
    return p.params


def unet_loss(n, p, x, y, arch: Arch):
    def cbr(name, stride=1):
        return lambda h: tf.nn.relu(_bn(_conv(h, p[name], stride),
                                        p[name + "_bn/gamma"], p[name + "_bn/beta"]))

    def stack(prefix, h):
        return arch.tag(arch.chain([cbr(f"{prefix}_{i}") for i in range(n)], h, n))

    levels = len(UNET_WIDTHS)
    h = cbr("stem")(x)
    skips = []
    for lvl in range(levels):
        if lvl > 0:
            h = cbr(f"down{lvl}", 2)(h)
        if lvl < levels - 1:
            skips.append(h)  # taken before this level's encoder stack
        h = stack(f"enc{lvl}", h)
    for lvl in reversed(range(levels - 1)):
        h = tf.repeat(tf.repeat(h, 2, axis=1), 2, axis=2)  # nearest-neighbour upsampling
        h = stack(f"dec{lvl}", _conv(h, p[f"up{lvl}"])) + skips[lvl]
    return _xent(tf.matmul(tf.reduce_mean(tf.nn.relu(h), axis=[1, 2]), p["head/w"]), y)


UNET = Model(
    name="unet", size_name="convs/stack",
    depth=lambda n: 7 * n + 8, label=lambda n: f"U-Net-{7 * n + 8}",
    init=unet_init, batch=image_batch, loss=unet_loss,
    title="U-Net-like, long skips (batch {b})", sizes=(1, 2, 4, 8), batch_size=32,
    size_flag="--unet-convs", size_help="U-Net sweep: conv layers per stack (depth 7n+8)",
)


# -- LSTM over a sequence: one tf.while_loop ----------------------------------------------

RNN_FEATURES, RNN_UNITS = 64, 128
#: The batch holds this many steps; a model of ``n`` steps reads the first n
#: (a Model's batch function does not know the size).
RNN_MAX_STEPS = 128


def rnn_init(n: int, seed: int) -> dict[str, np.ndarray]:
    p = _Init(seed)
    p.dense("W", RNN_FEATURES, 4 * RNN_UNITS)
    p.dense("U", RNN_UNITS, 4 * RNN_UNITS)
    p.dense("head/w", RNN_UNITS, NUM_CLASSES)
    return p.params


def rnn_loss(n, p, x, y, arch: Arch):
    """An LSTM cell run for ``n`` steps by a tf.while_loop (what a Keras LSTM
    runs on CPU); no hook of ``arch`` applies inside a loop body."""
    xs = tf.transpose(x[:, :n], [1, 0, 2])
    zeros = tf.zeros([tf.shape(x)[0], RNN_UNITS])

    def body(t, h, c):
        i, f, o, g = tf.split(tf.matmul(xs[t], p["W"]) + tf.matmul(h, p["U"]), 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        return t + 1, tf.sigmoid(o) * tf.tanh(c), c

    _, h, _ = tf.while_loop(lambda t, h, c: t < n, body, [0, zeros, zeros], maximum_iterations=n)
    return _xent(tf.matmul(h, p["head/w"]), y)


def rnn_batch(batch: int, seed: int):
    rng = np.random.default_rng(seed + 2)
    x = rng.normal(size=(batch, RNN_MAX_STEPS, RNN_FEATURES)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=batch).astype(np.int32)
    return x, y


RNN = Model(
    name="rnn", size_name="steps",
    depth=lambda n: n, label=lambda n: f"LSTM-T{n}",
    init=rnn_init, batch=rnn_batch, loss=rnn_loss,
    title="LSTM(128) in a tf.while_loop (batch {b})", sizes=(32, 64, 128), batch_size=512,
    size_flag="--rnn-steps", size_help=f"LSTM sweep: steps (at most {RNN_MAX_STEPS})",
)

MODELS = {m.name: m for m in (RESNET, MLP, UNET, RNN)}
