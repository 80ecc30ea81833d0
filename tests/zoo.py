"""Model zoo for the differential gradient tests.

Every model is built by a ``build_*`` function that returns a :class:`Model`.
A model separates what must be created once from what is traced:

``model.make_variables()``
    creates the model's variables (a ``dict`` name -> variable) from seeded
    numpy values. Call it inside ``tf.compat.v1.Graph().as_default()`` for a
    Session run, or eagerly (outside the ``tf.function``) for a traced run:
    ``tf.function`` may not create variables on every trace.
``model.forward(variables)``
    builds the forward pass in the current graph (a ``tf.compat.v1.Graph`` or
    the ``FuncGraph`` of a ``tf.function`` being traced) and returns a
    :class:`Forward`: the ys, the xs, optional grad_ys / stop_gradients, and a
    few mid-graph tensors suitable as an explicit ``checkpoints=[...]`` list.
    It also adds some block outputs to the ``'checkpoints'`` collection of the
    current graph, so that ``checkpoints='collection'`` has something to use.

All inputs are numpy constants drawn from ``np.random.RandomState(seed)`` when
the model is built, so a model gives the same numbers in both modes and no
variable initializer is stateful. Shapes are tiny (batch 2-4, width 8-16,
8x8 images): the zoo tests coverage of op types and graph shapes, not speed.

Random ops are deliberate where a model is about randomness (the dropout
models): there, the two gradient computations being compared must be
evaluated in the same ``session.run`` / the same function call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf

SESSION = "session"
FUNCTION = "function"
MODES = (SESSION, FUNCTION)

COLLECTION = "checkpoints"


@dataclasses.dataclass
class Forward:
    """What a forward pass hands to the gradient call.

    ys, xs, grad_ys and stop_gradients are passed to both ``tf.gradients`` and
    ``memsave.gradients`` unchanged. ``checkpoints`` is a list of mid-graph
    tensors (strictly between xs and ys) for the explicit-list strategy.
    ``probes`` are extra tensors a test may fetch (e.g. a dropout output, to
    check the mask really drops something).
    """

    ys: Any
    xs: list
    grad_ys: Any = None
    stop_gradients: Any = None
    checkpoints: list = dataclasses.field(default_factory=list)
    probes: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Model:
    """A zoo entry: see the module docstring.

    compute_dtype is the least precise float dtype on the paths xs -> ys; the
    tests pick their tolerance from it. gradient_kwargs are extra keyword
    arguments for both gradient functions (e.g. unconnected_gradients).

    fallbacks maps a strategy name to why that strategy legitimately finds
    nothing to keep on this model: for those the tests assert that memsave
    says so (its warning) and answers with tf.gradients; for every other
    strategy they assert that it plans and builds recomputed copies.

    copies_identifiable is False when some recomputed copies cannot be told
    from other ops by graph structure alone: tf.gradients adds accumulator
    inputs and outputs to a forward While op as it differentiates it, so the
    While's copy (and what reads its outputs) no longer has the original's
    inputs. The tests then require some copies, not all the planned ones.
    """

    name: str
    make_variables: Callable[[], dict]
    forward: Callable[[dict], Forward]
    compute_dtype: tf.DType = tf.float32
    modes: tuple = MODES
    gradient_kwargs: dict = dataclasses.field(default_factory=dict)
    fallbacks: dict = dataclasses.field(default_factory=dict)
    copies_identifiable: bool = True

    @property
    def has_explicit_checkpoints(self) -> bool:
        # Every zoo model lists explicit checkpoints; kept as a property so a
        # future model without suitable mid-graph tensors can opt out.
        return True


# ----------------------------------------------------------------------------
# helpers


def _normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _glorot(rng, shape):
    fan_in = int(np.prod(shape[:-1]))
    return _normal(rng, shape, 1.0 / np.sqrt(fan_in))


def _variables_from(values, dtypes=None):
    """Return make_variables() creating one tf.Variable per numpy value."""
    dtypes = dtypes or {}

    def make_variables():
        return {
            name: tf.Variable(value, dtype=dtypes.get(name, tf.float32), name=name)
            for name, value in values.items()
        }

    return make_variables


def _tag(t):
    """Add t to the 'checkpoints' collection of the current graph."""
    tf.compat.v1.add_to_collection(COLLECTION, t)
    return t


def _conv(x, w, stride=1):
    return tf.nn.conv2d(x, w, strides=stride, padding="SAME")


def _mse(a, b):
    return tf.reduce_mean(tf.square(a - b))


def _xent(logits, labels):
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )


# ----------------------------------------------------------------------------
# feed-forward chains


def build_mlp(batch_size=4, width=16, depth=8, seed=0):
    """tanh(h W + b) chain: the textbook case for sqrt(n) checkpointing."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {}
    for i in range(depth):
        values[f"w{i}"] = _glorot(rng, (width, width)) * 1.5
        values[f"b{i}"] = _normal(rng, (width,), 0.1)
    target = _normal(rng, (batch_size, width), 0.5)

    def forward(v):
        h = tf.constant(x)
        hidden = []
        for i in range(depth):
            h = tf.tanh(tf.matmul(h, v[f"w{i}"]) + v[f"b{i}"])
            hidden.append(h)
            if i % 2 == 1 and i < depth - 1:
                _tag(h)
        loss = _mse(h, target)
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[hidden[2], hidden[5]])

    return Model("mlp", _variables_from(values), forward)


