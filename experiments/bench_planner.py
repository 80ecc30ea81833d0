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

Measured on main after the perf merge and greedy's walks (2026-12-01, the
2 cores otherwise idle, load average 0.9), seconds per planning, wall then
CPU, costs to answer ("infeasible": the budget is below the smallest peak,
the error path):

    graph    ops    @0.9         @0.75        @0.6         min (every plan simulated)
    chain   1000    0.12 0.12    0.16 0.16    0.26 0.26    0.60 0.59
    dag     1000    0.32 0.32    (0.75, 0.6: infeasible, min 0.82 of plain: 0.74-0.83)    1.03 1.01
    chain  10000    0.82 0.82    1.20 1.20    1.34 1.34    4.99 4.99
    dag    10000    3.00 3.00    (0.75, 0.6: infeasible, min 0.80 of plain: 9.5-9.9)     8.86 8.84

The perf work changed no answer (plans, forecast peaks, recompute costs,
MemoryBudgetError's min_peak_bytes all equal to 7f01b0f's on 25 graphs at
budgets 1.0 to 0.2; CPU seconds main -> perf under the same load: dag 10000
@0.9 12.3 -> 9.4, chain 10000 min 12.7 -> 5.7, dag 1000 @0.9 1.22 -> 0.80).
greedy's family then gained 'memory''s greedy walks (nothing stored), which
did change answers, for the better: the DAGs' smallest peaks went from
0.89 to 0.82 (1000 ops) and 0.888 to 0.80 (10,000), so 0.9 now fits at a
cheaper cost level (10,000-op DAG: 8.9 -> 3.0 s), while the error path
simulates the 3 extra plans (10,000-op DAG: 8.5-9.1 -> 8.9-9.9 s, at the
edge of the 10 s target; 1000-op DAG: 0.87 -> 1.03 s). On the DAG the
skips are everywhere, so an infeasible budget simulates every plan of the
family to find the smallest peak. Each plan
keeps about 5,000 tensors in about 1,700 backward steps (31,000
simulator instructions); per plan, about 65 ms of CPU build the schedule,
110 ms build the simulator's program and 40 ms replay it. Faster needs
fewer simulations (an exact bound, or simulating only what differs between
plans of one stored set), not a faster loop.
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
                                 f"{r.predicted_peak_bytes / r.budget_bytes * frac:5.2f} {r.recompute_cost:>8}")
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
            cells.append(f"{dt:6.2f} {dc:5.2f} {low / p.plain.peak_bytes:5.2f}")
            print(f"{kind:<7}{n:>7}" + "".join(f"{c:>30}" for c in cells[:-1]) + f"{cells[-1]:>18}",
                  flush=True)
    print("\nexact solvers on a few cuts of the 1000-op graphs (s, recompute cost):")
    for kind, build in (("chain", H.random_chain), ("dag", H.random_dag)):
        fg = build(random.Random(0), 1000)
        costs = estimate_costs(fg)
        full = Problem.default_candidates(fg)
        sub = Problem(fg, costs, coarsen(fg, costs, full, args.exact_cuts))
        budget = int(0.75 * sub.plain.peak_bytes)
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
