"""Planning time of the budget solvers on 1000- and 10,000-op graphs (no TensorFlow run).

Targets (issue 9): under 1 s for 1000 ops, under 10 s for 10,000 ops, on the
fast path. Graphs are hand-built (tests/handgraphs.py): a heterogeneous chain
and a random DAG with skips. Each solver plans at a budget half-way between
the plain peak and greedy's smallest peak; ``dp`` and ``milp`` run on a
subset of the candidate cuts (``--dp-cuts``, ``--milp-cuts``; ``auto`` gives
them at most ``memsave.solvers.DP_MAX_CUTS`` / ``MILP_MAX_CUTS``). The greedy
column times the first solve (the family's simulations; a second budget on
the same Problem reuses them). Prints one row per graph, solvers side by side (seconds, and the
recompute cost found).

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

from memsave.costs import estimate_costs  # noqa: E402
from memsave.solvers import DP_MAX_CUTS, MILP_MAX_CUTS, Problem, solve  # noqa: E402


def _subset(cands, k):
    if len(cands) <= k:
        return list(cands)
    step = len(cands) / k
    return [cands[int(i * step)] for i in range(k)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--milp-time-limit", type=float, default=10.0)
    ap.add_argument("--dp-cuts", type=int, default=6, help=f"<= DP_MAX_CUTS={DP_MAX_CUTS}")
    ap.add_argument("--milp-cuts", type=int, default=6, help=f"<= MILP_MAX_CUTS={MILP_MAX_CUTS}")
    args = ap.parse_args()
    print(f"{'graph':<14}{'ops':>7}  {'problem':>8}  {'greedy':>16}  {'dp':>16}  {'milp':>16}")
    for n in args.sizes:
        for kind, build in (("chain", H.random_chain), ("dag", H.random_dag)):
            fg = build(random.Random(0), n)
            t = time.perf_counter()
            costs = estimate_costs(fg)
            full = Problem(fg, costs)
            t_problem = time.perf_counter() - t
            t = time.perf_counter()
            lo = solve(full, 0, solver="greedy").predicted_peak_B  # greedy's smallest peak
            budget = (lo + full.plain.peak_B) // 2
            g = solve(full, budget, solver="greedy")  # the family is cached: a second pick
            t_greedy = time.perf_counter() - t + t_problem  # both solves
            cells = [f"{t_greedy:6.2f}s {g.recompute_cost:>8}"]
            for name, k in (("dp", args.dp_cuts), ("milp", args.milp_cuts)):
                t = time.perf_counter()
                sub = Problem(fg, costs, _subset(full.candidates, k))
                if name == "dp" and kind != "chain":
                    cells.append(f"{'(not a chain)':>16}")
                    continue
                r = solve(sub, budget, solver=name, time_limit_s=args.milp_time_limit)
                dt = time.perf_counter() - t + t_problem
                mark = "" if r.feasible else " inf"
                cells.append(f"{dt:6.2f}s {r.recompute_cost:>8}{mark}")
            print(f"{kind:<14}{n:>7}  {t_problem:7.2f}s  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