def build_residual_mlp_kwargs(batch_size=4, width=12, depth=6, seed=1):
    """Residual chain (fan-out, so gradients are aggregated) run with
    gate_gradients, a non-default aggregation_method and
    colocate_gradients_with_ops, which both gradient functions must accept."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) for i in range(depth)}

    def forward(v):
        h = tf.constant(x)
        hidden = []
        for i in range(depth):
            h = h + tf.tanh(tf.matmul(h, v[f"w{i}"]))
            hidden.append(h)
            if i in (1, 3):
                _tag(h)
        loss = tf.reduce_mean(tf.square(h))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[hidden[1], hidden[4]])

    return Model(
        "residual_mlp_kwargs",
        _variables_from(values),
        forward,
        gradient_kwargs=dict(
            gate_gradients=True,
            aggregation_method=tf.AggregationMethod.EXPERIMENTAL_TREE,
            colocate_gradients_with_ops=True,
        ),
    )


# ----------------------------------------------------------------------------
# convolutional nets


def build_cnn(batch_size=4, size=8, seed=2):
    """conv/relu/conv/relu/maxpool/conv/relu/avgpool/dense/softmax-xent."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, size, size, 3))
    labels = rng.randint(0, 10, size=(batch_size,)).astype(np.int32)
    values = {
        "w1": _glorot(rng, (3, 3, 3, 8)),
        "b1": _normal(rng, (8,), 0.1),
        "w2": _glorot(rng, (3, 3, 8, 8)),
        "w3": _glorot(rng, (3, 3, 8, 16)),
        "w4": _glorot(rng, ((size // 4) ** 2 * 16, 10)),
        "b4": np.zeros((10,), np.float32),
    }

    def forward(v):
        c1 = tf.nn.relu(_conv(tf.constant(x), v["w1"]) + v["b1"])
        c2 = tf.nn.relu(_conv(c1, v["w2"]))
        p1 = _tag(tf.nn.max_pool2d(c2, 2, 2, "VALID"))
        c3 = tf.nn.relu(_conv(p1, v["w3"]))
        p2 = _tag(tf.nn.avg_pool2d(c3, 2, 2, "VALID"))
        flat = tf.reshape(p2, [batch_size, -1])
        logits = tf.matmul(flat, v["w4"]) + v["b4"]
        return Forward(ys=_xent(logits, labels), xs=list(v.values()), checkpoints=[c2, p1])

    return Model("cnn", _variables_from(values), forward)


def _batch_norm_moments(x, gamma, beta):
    mean, variance = tf.nn.moments(x, axes=[0, 1, 2])
    return tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3)


def _batch_norm_fused(x, gamma, beta):
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(
        x, gamma, beta, epsilon=1e-3, is_training=True
    )
    return y


def _build_resnet(name, batch_norm, batch_size=4, size=8, channels=8, blocks=3, seed=3):
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, size, size, channels))
    labels = rng.randint(0, 5, size=(batch_size,)).astype(np.int32)
    values = {"stem": _glorot(rng, (3, 3, channels, channels))}
    for i in range(blocks):
        for part in "ab":
            values[f"w{i}{part}"] = _glorot(rng, (3, 3, channels, channels))
            values[f"gamma{i}{part}"] = 1.0 + _normal(rng, (channels,), 0.1)
            values[f"beta{i}{part}"] = _normal(rng, (channels,), 0.1)
    values["head"] = _glorot(rng, (channels, 5))

    def forward(v):
        h = tf.nn.relu(_conv(tf.constant(x), v["stem"]))
        mids, outs = [], []
        for i in range(blocks):
            a = tf.nn.relu(batch_norm(_conv(h, v[f"w{i}a"]), v[f"gamma{i}a"], v[f"beta{i}a"]))
            mids.append(a)
            b = batch_norm(_conv(a, v[f"w{i}b"]), v[f"gamma{i}b"], v[f"beta{i}b"])
            h = _tag(tf.nn.relu(h + b))
            outs.append(h)
        pooled = tf.reduce_mean(h, axis=[1, 2])
        logits = tf.matmul(pooled, v["head"])
        return Forward(ys=_xent(logits, labels), xs=list(v.values()), checkpoints=[outs[0], mids[1]])

    return Model(name, _variables_from(values), forward)


