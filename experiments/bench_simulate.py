"""CPU time of the memory simulator, and of the 'memory' planner that runs it.

Two graphs (tf.compat.v1 Graphs, read by :func:`memsave.extract.extract`
with the variables' handles as xs):

- ``chain``: 1000 layers ``tanh(h @ w)``, activations [64, 16], weights
  16x16, loss ``reduce_sum(h * h)`` (3002 forward ops);
- ``resnet``: the study's ResNet-110 (experiments/models.py, n=18), batch 32.

For each graph it times, with ``time.process_time`` (CPU time: the machine
is shared), best of ``--repeats``:

- ``plan``: ``memsave.planners.run("memory", Problem(fg))``, from a fresh
  Problem (its costs included), and the number of simulations it ran;
- ``forward``: building the forward program (``Problem.forward``), once per
  memory model;
- ``sim``: every simulation the planner ran (its schedules and models,
  ``timeline=False``), summed, on a warm forward program;
- ``timeline``: the same schedules with ``timeline=True``.

``--against REV`` also loads ``memsave/simulate.py`` as it is at git
revision REV into a module of its own and times the same work with it,
side by side in this process (the planner through a Problem whose
simulator is that module's), printing the ratio old/new, and checks that
both give the same traces for every simulation timed.

Usage::

    .venv/bin/python experiments/bench_simulate.py [--against REV] [--repeats 3]

Measured against cc93a11 (the simulator before its speed-up), best of 7,
the 2 cores shared (load average about 10), CPU seconds:

    graph    simulator   plan   sims  sim (all)  per sim  timeline (all)
    chain    cc93a11     0.294     8  0.252      0.0314   0.358
    chain    now         0.196     8  0.097      0.0121   0.131     (2.59x, 2.74x)
    resnet   cc93a11     0.118    15  0.090      0.0060   0.146
    resnet   now         0.078    15  0.039      0.0026   0.051     (2.30x, 2.85x)

Under that load the per-simulation ratio moved between 1.7x and 2.6x
from run to run (chain) and 2.2x to 2.5x (resnet). Machine instructions
per simulation (valgrind's callgrind, the planner's simulations replayed
in a process without TensorFlow, deterministic): chain 234.6M -> 94.6M
(2.48x), resnet 67.6M -> 29.3M (2.31x). Planning gains less (1.5x):
building the schedules and finding the candidate cuts now cost about
as much as simulating. The forward program (built once per graph and
memory model) costs a few ms more than before (chain: 6 -> 10 ms): it
now also holds what every simulation reads per op.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import memsave.problem  # noqa: E402
import memsave.simulate  # noqa: E402
from memsave import _tf_private, planners  # noqa: E402
from memsave.extract import extract  # noqa: E402
from memsave.problem import Problem  # noqa: E402


def chain_graph(layers: int = 1000):
    graph = tf.Graph()
    with graph.as_default():
        rs = np.random.RandomState(0)
        ws = [tf.Variable(rs.randn(16, 16).astype(np.float32) * 0.25) for _ in range(layers)]
        h = tf.constant(rs.randn(64, 16).astype(np.float32))
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        xs = _tf_private.convert_xs(ws)
        return extract([loss], xs).fg


def resnet_graph(n: int = 18, batch: int = 32):
    import models

    model = models.MODELS["resnet"]
    graph = tf.Graph()
    with graph.as_default():
        params = {k: tf.Variable(v, name=k.replace("/", "_")) for k, v in model.init(n, 0).items()}
        x_np, y_np = model.batch(batch, 0)
        loss = model.loss(n, params, tf.constant(x_np), tf.constant(y_np), models.Arch())
        xs = _tf_private.convert_xs(list(params.values()))
        return extract([loss], xs).fg


def load_simulator(rev: str):
    """``memsave/simulate.py`` at git revision ``rev``, as a module of its own."""
    root = HERE.parent
    text = subprocess.run(["git", "show", f"{rev}:memsave/simulate.py"], cwd=root,
                          capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("simulate_at_" + rev.replace("/", "_"), loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(text, f"simulate.py@{rev}", "exec"), module.__dict__)
    return module


class _ProblemWith(Problem):
    """A Problem whose forward programs and forecasts come from simulator module ``sim``."""

    sim = memsave.simulate

    def forward(self, model=None):
        model = self.model if model is None else model
        found = self._forward.get(model)
        if found is None:
            with self.sim.paused_gc():
                found = self._forward[model] = self.sim.ForwardProgram(self.fg, self.costs, model)
        return found

    def forecast(self, schedule, *, model=None, gradients_kept=True):
        model = self.model if model is None else model
        key = (None if schedule is None else schedule.steps, model, gradients_kept)
        found = self._forecasts.get(key)
        if found is None:
            found = self._forecasts[key] = self.sim.simulate(
                self.fg, schedule, self.costs, model=model, timeline=False,
                forward=self.forward(model), gradients_kept=gradients_kept,
                extra_resident_bytes=self.extra_resident_bytes)
        return found

    def timeline(self, schedule, *, model=None):
        model = self.model if model is None else model
        key = (None if schedule is None else schedule.steps, model)
        found = self._timelines.get(key)
        if found is None:
            found = self._timelines[key] = self.sim.simulate(
                self.fg, schedule, self.costs, model=model, timeline=True,
                forward=self.forward(model), extra_resident_bytes=self.extra_resident_bytes)
        return found


def problem_class(sim):
    return type("Problem_" + sim.__name__.replace(".", "_"), (_ProblemWith,), {"sim": sim})


def measure(fg, sims, repeats: int) -> list[dict]:
    """CPU seconds (best of ``repeats``) of planning and of its simulations, per simulator
    module in ``sims``; the simulators take turns within each repeat (a load that
    changes during the run weighs on both)."""
    rows = [{"plan": float("inf"), "forward": float("inf"), "sim": float("inf"),
             "timeline": float("inf"), "traces": {}} for _ in sims]
    for _ in range(repeats):
        for sim, r in zip(sims, rows):
            c = time.process_time()
            problem = problem_class(sim)(fg)
            with sim.paused_gc():
                planners.run("memory", problem)
            r["plan"] = min(r["plan"], time.process_time() - c)
            r["problem"] = problem
    # The simulations the planner ran: (schedule, model, gradients_kept).
    problem = rows[-1]["problem"]
    by_steps = {None if s is None else s.steps: s for s in [None, *problem._schedules.values()]}
    schedules = {key: by_steps[key[0]] for key in problem._forecasts}
    models = {key[1] for key in schedules}
    for _ in range(repeats):
        for sim, r in zip(sims, rows):
            r["n_sim"] = len(schedules)
            c = time.process_time()
            forwards = {m: sim.forward_program(fg, problem.costs, m) for m in models}
            r["forward"] = min(r["forward"], time.process_time() - c)
            for timeline in (False, True):
                c = time.process_time()
                for (steps, m, kept), s in schedules.items():
                    r["traces"][(steps, m, kept, timeline)] = sim.simulate(
                        fg, s, problem.costs, model=m, timeline=timeline, forward=forwards[m],
                        gradients_kept=kept)
                key = "timeline" if timeline else "sim"
                r[key] = min(r[key], time.process_time() - c)
    return rows


def _same(a, b) -> bool:
    return (a.peak_bytes, a.resident_bytes, a.end_bytes, a.peak_event, a.backward_start,
            a.timeline) == (b.peak_bytes, b.resident_bytes, b.end_bytes, b.peak_event,
                            b.backward_start, b.timeline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="git revision of the simulator to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graphs", nargs="+", default=["chain", "resnet"])
    args = ap.parse_args()
    sims = [("now", memsave.simulate)]
    if args.against:
        sims.insert(0, (args.against, load_simulator(args.against)))
    builders = {"chain": chain_graph, "resnet": resnet_graph}
    mismatched = 0
    for name in args.graphs:
        fg = builders[name]()
        rows = list(zip([label for label, _ in sims],
                        measure(fg, [sim for _, sim in sims], args.repeats)))
        print(f"\n{name}: {len(fg.ops)} ops, {len(fg.tensors)} tensors; CPU seconds, best of "
              f"{args.repeats}")
        print(f"{'simulator':<12}{'plan':>8}{'sims':>6}{'forward':>9}{'sim':>8}{'per sim':>9}"
              f"{'timeline':>10}")
        for label, r in rows:
            print(f"{label:<12}{r['plan']:8.3f}{r['n_sim']:6d}{r['forward']:9.3f}{r['sim']:8.3f}"
                  f"{r['sim'] / max(r['n_sim'], 1):9.4f}{r['timeline']:10.3f}")
        if len(rows) == 2:
            (_, old), (_, new) = rows
            print(f"{'old/new':<12}" + "".join(
                f"{old[k] / new[k]:{w}.2f}x" for k, w in (("plan", 7), ("forward", 14),
                                                            ("sim", 7))) +
                  f"{old['timeline'] / new['timeline']:18.2f}x")
            same = sum(_same(old["traces"][k], new["traces"][k]) for k in old["traces"])
            mismatched += len(old["traces"]) - same
            print(f"traces equal: {same} of {len(old['traces'])}")
            po, pn = old["problem"], new["problem"]
            if set(po._forecasts) != set(pn._forecasts) or any(
                    not _same(po._forecasts[k], pn._forecasts[k]) for k in po._forecasts):
                mismatched += 1
                print("the planner's forecasts differ")
    sys.exit(1 if mismatched else 0)


if __name__ == "__main__":
    main()
