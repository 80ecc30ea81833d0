"""Check that two versions of the memory simulator give the same answers.

A change to ``memsave/simulate.py`` that should change no forecast (a
speed-up) is run here against the simulator at a git revision
(``--against``, loaded from git into a module of its own): on seeded
random graphs it compares, for every case, everything the simulator
answers: the :class:`~memsave.simulate.MemoryTrace` of ``simulate``
(peak, resident and end bytes, peak event, backward start, timeline), with
and without ``timeline``, ``gradients_kept`` both ways, with and without a
shared ``forward=``, and the program ``_build`` returns (values, views,
residents, reads, writes, labels), which the dp solver reads.

Graphs:

- ``chain`` and ``dag``: tests/handgraphs.py's ``random_chain`` and
  ``random_dag`` (one x, MiB-sized tensors);
- ``weighted``: random graphs with weights (sources read through
  ReadVariableOp views, so weight gradients and their overlap with the next
  kernel), in-place and scratch ops, gradients with early values, folded
  constants, small tensors the CPU allocator does not count, tensors of
  unknown size, several ys and an activation among the xs;
- ``zoo``: the models of tests/zoo.py (calls, loops, conditionals, custom
  gradients, stop_gradients) read from TensorFlow graphs (``--zoo``).

Memory models: the CPU (oneDNN) and BFC allocators, weight gradient overlap
0, 1 and 2, early gradient values off and on, XLA graphs. Schedules: plain
backprop and random sets of checkpoints (some ops differentiated in place).

Usage::

    .venv/bin/python experiments/simulate_differential.py --against REV [--graphs 40] [--zoo]

Prints the number of cases compared and each mismatch; exits 1 on one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import handgraphs as H  # noqa: E402

import memsave.simulate as new  # noqa: E402
from memsave import candidates  # noqa: E402
from memsave.costs import estimate_costs  # noqa: E402
from memsave.graph import GradientUse  # noqa: E402
from memsave.memory_model import BFC, CPU_ONEDNN, MemoryModel  # noqa: E402
from memsave.schedule import build_schedule  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20


def weighted_graph(rs: random.Random, n: int):
    """A random graph with weights: see the module docstring."""
    b = H.Builder()
    sizes = (64 * KiB, 300 * KiB, MiB, 3 * MiB, 12 * MiB)
    h = b.source("x", size_bytes=rs.choice(sizes))
    live = [h]
    weights = 0
    for i in range(n):
        kind = rs.random()
        size = rs.choice(sizes)
        src = live[-1] if rs.random() < 0.7 else rs.choice(live)
        if kind < 0.3:  # a weight read through a view, and a matmul
            w = b.source(f"w{weights}", size_bytes=rs.choice(sizes))
            weights += 1
            read = b.op(f"read{i}", "ReadVariableOp", [w],
                        size_bytes=b.tensors[b.ids[w]].size_bytes,
                        gradient=GradientUse((), (), (0,)))
            out = b.op(f"op{i}", rs.choice(("MatMul", "Conv2D")), [src, read], size_bytes=size)
        elif kind < 0.45:  # a skip: AddV2, in place, pass-through
            other = rs.choice(live)
            out = b.op(f"op{i}", "AddV2", [src, other],
                       size_bytes=b.tensors[b.ids[src]].size_bytes)
        elif kind < 0.6:  # elementwise, in place, reading its output
            out = b.op(f"op{i}", rs.choice(("Tanh", "Relu", "Sigmoid")), [src],
                       size_bytes=b.tensors[b.ids[src]].size_bytes)
        elif kind < 0.68:  # a view, and sometimes an in-place op reading it beside its source
            out = b.op(f"op{i}", rs.choice(("Identity", "Reshape")), [src],
                       size_bytes=b.tensors[b.ids[src]].size_bytes)
            if rs.random() < 0.5:
                live.append(out)
                out = b.op(f"sum{i}", rs.choice(("AddV2", "Mul")), [src, out],
                           size_bytes=b.tensors[b.ids[src]].size_bytes)
        elif kind < 0.76:  # a gradient with an early value (Erfc-like)
            out = b.op(f"op{i}", "Erfc", [src], size_bytes=size,
                       gradient=GradientUse((0,), (), (None,), early_bytes=(size,),
                                            early_from=(((0,), ()),)))
        elif kind < 0.82:  # two outputs
            outs = b.op(f"op{i}", "Split", [src], n_out=2, size_bytes=size,
                        gradient=GradientUse((), (), (None,)))
            live.append(outs[1])
            out = outs[0]
        elif kind < 0.87:  # an Einsum: scratch
            other = rs.choice(live)
            out = b.op(f"op{i}", "Einsum", [src, other], size_bytes=size,
                       gradient=GradientUse((0, 1), (), (None, None)))
        elif kind < 0.92:  # a gradient reading nothing: Grappler may fold it
            out = b.op(f"op{i}", "Mean", [src], size_bytes=rs.choice((4, 1024, 64 * KiB)),
                       gradient=GradientUse((), (), (None,)))
        elif kind < 0.96:  # an op reading one tensor twice (x * x)
            out = b.op(f"op{i}", "Mul", [src, src], size_bytes=b.tensors[b.ids[src]].size_bytes)
        else:  # a non-differentiable or non-recomputable op
            out = b.op(f"op{i}", "Mul", [src], size_bytes=size,
                       recomputable=rs.random() < 0.5, trainable=rs.random() < 0.8)
        live.append(out)
    consumed = {t for op in b.ops for t in op.inputs}
    ys = [t for t in live[1:] if b.ids[t] not in consumed]
    rs.shuffle(ys)
    ys = ys[:rs.randint(1, 3)]
    xs = ["x"] + [f"w{j}" for j in range(weights)]
    if rs.random() < 0.3 and len(live) > 3:
        xs.append(live[rs.randrange(1, len(live) - 1)])  # an activation given as x
    fg = b.build(xs, ys)
    if rs.random() < 0.3:  # some sizes unknown (not folded into constants)
        tensors = tuple(dataclasses.replace(node, size_known=rs.random() < 0.8)
                        for node in fg.tensors)
        fg = dataclasses.replace(fg, tensors=tensors)
    return fg


def zoo_graphs():
    """The ForwardGraphs of tests/zoo.py's models."""
    import tensorflow as tf

    import zoo
    from memsave import _tf_private
    from memsave.extract import extract

    out = []
    for name, model in zoo.ZOO.items():
        graph = tf.Graph()
        with graph.as_default():
            fwd = model.forward(model.make_variables())
            ys = fwd.ys if isinstance(fwd.ys, (list, tuple)) else [fwd.ys]
            xs = _tf_private.convert_xs(list(fwd.xs))
            stops = fwd.stop_gradients or []
            stops = stops if isinstance(stops, (list, tuple)) else [stops]
            out.append((name, extract(list(ys), list(xs), stops).fg))
    return out