def build_resnet_bn(**kwargs):
    """ResNet blocks with training-mode batch norm from tf.nn.moments."""
    return _build_resnet("resnet_bn", _batch_norm_moments, **kwargs)


def build_resnet_fused_bn(**kwargs):
    """ResNet blocks with tf.compat.v1.nn.fused_batch_norm(is_training=True)
    (FusedBatchNormV3, whose gradient reads its reserve-space outputs)."""
    return _build_resnet("resnet_fused_bn", _batch_norm_fused, **kwargs)


def build_unet(batch_size=4, size=8, seed=4):
    """Two stride-2 downsamplings, upsampling by conv2d_transpose and by
    bilinear resize, concatenated long skip connections."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, size, size, 3))
    target = _normal(rng, (batch_size, size, size, 1), 0.5)
    values = {
        "e1": _glorot(rng, (3, 3, 3, 8)),
        "e2": _glorot(rng, (3, 3, 8, 16)),
        "bottleneck": _glorot(rng, (3, 3, 16, 16)),
        "up2": _glorot(rng, (3, 3, 16, 16)),  # conv2d_transpose: (h, w, out, in)
        "d2": _glorot(rng, (3, 3, 32, 16)),
        "d1": _glorot(rng, (3, 3, 24, 8)),
        "out": _glorot(rng, (1, 1, 8, 1)),
    }

    def forward(v):
        e1 = _tag(tf.nn.relu(_conv(tf.constant(x), v["e1"])))
        e2 = _tag(tf.nn.relu(_conv(e1, v["e2"], stride=2)))
        bottleneck = _tag(tf.nn.relu(_conv(e2, v["bottleneck"], stride=2)))
        u2 = tf.nn.relu(
            tf.nn.conv2d_transpose(
                bottleneck, v["up2"], output_shape=[batch_size, size // 2, size // 2, 16],
                strides=2, padding="SAME",
            )
        )
        d2 = tf.nn.relu(_conv(tf.concat([u2, e2], axis=-1), v["d2"]))
        u1 = tf.image.resize(d2, [size, size], method="bilinear")
        d1 = tf.nn.relu(_conv(tf.concat([u1, e1], axis=-1), v["d1"]))
        out = _conv(d1, v["out"])
        return Forward(ys=_mse(out, target), xs=list(v.values()), checkpoints=[bottleneck, d2])

    return Model("unet", _variables_from(values), forward)


# ----------------------------------------------------------------------------
# attention


def _layer_norm(x, gamma, beta):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-5) * gamma + beta


def build_transformer(batch_size=2, seq=6, d_model=16, heads=2, blocks=2, seed=5):
    """Pre-LN transformer blocks: layer norm, causal multi-head attention
    (einsum projections, matmul scores, softmax), GELU MLP, residuals."""
    rng = np.random.RandomState(seed)
    d_head = d_model // heads
    x = _normal(rng, (batch_size, seq, d_model))
    target = _normal(rng, (batch_size, seq, d_model), 0.5)
    mask = np.triu(np.full((seq, seq), -1e9, np.float32), k=1)
    values = {}
    for i in range(blocks):
        values[f"ln1_g{i}"] = 1.0 + _normal(rng, (d_model,), 0.1)
        values[f"ln1_b{i}"] = _normal(rng, (d_model,), 0.1)
        for p in "qkv":
            values[f"w{p}{i}"] = _normal(rng, (d_model, heads, d_head), d_model ** -0.5)
        values[f"wo{i}"] = _normal(rng, (heads, d_head, d_model), d_model ** -0.5)
        values[f"ln2_g{i}"] = 1.0 + _normal(rng, (d_model,), 0.1)
        values[f"ln2_b{i}"] = _normal(rng, (d_model,), 0.1)
        values[f"mlp1_{i}"] = _glorot(rng, (d_model, 2 * d_model))
        values[f"mlp1b_{i}"] = _normal(rng, (2 * d_model,), 0.1)
        values[f"mlp2_{i}"] = _glorot(rng, (2 * d_model, d_model))

    def attention(h, v, i):
        q = tf.einsum("bsd,dhk->bhsk", h, v[f"wq{i}"])
        k = tf.einsum("bsd,dhk->bhsk", h, v[f"wk{i}"])
        val = tf.einsum("bsd,dhk->bhsk", h, v[f"wv{i}"])
        scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(d_head) + mask
        weights = tf.nn.softmax(scores, axis=-1)
        context = tf.matmul(weights, val)
        return tf.einsum("bhsk,hkd->bsd", context, v[f"wo{i}"])

    def forward(v):
        h = tf.constant(x)
        after_attention, normed = [], []
        for i in range(blocks):
            h = h + attention(_layer_norm(h, v[f"ln1_g{i}"], v[f"ln1_b{i}"]), v, i)
            after_attention.append(h)
            n = _layer_norm(h, v[f"ln2_g{i}"], v[f"ln2_b{i}"])
            normed.append(n)
            hidden = tf.nn.gelu(tf.matmul(n, v[f"mlp1_{i}"]) + v[f"mlp1b_{i}"])
            h = _tag(h + tf.matmul(hidden, v[f"mlp2_{i}"]))
        loss = _mse(h, target)
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[after_attention[0], normed[1]])

    return Model("transformer", _variables_from(values), forward)


def build_seq_dense(batch_size=2, seq=6, width=8, depth=4, seed=19):
    """Dense layers on a sequence written ``h @ w`` (``w`` broadcast over the
    batch: a BatchMatMulV2), whose gradient computes every example's
    product with ``w``'s shape before summing them."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, seq, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(depth)}
    target = _normal(rng, (batch_size, seq, width), 0.5)

    def forward(v):
        h = tf.constant(x)
        hidden = []
        for i in range(depth):
            h = tf.tanh(h @ v[f"w{i}"])
            hidden.append(h)
        _tag(hidden[1])
        loss = _mse(h, target)
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[hidden[1]])

    return Model("seq_dense", _variables_from(values), forward)


