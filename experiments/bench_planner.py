"""Planning time on 1000- and 10,000-op graphs (no TensorFlow run).

Targets: ``'memory'`` plans 1000 ops in under 0.3 s; ``memory_budget=``
plans 1000 ops in under 1 s and 10,000 in under 10 s. Graphs are
hand-built (tests/handgraphs.py): a heterogeneous chain and a random DAG
with skips. Each planning starts from a fresh :class:`memsave.problem.Problem`
(the costs included) and ends with the Plan, timed in wall and CPU
seconds (the shared machine's load inflates wall time; CPU time holds):

* ``memory``: the ``'memory'`` planner;
* ``@f``: ``memory_budget=f`` (a fraction of the forecast plain peak), the
  ``auto`` solver (``greedy`` at these sizes), with the Plan's solver, its
  forecast peak as a fraction of plain's and its recompute cost;
* ``min``: an infeasible budget (1 byte): every plan of greedy's family
  simulated, the error path that reports the smallest peak.

Then how many schedules each planning built and how many plans it
simulated (:attr:`Problem.schedules`, :attr:`Problem.simulations`): what
the time goes to, counted without this machine's noise. Then ``dp`` and
``milp`` on a few cuts (``--exact-cuts``) of the 1000-op graphs, for
reference.

Usage: .venv/bin/python experiments/bench_planner.py [--sizes 1000 10000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import handgraphs as H  # noqa: E402

from memsave import planners  # noqa: E402
from memsave.candidates import coarsen  # noqa: E402
from memsave.errors import MemoryBudgetError  # noqa: E402
from memsave.planners import budget as B  # noqa: E402
from memsave.planners.segments import Segments  # noqa: E402
from memsave.problem import Problem  # noqa: E402

FRACTIONS = (0.9, 0.75, 0.6)


def timed(fn):
    """(result or the MemoryBudgetError, wall s, CPU s)."""
    t, c = time.perf_counter(), time.process_time()
    try:
        out = fn()
    except MemoryBudgetError as e:
        out = e
    return out, time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--exact-cuts", type=int, default=6)
    ap.add_argument("--milp-time-limit", type=float, default=10.0)
    args = ap.parse_args()
    head = f"{'memory':>24}" + "".join(f"{f'@{f:g}':>34}" for f in args.fractions)
    print(f"{'graph':<7}{'ops':>7}{head}{'min':>24}")
    print(f"{'':<14}{'s  cpu  ckpts':>24}"
          + "".join(f"{'s  cpu  solver  peak  cost':>34}" for _ in args.fractions)
          + f"{'s  cpu  peak':>24}")
    counts = []  # (graph, ops, [(schedules, simulations) per planning])
    for n in args.sizes:
        for kind, build in (("chain", H.random_chain), ("dag", H.random_dag)):
            fg = build(random.Random(0), n)
            made = []

            def problem() -> Problem:
                made.append(Problem(fg))
                return made[-1]

            plan, dt, dc = timed(lambda: planners.run("memory", problem()))
            cells = [f"{dt:6.2f} {dc:5.2f} {len(plan.checkpoint_ids):5d}"]
            for frac in args.fractions:
                plan, dt, dc = timed(lambda: planners.run("auto", problem(), budget=frac))
                if isinstance(plan, MemoryBudgetError):
                    cells.append(f"{dt:6.2f} {dc:5.2f} infeasible")
                else:
                    cells.append(f"{dt:6.2f} {dc:5.2f} {plan.solver:>6} "
                                 f"{plan.predicted_peak_bytes / plan.baseline_peak_bytes:5.2f} "
                                 f"{plan.recompute_cost:>8}")
            err, dt, dc = timed(lambda: planners.run("auto", problem(), budget=1))
            counts.append((kind, n, [(p.schedules, p.simulations) for p in made]))
            cells.append(f"{dt:6.2f} {dc:5.2f} {err.min_peak_bytes / made[-1].peak(None):5.2f}")
            print(f"{kind:<7}{n:>7}{cells[0]:>24}" + "".join(f"{c:>34}" for c in cells[1:-1])
                  + f"{cells[-1]:>24}", flush=True)
    print("\nschedules built / plans simulated (plain included) by each planning:")
    print(f"{'graph':<7}{'ops':>7}" + "".join(
        f"{c:>12}" for c in ["memory", *(f"@{f:g}" for f in args.fractions), "min"]))
    for kind, n, row in counts:
        print(f"{kind:<7}{n:>7}" + "".join(f"{f'{s} / {m}':>12}" for s, m in row))
    print("\nexact solvers on a few cuts of the 1000-op graphs (s, recompute cost):")
    for kind, build in (("chain", H.random_chain), ("dag", H.random_dag)):
        fg = build(random.Random(0), 1000)
        problem = Problem(fg)
        cuts = coarsen(fg, problem.costs, problem.keepable(), args.exact_cuts)
        budget = int(0.75 * problem.peak(None))
        row = []
        for name in ("greedy", "dp", "milp"):
            space = Segments(Problem(fg), cuts)
            if name == "dp" and not B.is_chain(space):
                row.append(f"{name} (not a chain)")
                continue
            t = time.perf_counter()
            out = B.CORES[name](space, budget, time_limit_s=args.milp_time_limit)
            ev = out.evaluation
            row.append(f"{name} {time.perf_counter() - t:.2f}s {ev.recompute_cost}"
                       f"{'' if ev.peak_bytes <= budget else ' (infeasible)'}"
                       f"{' optimal' if out.optimal else ''}")
        print(f"  {kind} ({args.exact_cuts} cuts, budget 0.75): " + "; ".join(row))


if __name__ == "__main__":
    main()