def schedules(fg, rs: random.Random, count: int):
    """None (plain backprop) and up to ``count`` schedules of random checkpoints."""
    out = [None]
    keep = candidates.keepable(fg)
    for _ in range(count):
        if not keep:
            break
        chosen = tuple(sorted(rs.sample(keep, rs.randint(1, max(1, len(keep) // 3)))))
        in_place = ()
        if rs.random() < 0.3:
            in_place = tuple(sorted(rs.sample(range(len(fg.ops)), min(3, len(fg.ops)))))
        try:
            out.append(build_schedule(fg, chosen, in_place=in_place))
        except Exception:  # a random choice the schedule rejects
            continue
    return out


MODELS = [MemoryModel(allocator=a, weight_gradient_overlap=o, early_gradient_values=e)
          for a in (CPU_ONEDNN, BFC) for o in (0, 1, 2) for e in (False, True)]


def _trace(t) -> tuple:
    return (t.peak_bytes, t.resident_bytes, t.end_bytes, t.peak_event, t.backward_start,
            t.timeline)


def _program(built) -> tuple:
    p, resident_bytes, backward_start = built
    return (p.size, p.alias, list(p.resident), p.reads, p.writes,
            [(kind.name, ref) for kind, ref in p.labels], p.pinned, resident_bytes,
            backward_start)


def compare(name: str, fg, old, rs: random.Random, n_schedules: int) -> tuple[int, list[str]]:
    cases, bad = 0, []
    graphs = [fg] + ([dataclasses.replace(fg, xla=True)] if rs.random() < 0.3 else [])
    for g in graphs:
        scheds = schedules(g, rs, n_schedules)
        for model in rs.sample(MODELS, 4):
            costs = estimate_costs(g, early_gradient_values=model.early_gradient_values)
            fw_old = old.forward_program(g, costs, model)
            fw_new = new.forward_program(g, costs, model)
            for s in scheds:
                cases += 1
                if _program(old._build(g, s, costs, model, fw_old)) != _program(
                        new._build(g, s, costs, model, fw_new)):
                    bad.append(f"{name} xla={g.xla} {model}: _build differs")
                for timeline in (False, True):
                    for kept in (True, False):
                        extra = rs.choice((0, 0, 5 * MiB))
                        shared = rs.random() < 0.7
                        a = old.simulate(g, s, costs, model=model, timeline=timeline,
                                         forward=fw_old if shared else None,
                                         gradients_kept=kept, extra_resident_bytes=extra)
                        b = new.simulate(g, s, costs, model=model, timeline=timeline,
                                         forward=fw_new if shared else None,
                                         gradients_kept=kept, extra_resident_bytes=extra)
                        cases += 1
                        if _trace(a) != _trace(b):
                            bad.append(f"{name} xla={g.xla} {model} timeline={timeline} "
                                       f"kept={kept}: {_trace(a)[:5]} != {_trace(b)[:5]}")
    return cases, bad


def main() -> None:
    from bench_simulate import load_simulator

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision of the other simulator")
    ap.add_argument("--graphs", type=int, default=40, help="random graphs of each kind")
    ap.add_argument("--schedules", type=int, default=4, help="random schedules per graph")
    ap.add_argument("--zoo", action="store_true", help="also the TensorFlow zoo models")
    args = ap.parse_args()
    old = load_simulator(args.against)
    rs = random.Random(0)
    graphs = []
    for seed in range(args.graphs):
        g = random.Random(seed)
        graphs.append((f"chain{seed}", H.random_chain(g, g.randint(2, 60))))
        graphs.append((f"dag{seed}", H.random_dag(g, g.randint(2, 80))))
        graphs.append((f"weighted{seed}", weighted_graph(g, g.randint(2, 80))))
    if args.zoo:
        graphs += zoo_graphs()
    total, mismatches = 0, []
    for name, fg in graphs:
        cases, bad = compare(name, fg, old, rs, args.schedules)
        total += cases
        mismatches += bad
    for m in mismatches[:50]:
        print("MISMATCH", m)
    print(f"{total} cases on {len(graphs)} graphs: {total - len(mismatches)} equal, "
          f"{len(mismatches)} differ")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