def build_sequence_slices(batch_size=4, steps=6, width=8, seed=20):
    """A time-major sequence (``[steps, batch, width]``, a dense layer on
    every step) read through views of its rows: its last step ``h[-1]``
    and its first half (``tf.split`` along axis 0), each through an
    elementwise op. TensorFlow's kernels return those slices as parts of
    the sequence's buffer, and write the elementwise op's output in place
    into them, so the whole sequence stays alive with them."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (steps, batch_size, width))
    values = {"w_in": _glorot(rng, (width, width)), "w_mid": _glorot(rng, (width, width)),
              "w_out": _glorot(rng, (width, 4))}

    def dense(h, w):  # on every step, as matmuls (views around them)
        return tf.reshape(tf.reshape(h, [steps * batch_size, width]) @ w, [steps, batch_size, width])

    def forward(v):
        h = tf.tanh(dense(tf.constant(x), v["w_in"]))
        h = _tag(dense(h, v["w_mid"]))  # its gradient reads no output
        last = tf.tanh(h[-1])
        first, _ = tf.split(h, 2, axis=0)
        pooled = tf.reduce_mean(tf.sigmoid(first), axis=0)
        loss = tf.reduce_mean(tf.square(tf.matmul(last * pooled, v["w_out"])))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[h])

    return Model("sequence_slices", _variables_from(values), forward)


# ----------------------------------------------------------------------------
# sparse gradients


def build_embedding(batch_size=4, tokens=6, vocab=20, dim=8, seed=6):
    """Two embedding_lookup calls on one table (with repeated ids): the
    table's gradient is IndexedSlices, aggregated from two gathers."""
    rng = np.random.RandomState(seed)
    ids_a = rng.randint(0, vocab // 2, size=(batch_size, tokens)).astype(np.int32)
    ids_b = rng.randint(0, vocab, size=(batch_size, tokens)).astype(np.int32)
    values = {
        "table": _normal(rng, (vocab, dim), 0.5),
        "w1": _glorot(rng, (tokens * dim, 16)),
        "w2": _glorot(rng, (16, 16)),
        "w3": _glorot(rng, (16, 1)),
    }

    def forward(v):
        emb_a = tf.nn.embedding_lookup(v["table"], ids_a)
        emb_b = tf.nn.embedding_lookup(v["table"], ids_b)
        e = tf.reshape(emb_a * tf.tanh(emb_b), [batch_size, tokens * dim])
        h1 = _tag(tf.tanh(tf.matmul(e, v["w1"])))
        h2 = tf.tanh(tf.matmul(h1, v["w2"]))
        loss = tf.reduce_mean(tf.square(tf.matmul(h2, v["w3"])))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[e, h1])

    return Model("embedding", _variables_from(values), forward)


# ----------------------------------------------------------------------------
# randomness


def _build_dropout(name, dropout, batch_size=4, width=16, depth=6, seed=7):
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(depth)}

    def forward(v):
        h = tf.constant(x)
        hidden, dropped = [], {}
        for i in range(depth):
            h = tf.tanh(tf.matmul(h, v[f"w{i}"]))
            if i in (1, 3):
                h = dropout(h, i)
                dropped[f"dropout{i}"] = h
            hidden.append(h)
            if i == 2:
                _tag(h)
        loss = tf.reduce_mean(tf.square(h))
        # Explicit checkpoints h0 and h4: both dropouts sit strictly inside a
        # recomputed segment.
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[hidden[0], hidden[4]],
                       probes=dropped)

    return Model(name, _variables_from(values), forward)


