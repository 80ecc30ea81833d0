"""ForwardGraphs built by hand, for the TF-free tests of strategies and schedule.

A :class:`Builder` names every tensor; ``op("a", "Tanh", ["x"])`` adds op
``a`` reading tensor ``x`` and returns the name of its output, ``"a:0"``.
Ops are numbered in the order they are added, which must be topological (the
ForwardGraph checks it). ``build(xs, ys)`` returns the graph; ``ids`` and
``names`` translate between tensor names and ids so that expected answers
can be written with names.

The shapes used by several tests (chain, residual block, U-Net) are here;
the random DAGs are in tests/test_schedule.py, next to their oracle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memsave.graph import ForwardGraph, GradientUse, OpNode, TensorNode

#: Bytes of every tensor unless a test says otherwise (a [1024, 256] float32).
MiB = 1 << 20

#: What the gradients of common op types read, as TensorFlow's registered
#: gradients do (tests/test_costs.py checks these against TensorFlow).
READS_OUTPUT = ("Tanh", "Relu", "Sigmoid", "Softmax")
READS_INPUTS = ("MatMul", "Conv2D", "Conv2DBackpropInput", "Mul")
PASS_THROUGH = ("AddV2", "Add")
VIEWS = ("Identity", "Reshape")


def gradient_use(type: str, n_in: int) -> GradientUse:
    """The GradientUse TensorFlow learns for ``type`` (a few common types)."""
    if type in READS_OUTPUT:
        return GradientUse((), (0,), (None,) * n_in)
    if type in PASS_THROUGH:
        return GradientUse((), (), (0,) * n_in)
    if type in VIEWS:
        return GradientUse((), (), (0,) + (None,) * (n_in - 1))
    if type in READS_INPUTS:
        return GradientUse(tuple(range(n_in)), (), (None,) * n_in)
    return GradientUse((), (), (None,) * n_in)  # Mean, Identity, ...


class Builder:
    """Add tensors and ops in topological order, then :meth:`build`."""

    def __init__(self) -> None:
        self.tensors: list[TensorNode] = []
        self.ops: list[OpNode] = []
        self.ids: dict[str, int] = {}

    def _tensor(self, name, kind, producer=None, *, size_bytes=MiB, trainable=True, tagged=False):
        if name in self.ids:
            raise ValueError(f"tensor {name!r} already exists")
        i = len(self.tensors)
        self.tensors.append(TensorNode(
            id=i, name=name, kind=kind, producer=producer, size_bytes=size_bytes,
            size_known=True, trainable=trainable, tagged=tagged,
        ))
        self.ids[name] = i
        return name

    def source(self, name: str, **kw) -> str:
        """An x that no op of the graph produces (a variable handle, a placeholder)."""
        return self._tensor(name, "source", **kw)

    def external(self, name: str, **kw) -> str:
        """A tensor not reachable from any x (input data, a constant)."""
        return self._tensor(name, "external", trainable=kw.pop("trainable", False), **kw)

    def op(
        self,
        name: str,
        type: str,
        inputs: Sequence[str],
        *,
        n_out: int = 1,
        recomputable: bool = True,
        size_bytes: int = MiB,
        trainable: bool = True,
        tagged: bool = False,
        gradient: GradientUse | None = None,
        flops: int | None = None,
    ):
        """Add an op; return its output name (a list of names if ``n_out > 1``).

        ``gradient`` defaults to :func:`gradient_use` of ``type``; ``flops``
        to None (the cost model then counts the elements produced, 0 for
        hand-built tensors, which have no itemsize).
        """
        index = len(self.ops)
        outs = [
            self._tensor(f"{name}:{j}", "internal", index, size_bytes=size_bytes,
                         trainable=trainable, tagged=tagged)
            for j in range(n_out)
        ]
        self.ops.append(OpNode(
            index=index, name=name, type=type,
            inputs=tuple(self.ids[t] for t in inputs),
            outputs=tuple(self.ids[t] for t in outs),
            recomputable=recomputable,
            flops=flops,
            gradient=gradient if gradient is not None else gradient_use(type, len(inputs)),
        ))
        return outs[0] if n_out == 1 else outs

    def build(self, xs: Iterable[str], ys: Iterable[str]) -> ForwardGraph:
        return ForwardGraph(
            ops=tuple(self.ops), tensors=tuple(self.tensors),
            xs=tuple(self.ids[x] for x in xs), ys=tuple(self.ids[y] for y in ys),
        )


def names(fg: ForwardGraph, ids: Iterable[int]) -> list[str]:
    """Tensor names of ``ids``, in the given order."""
    return [fg.tensors[i].name for i in ids]


def op_names(fg: ForwardGraph, indices: Iterable[int]) -> list[str]:
    """Op names of op ``indices``, in the given order."""
    return [fg.ops[i].name for i in indices]


def chain(n: int, *, type: str = "Tanh", size_bytes: int = MiB) -> ForwardGraph:
    """x -> op0 -> op1 -> ... -> op{n-1} = y; op i outputs ``f"op{i}:0"``."""
    b = Builder()
    h = b.source("x")
    for i in range(n):
        h = b.op(f"op{i}", type, [h], size_bytes=size_bytes)
    return b.build(["x"], [h])


def residual_block() -> ForwardGraph:
    """pre -> [a -> b -> c] + skip -> add -> post -> y.

    ::

        x -> pre -> a ------------> add -> post -> head = y
                    |-> b -> c ----^

    ``a``'s output feeds both ``b`` and ``add`` (the skip connection), so
    ``b`` and ``c`` are bypassed; ``a`` (block input) and ``add`` (block
    output) are what the graph cannot do without.
    """
    b = Builder()
    x = b.source("x")
    pre = b.op("pre", "MatMul", [x])
    a = b.op("a", "Relu", [pre])
    b1 = b.op("b", "Conv2D", [a])
    c = b.op("c", "Relu", [b1])
    add = b.op("add", "AddV2", [a, c])
    post = b.op("post", "Relu", [add])
    y = b.op("head", "MatMul", [post])
    return b.build(["x"], [y])


def unet() -> ForwardGraph:
    """A U-Net-like graph: a long skip from e1 to d1 around a short skip.

    ::

        x -> stem -> e1 -> e2 -> e3 -> mid -> d2 = mid + e2 -> up -> d1 = up + e1
                                                               -> out -> head = y
    """
    b = Builder()
    x = b.source("x")
    stem = b.op("stem", "Conv2D", [x])
    e1 = b.op("e1", "Conv2D", [stem])
    e2 = b.op("e2", "Conv2D", [e1])
    e3 = b.op("e3", "Conv2D", [e2])
    mid = b.op("mid", "Relu", [e3])
    d2 = b.op("d2", "AddV2", [mid, e2])
    up = b.op("up", "Conv2DBackpropInput", [d2])
    d1 = b.op("d1", "AddV2", [up, e1])
    out = b.op("out", "Conv2D", [d1])
    y = b.op("head", "Mean", [out])
    return b.build(["x"], [y])


#: Op types of the random graphs: gradients that read the output (in place,
#: elementwise), the inputs (MatMul, Conv2D, Mul) or nothing (AddV2's
#: pass-through), as tests/test_costs.py checks against TensorFlow.
RANDOM_OP_TYPES = ("Tanh", "Relu", "Sigmoid", "MatMul", "Conv2D", "Mul")


def random_chain(rs, n: int, *, sizes=(1, 2, 3), types=RANDOM_OP_TYPES) -> ForwardGraph:
    """A heterogeneous chain x -> op0 -> ... -> op{n-1} = y: random op types,
    tensor sizes (MiB multiples of ``sizes``) and FLOPs (1-100), from the
    ``random.Random`` ``rs``."""
    b = Builder()
    h = b.source("x", size_bytes=rs.choice(sizes) * MiB)
    for i in range(n):
        h = b.op(f"op{i}", rs.choice(types), [h], size_bytes=rs.choice(sizes) * MiB,
                 flops=rs.randint(1, 100))
    return b.build(["x"], [h])


def random_dag(rs, n: int, *, sizes=(1, 2, 3)) -> ForwardGraph:
    """A random DAG of ``n`` ops from the ``random.Random`` ``rs``: one x (an
    input), each op reading one or two recent tensors (chains with skips),
    AddV2 where it reads two; random sizes and FLOPs. The ys are the tensors
    nothing reads."""
    b = Builder()
    live = [b.source("x", size_bytes=rs.choice(sizes) * MiB)]
    for i in range(n):
        k = 2 if (len(live) > 1 and rs.random() < 0.35) else 1
        picks = sorted({len(live) - min(int(rs.expovariate(0.7)) + 1, len(live))
                        for _ in range(k)})
        ins = [live[j] for j in picks]
        typ = "AddV2" if len(ins) == 2 else rs.choice(RANDOM_OP_TYPES)
        live.append(b.op(f"op{i}", typ, ins, size_bytes=rs.choice(sizes) * MiB,
                         flops=rs.randint(1, 100)))
    consumed = {t for op in b.ops for t in op.inputs}
    ys = [f"op{i}:0" for i in range(n) if b.ids[f"op{i}:0"] not in consumed]
    return b.build(["x"], ys)
