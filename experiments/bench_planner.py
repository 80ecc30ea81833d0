"""Planning time of ``memory_budget=`` on 1000- and 10,000-op graphs (no TensorFlow run).

Targets (issue 9): under 1 s for 1000 ops, under 10 s for 10,000 ops, on the
fast path. Graphs are hand-built (tests/handgraphs.py): a heterogeneous chain
and a random DAG with skips. The fast path is what ``memory_budget=`` runs:
:func:`memsave.budget.plan_for_budget` (candidate cuts coarsened to
``memsave.solvers.MAX_CUTS``, the ``auto`` solver: ``greedy`` at these
sizes), timed from the costs to the answer, one fresh planning per budget
(fractions of the forecast plain peak). The ``min`` column times an
infeasible budget (every plan of greedy's family simulated: the error path,
which reports the smallest peak). Then ``dp`` and ``milp`` on a few cuts
(``--exact-cuts``) of the 1000-op graphs, for reference.

Usage: .venv/bin/python experiments/bench_planner.py [--sizes 1000 10000]

Measured on main after the merges of 2026-12-01 (2 cores, the test suite
running beside it, so times are inflated; seconds per planning, costs to
answer; the DAG's candidates are now the tensors crossing the topological
cuts 'memory' plans with, coarsened to MAX_CUTS):

    graph    ops    @0.9   @0.75   @0.6   min (every plan simulated)
    chain   1000    0.12   0.38   0.31   1.25
    dag     1000    0.95   (0.75, 0.6: infeasible, min 0.89 of plain, 0.95)
    chain  10000    0.97   1.79   2.76   11.5
    dag    10000    13.3   (0.75, 0.6: infeasible, 8.4-12.1)   8.7

The chain meets both targets on the fast path, the 1000-op DAG the 1 s
one; the 10,000-op DAG does not (skips everywhere, so no plan saves more
than 11% and nearly every plan of greedy's family is simulated before one
fits: about 35 plans at 0.4-0.7 s each, half of it build_schedule and half
the simulator's replay).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import handgraphs as H  # noqa: E402

from memsave.budget import plan_for_budget  # noqa: E402
from memsave.costs import estimate_costs  # noqa: E402
from memsave.errors import MemoryBudgetError  # noqa: E402
from memsave.solvers import Problem, coarsen, solve  # noqa: E402

FRACTIONS = (0.9, 0.75, 0.6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--exact-cuts", type=int, default=6)
    ap.add_argument("--milp-time-limit", type=float, default=10.0)
    args = ap.parse_args()
    head = "".join(f"{f'@{f:g}':>30}" for f in args.fractions)
    print(f"{'graph':<7}{'ops':>7}{head}{'min':>18}")
    print(f"{'':<14}" + "".join(f"{'s  cpu  solver  peak  cost':>30}" for _ in args.fractions)
          + f"{'s  cpu  peak':>18}")
    for n in args.sizes:
        for kind, build in (("chain", H.random_chain), ("dag", H.random_dag)):
            fg = build(random.Random(0), n)
            cells = []
            for frac in args.fractions:
                t, c = time.perf_counter(), time.process_time()
                costs = estimate_costs(fg)
                try:
                    bp = plan_for_budget(fg, costs, frac, api="bench")
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                    r = bp.result
                    cells.append(f"{dt:6.2f} {dc:5.2f} {r.solver:>6} "
                                 f"{r.predicted_peak_B / r.budget_B * frac:5.2f} {r.recompute_cost:>8}")
                except MemoryBudgetError as e:
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                    cells.append(f"{dt:6.2f} {dc:5.2f} infeasible (min {e.min_peak_bytes})")
            t, c = time.perf_counter(), time.process_time()
            costs = estimate_costs(fg)
            try:
                plan_for_budget(fg, costs, 1, api="bench")  # 1 byte: every plan simulated
            except MemoryBudgetError as e:
                low = e.min_peak_bytes
            dt, dc = time.perf_counter() - t, time.process_time() - c
            p = Problem(fg, costs, coarsen(fg, costs, Problem.default_candidates(fg), 96))
            cells.append(f"{dt:6.2f} {dc:5.2f} {low / p.plain.peak_B:5.2f}")
            print(f"{kind:<7}{n:>7}" + "".join(f"{c:>30}" for c in cells[:-1]) + f"{cells[-1]:>18}",
                  flush=True)
    print("\nexact solvers on a few cuts of the 1000-op graphs (s, recompute cost):")
    for kind, build in (("chain", H.random_chain), ("dag", H.random_dag)):
        fg = build(random.Random(0), 1000)
        costs = estimate_costs(fg)
        full = Problem.default_candidates(fg)
        sub = Problem(fg, costs, coarsen(fg, costs, full, args.exact_cuts))
        budget = int(0.75 * sub.plain.peak_B)
        row = []
        for name in ("greedy", "dp", "milp"):
            if name == "dp" and kind != "chain":
                row.append(f"{name} (not a chain)")
                continue
            p = Problem(fg, costs, sub.candidates)
            t = time.perf_counter()
            r = solve(p, budget, solver=name, time_limit_s=args.milp_time_limit)
            row.append(f"{name} {time.perf_counter() - t:.2f}s {r.recompute_cost}"
                       f"{'' if r.feasible else ' (infeasible)'}{' optimal' if r.optimal else ''}")
        print(f"  {kind} ({args.exact_cuts} cuts, budget 0.75): " + "; ".join(row))


if __name__ == "__main__":
    main()