def build_dropout_stateful(**kwargs):
    """tf.nn.dropout (stateful RandomUniform) inside the chain: recomputing
    it would draw a new mask."""
    return _build_dropout(
        "dropout_stateful", lambda h, i: tf.nn.dropout(h, rate=0.3, seed=100 + i), **kwargs
    )


def build_dropout_stateless(**kwargs):
    """tf.nn.experimental.stateless_dropout: recomputes identically."""
    return _build_dropout(
        "dropout_stateless",
        lambda h, i: tf.nn.experimental.stateless_dropout(h, rate=0.3, seed=[1, i]),
        **kwargs,
    )


def build_dropout_recompute_chain(batch_size=4, width=16, depth=8, seed=18):
    """An 8-layer tanh chain with tf.nn.dropout(rate=0.5) after layer 3.

    The explicit checkpoints h1 and h6 put the dropout strictly inside one
    recomputed segment. probes: the dropout's input and output, to check the
    mask is active. Not in ZOO: it has a test of its own.
    """
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(depth)}

    def forward(v):
        h = tf.constant(x)
        hidden, probes = [], {}
        for i in range(depth):
            h = tf.tanh(tf.matmul(h, v[f"w{i}"]))
            if i == 3:
                probes["pre_dropout"] = h
                h = tf.nn.dropout(h, rate=0.5, seed=1234)
                probes["post_dropout"] = h
            hidden.append(h)
        loss = tf.reduce_mean(tf.square(h))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[hidden[1], hidden[6]],
                       probes=probes)

    return Model("dropout_recompute_chain", _variables_from(values), forward)


# ----------------------------------------------------------------------------
# control flow and functions


def build_rnn_while(batch_size=4, steps=5, width=8, seed=8):
    """A tf.while_loop RNN, h <- tanh(h W + x_t U), between a dense input
    layer and a dense output layer."""
    rng = np.random.RandomState(seed)
    x_seq = _normal(rng, (steps, batch_size, width))
    x0 = _normal(rng, (batch_size, width))
    values = {
        "w_in": _glorot(rng, (width, width)),
        "w_h0": _glorot(rng, (width, width)),
        "w": _glorot(rng, (width, width)),
        "u": _glorot(rng, (width, width)),
        "w_out": _glorot(rng, (width, 4)),
    }

    def forward(v):
        inputs = _tag(tf.tanh(tf.einsum("tbd,de->tbe", tf.constant(x_seq), v["w_in"])))
        h0 = tf.tanh(tf.matmul(tf.constant(x0), v["w_h0"]))

        def body(i, h):
            x_t = tf.gather(inputs, i)
            return i + 1, tf.tanh(tf.matmul(h, v["w"]) + tf.matmul(x_t, v["u"]))

        _, h = tf.while_loop(
            lambda i, h: i < steps, body, [tf.constant(0), h0], maximum_iterations=steps
        )
        h = _tag(tf.identity(h))
        out = tf.tanh(tf.matmul(h, v["w_out"]))
        loss = tf.reduce_mean(tf.square(out))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[inputs, h])

    return Model("rnn_while", _variables_from(values), forward, copies_identifiable=False)


def build_cond_chain(batch_size=4, width=12, seed=9):
    """Two data-dependent tf.cond ops in the middle of a chain; the second
    predicate is the negation of the first, so one true branch and one false
    branch run."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    names = ["w0", "w1", "a1", "b1", "w2", "a2", "b2", "w3"]
    values = {n: _glorot(rng, (width, width)) * 1.5 for n in names}

    def forward(v):
        h0 = tf.tanh(tf.matmul(tf.constant(x), v["w0"]))
        h1 = tf.tanh(tf.matmul(h0, v["w1"]))
        pred = tf.reduce_mean(h1) > 0.0
        c1 = tf.cond(
            pred,
            lambda: tf.tanh(tf.matmul(h1, v["a1"])),
            lambda: 2.0 * tf.sigmoid(tf.matmul(h1, v["b1"])) - 1.0,
        )
        _tag(c1)
        h2 = tf.tanh(tf.matmul(c1, v["w2"]))
        c2 = tf.cond(
            tf.logical_not(pred),
            lambda: tf.tanh(tf.matmul(h2, v["a2"])) * h1,
            lambda: tf.sin(tf.matmul(h2, v["b2"])) * h1,
        )
        h3 = tf.tanh(tf.matmul(c2, v["w3"]))
        loss = tf.reduce_mean(tf.square(h3))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[h1, c1])

    return Model("cond_chain", _variables_from(values), forward)


def build_nested_function(batch_size=4, width=12, depth=4, seed=10):
    """A tf.function (two layers inside) called several times in the model:
    its calls are (Stateful)PartitionedCall ops with a Python-side gradient."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {}
    for i in range(depth):
        values[f"w{i}"] = _glorot(rng, (width, width)) * 1.5
        values[f"u{i}"] = _glorot(rng, (width, width)) * 1.5
        values[f"b{i}"] = _normal(rng, (width,), 0.1)

    def forward(v):
        @tf.function
        def block(h, w, u, b):
            inner = tf.tanh(tf.matmul(h, w) + b)
            return tf.sigmoid(tf.matmul(inner, u)) * h

        h = tf.constant(x)
        outs = []
        for i in range(depth):
            h = block(h, v[f"w{i}"], v[f"u{i}"], v[f"b{i}"])
            h = h + 0.1 * tf.sin(h)  # plain ops between the calls
            outs.append(h)
            if i == 1:
                _tag(h)
        loss = tf.reduce_mean(tf.square(h))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[outs[0], outs[2]])

    return Model(
        "nested_function", _variables_from(values), forward,
        fallbacks={
            "speed": "the matmuls are inside the nested tf.function (one PartitionedCall op "
                     "per call): no conv/matmul output between xs and ys for 'speed' to keep",
        },
    )


# ----------------------------------------------------------------------------
# reduced precision


def _build_low_precision(name, dtype, batch_size=4, width=16, seed=11):
    """float32 layer -> cast to dtype -> three dtype layers (two with float32
    weights cast down, mixed-precision style, one with a dtype variable) ->
    cast back -> float32 layer."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(5)}
    dtypes = {"w2": dtype}  # a variable of the reduced dtype: its gradient has that dtype

    def forward(v):
        h1 = tf.tanh(tf.matmul(tf.constant(x), v["w0"]))
        low = tf.cast(h1, dtype)
        h2 = tf.tanh(tf.matmul(low, tf.cast(v["w1"], dtype)))
        h3 = _tag(tf.tanh(tf.matmul(h2, v["w2"])))
        h4 = tf.tanh(tf.matmul(h3, tf.cast(v["w3"], dtype)))
        back = tf.cast(h4, tf.float32)
        loss = tf.reduce_mean(tf.square(tf.matmul(back, v["w4"])))
        return Forward(ys=loss, xs=list(v.values()), checkpoints=[h2, h3])

    return Model(name, _variables_from(values, dtypes), forward, compute_dtype=dtype)


def build_float16_chain(**kwargs):
    return _build_low_precision("float16_chain", tf.float16, **kwargs)


def build_bfloat16_chain(**kwargs):
    return _build_low_precision("bfloat16_chain", tf.bfloat16, **kwargs)


# ----------------------------------------------------------------------------
# gradient-call arguments: several ys, grad_ys, stop_gradients, tensor xs


def build_two_losses(batch_size=4, width=12, seed=12):
    """A shared trunk and two heads; ys is the list of both losses."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    labels = rng.randint(0, 5, size=(batch_size,)).astype(np.int32)
    values = {f"t{i}": _glorot(rng, (width, width)) * 1.5 for i in range(4)}
    values["head_a"] = _glorot(rng, (width, width))
    values["head_b"] = _glorot(rng, (width, 5))

    def forward(v):
        h = tf.constant(x)
        trunk = []
        for i in range(4):
            h = tf.tanh(tf.matmul(h, v[f"t{i}"]))
            trunk.append(h)
        _tag(trunk[1])
        loss_a = tf.reduce_mean(tf.square(tf.tanh(tf.matmul(h, v["head_a"]))))
        loss_b = _xent(tf.matmul(h, v["head_b"]), labels)
        return Forward(ys=[loss_a, loss_b], xs=list(v.values()), checkpoints=[trunk[1], trunk[2]])

    return Model("two_losses", _variables_from(values), forward)


def build_grad_ys(batch_size=4, width=8, seed=13):
    """ys = [a non-scalar output, a scalar loss] with grad_ys = [a given
    tensor, None]."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    upstream = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(5)}

    def forward(v):
        h = tf.constant(x)
        hidden = []
        for i in range(4):
            h = tf.tanh(tf.matmul(h, v[f"w{i}"]))
            hidden.append(h)
        _tag(hidden[1])
        side_loss = tf.reduce_sum(tf.sin(tf.matmul(hidden[2], v["w4"])))
        return Forward(
            ys=[h, side_loss],
            xs=list(v.values()),
            grad_ys=[tf.constant(upstream), None],
            checkpoints=[hidden[1]],
        )

    return Model("grad_ys", _variables_from(values), forward)


def build_stop_gradients(batch_size=4, width=10, seed=14):
    """stop_gradients=[h2] on a chain with a skip connection h0 -> h3:
    w1 and w2 only reach the loss through h2 (so their gradients are cut),
    w0 reaches it through the skip as well."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(6)}

    def forward(v):
        h = tf.constant(x)
        hidden = []
        for i in range(6):
            h = tf.tanh(tf.matmul(h, v[f"w{i}"]))
            if i == 3:
                h = h + 0.5 * hidden[0]
            hidden.append(h)
        _tag(hidden[3])
        loss = tf.reduce_mean(tf.square(h))
        return Forward(
            ys=loss,
            xs=list(v.values()),
            stop_gradients=[hidden[2]],
            # h0 reaches the loss only through the skip (its path through
            # h2 is stopped); h1 would be no checkpoint at all: it only
            # feeds h2, so memsave rejects it (CheckpointError).
            checkpoints=[hidden[0], hidden[4]],
        )

    return Model("stop_gradients", _variables_from(values), forward)


def build_tensor_in_xs(batch_size=4, width=10, seed=15):
    """xs holds the variables, an intermediate activation and the (identity
    of the) input tensor."""
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(6)}

    def forward(v):
        inp = tf.identity(tf.constant(x))
        h = inp
        hidden = []
        for i in range(6):
            h = tf.tanh(tf.matmul(h, v[f"w{i}"]))
            hidden.append(h)
        _tag(hidden[3])
        loss = tf.reduce_mean(tf.square(h))
        xs = list(v.values()) + [hidden[2], inp]
        return Forward(ys=loss, xs=xs, checkpoints=[hidden[1], hidden[4]])

    return Model("tensor_in_xs", _variables_from(values), forward)


def _build_unconnected(name, unconnected, batch_size=4, width=8, seed=16):
    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))
    values = {f"w{i}": _glorot(rng, (width, width)) * 1.5 for i in range(5)}
    values["unused"] = _glorot(rng, (width, width))

    def forward(v):
        h = tf.constant(x)
        hidden = []
        for i in range(5):
            h = tf.tanh(tf.matmul(h, v[f"w{i}"]))
            hidden.append(h)
        _tag(hidden[2])
        # A dead branch that uses 'unused' but does not reach the loss.
        tf.matmul(hidden[1], v["unused"])
        loss = tf.reduce_mean(tf.square(h))
        xs = [v["w0"], v["unused"], v["w1"], v["w2"], v["w3"], v["w4"]]
        return Forward(ys=loss, xs=xs, checkpoints=[hidden[1], hidden[3]])

    return Model(
        name, _variables_from(values), forward,
        gradient_kwargs=dict(unconnected_gradients=unconnected),
    )


def build_unconnected_none(**kwargs):
    """An xs entry with no path to ys: its gradient is None."""
    return _build_unconnected("unconnected_none", tf.UnconnectedGradients.NONE, **kwargs)


def build_unconnected_zero(**kwargs):
    """Same, with unconnected_gradients=ZERO: its gradient is zeros."""
    return _build_unconnected("unconnected_zero", tf.UnconnectedGradients.ZERO, **kwargs)


# ----------------------------------------------------------------------------
# Keras 3


def build_keras_layers(batch_size=4, width=12, seed=17):
    """Keras 3 Dense layers; xs are the layers' keras.Variable objects.
    Keras 3 layers need eager variable creation: tf.function mode only."""
    import keras

    rng = np.random.RandomState(seed)
    x = _normal(rng, (batch_size, width))

    def make_variables():
        layers = []
        for i, activation in enumerate(["tanh", "tanh", "tanh", None]):
            layer = keras.layers.Dense(
                width,
                activation=activation,
                kernel_initializer=keras.initializers.GlorotUniform(seed=seed + i),
                bias_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed + 10 + i),
            )
            layer.build((batch_size, width))
            layers.append(layer)
        return {"layers": layers}

    def forward(v):
        h = tf.constant(x)
        hidden = []
        for layer in v["layers"]:
            h = layer(h)
            hidden.append(h)
        _tag(hidden[1])
        loss = tf.reduce_mean(tf.square(h))
        xs = [w for layer in v["layers"] for w in layer.trainable_variables]
        return Forward(ys=loss, xs=xs, checkpoints=[hidden[0], hidden[2]])

    return Model("keras_layers", make_variables, forward, modes=(FUNCTION,))


# ----------------------------------------------------------------------------
# seeded random DAGs


def _unary(name):
    return {
        "tanh": tf.tanh,
        "sigmoid": tf.sigmoid,
        "sin": tf.sin,
        "softplus_scaled": lambda a: 0.5 * tf.nn.softplus(a),
    }[name]


def _binary(name, n):
    return {
        "mul": tf.multiply,
        "mean": lambda a, b: 0.5 * (a + b),
        "sub": tf.subtract,
        "matmul": lambda a, b: tf.tanh(tf.matmul(a, b) / np.sqrt(n)),
    }[name]


def build_random_dag(seed, n_inputs=4, n_nodes=16, n=4):
    """A random DAG of elementwise and matmul ops over n x n tensors.

    Ops are drawn from numpy's RandomState(seed), with inputs biased towards
    recent nodes so the graph is deep as well as wide. All values stay
    bounded (tanh/sigmoid/sin, averaged sums, scaled matmuls). ys are one or
    two reductions of late nodes; xs are the input variables (some may not
    reach ys, giving None gradients) and sometimes an intermediate node.
    Forward.checkpoints is a random non-empty subset of the nodes strictly
    between xs and ys (each kept with probability 0.35).
    """
    rng = np.random.RandomState(seed)
    inputs = {f"x{i}": _normal(rng, (n, n), 0.8) for i in range(n_inputs)}
    unary = ["tanh", "sigmoid", "sin", "softplus_scaled"]
    binary = ["mul", "mean", "sub", "matmul"]
    # node plan: (kind, op name, input indices); indices < n_inputs are inputs.
    plan = []
    for k in range(n_nodes):
        available = n_inputs + k
        # Bias towards recent nodes: draw an offset from the end.
        def pick():
            back = min(int(rng.geometric(0.25)), available)
            return available - back
        # The first nodes each read one input, so most inputs are used.
        first = k if k < n_inputs else pick()
        if rng.rand() < 0.4:
            plan.append(("unary", unary[rng.randint(len(unary))], (first,)))
        else:
            op, a, b = binary[rng.randint(len(binary))], first, pick()
            if op == "sub" and a == b:  # a - a == 0 would cut every gradient
                op = "mul"
            plan.append(("binary", op, (a, b)))
    n_ys = 1 + rng.randint(2)
    y_nodes = sorted({n_inputs + n_nodes - 1, n_inputs + n_nodes - 1 - rng.randint(1, 4)})[-n_ys:]

    # ancestors of ys and descendants of inputs, by index (plain ints)
    total = n_inputs + n_nodes
    parents = [()] * n_inputs + [p[2] for p in plan]
    reaches_y = [False] * total
    for y in y_nodes:
        reaches_y[y] = True
    for k in reversed(range(total)):
        if reaches_y[k]:
            for p in parents[k]:
                reaches_y[p] = True
    between = [k for k in range(n_inputs, total) if reaches_y[k] and k not in y_nodes]
    extra_x = None
    if len(between) >= 2 and rng.rand() < 0.5:
        extra_x = between[rng.randint(len(between))]
    candidates = [k for k in between if k != extra_x]
    chosen = sorted(k for k in candidates if rng.rand() < 0.35)
    if not chosen and candidates:
        chosen = [candidates[rng.randint(len(candidates))]]
    y_scales = rng.uniform(0.5, 2.0, size=len(y_nodes)).astype(np.float32)

    def forward(v):
        nodes = [v[f"x{i}"] for i in range(n_inputs)]
        for kind, op, args in plan:
            fn = _unary(op) if kind == "unary" else _binary(op, n)
            nodes.append(fn(*(nodes[a] for a in args)))
        ys = [tf.reduce_sum(nodes[k]) * s for k, s in zip(y_nodes, y_scales)]
        xs = [v[f"x{i}"] for i in range(n_inputs)]
        if extra_x is not None:
            xs.append(nodes[extra_x])
        # The collection gets every other chosen node.
        for k in chosen[::2]:
            _tag(nodes[k])
        return Forward(ys=ys, xs=xs, checkpoints=[nodes[k] for k in chosen])

    return Model(f"random_dag_{seed}", _variables_from(inputs), forward)


# ----------------------------------------------------------------------------
# the zoo

BUILDERS = (
    build_mlp,
    build_residual_mlp_kwargs,
    build_cnn,
    build_resnet_bn,
    build_resnet_fused_bn,
    build_unet,
    build_transformer,
    build_seq_dense,
    build_sequence_slices,
    build_embedding,
    build_dropout_stateful,
    build_dropout_stateless,
    build_rnn_while,
    build_cond_chain,
    build_nested_function,
    build_float16_chain,
    build_bfloat16_chain,
    build_two_losses,
    build_grad_ys,
    build_stop_gradients,
    build_tensor_in_xs,
    build_unconnected_none,
    build_unconnected_zero,
    build_keras_layers,
)

ZOO = {model.name: model for model in (build() for build in BUILDERS)}
