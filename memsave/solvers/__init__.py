"""Budget solvers: least recompute cost with forecast peak <= a budget (no TensorFlow).

Every solver has one signature, ``solver(problem, budget_bytes, *,
time_limit_s=None) -> SolveResult``, and is registered by name:

``dp``
    exact dynamic programming on chains of candidate cuts (rotor-like, with
    stored segments that trade memory for time); :mod:`memsave.solvers.dp`.
``milp``
    exact on small graphs: a MILP solved by HiGHS (optional extra
    ``memsave[milp]``, i.e. ``highspy``), seeded with ``greedy``'s plan,
    made exact against the simulator by lazy no-good cuts;
    :mod:`memsave.solvers.milp`.
``greedy``
    fast heuristic for large graphs; never exceeds the budget, monotone;
    :mod:`memsave.solvers.greedy`.

:func:`solve` runs one by name, or chooses by problem size (``"auto"``,
:func:`choose`). A :class:`Problem` bundles the graph, its costs, the
candidate cuts and the cached evaluator (``build_schedule`` + ``simulate``):
the one memory model judges every solver.

Examples
--------
>>> from memsave.costs import estimate_costs  # doctest: +SKIP
>>> problem = Problem(fg, estimate_costs(fg))  # doctest: +SKIP
>>> res = solve(problem, int(0.5 * problem.plain.peak_bytes))  # doctest: +SKIP
>>> res.feasible, res.recompute_cost, res.solver  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

from memsave.solvers.dp import dp
from memsave.solvers.greedy import greedy
from memsave.solvers.milp import milp
from memsave.solvers.problem import Decision, Evaluation, Problem, SolveResult, coarsen

__all__ = [
    "Problem",
    "Decision",
    "Evaluation",
    "SolveResult",
    "Solver",
    "solve",
    "choose",
    "get",
    "available",
    "register",
    "dp",
    "milp",
    "greedy",
    "DP_MAX_CUTS",
    "MILP_MAX_CUTS",
    "MAX_CUTS",
    "coarsen",
]

Solver = Callable[..., SolveResult]

_REGISTRY: dict[str, Solver] = {"dp": dp, "milp": milp, "greedy": greedy}

#: ``auto`` uses ``dp`` on chains with at most this many candidate cuts: its
#: probe simulations grow like cuts squared (about 4 m^2 of them, each a
#: simulation of the whole graph: minutes at 40 cuts of a 1000-op chain).
DP_MAX_CUTS = 12

#: ``auto`` uses ``milp`` (when highspy is installed) on non-chain graphs with
#: at most this many candidate cuts; its lazy cuts may take many rounds
#: beyond that.
MILP_MAX_CUTS = 12


#: Candidate cuts a budget plan chooses from at most (:func:`coarsen` keeps
#: this many, spread evenly over the activation bytes): every simulation
#: walks the whole graph, and the greedy family and its knapsack grow with
#: the cuts; 96 still allows about 2 sqrt(n) checkpoints on graphs of a
#: few thousand ops (measured in experiments/bench_planner.py).
MAX_CUTS = 96


def register(name: str, solver: Solver) -> None:
    """Register ``solver`` under ``name`` (same signature as :func:`dp`)."""
    if name in _REGISTRY or name == "auto":
        raise ValueError(f"memsave.solvers.register: {name!r} is taken")
    _REGISTRY[name] = solver


def available() -> list[str]:
    """Registered solver names (``"auto"`` is also accepted by :func:`solve`)."""
    return sorted(_REGISTRY)


def get(name: str) -> Solver:
    """The solver registered under ``name``."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"memsave.solvers: solver={name!r} is not known; use 'auto' or one of "
            f"{available()}"
        ) from None


def is_chain(problem: Problem) -> bool:
    """Whether the candidates cut the graph into a chain of segments: every
    tensor read across a cut is the cut itself, read by the next segment (or
    resident), and every y is produced in the last segment. The DP's
    locality holds there."""
    fg = problem.fg
    bounds = [fg.tensors[t].producer for t in problem.candidates]
    seg = {}
    k = 0
    for op in fg.ops:
        while k < len(bounds) and op.index > bounds[k]:
            k += 1
        seg[op.index] = k
    cand = set(problem.candidates)
    last = len(bounds)
    for y in fg.ys:  # a y's seed gradient is alive from the start of backprop
        p = fg.tensors[y].producer
        if p is not None and seg[p] != last:
            return False
    for op in fg.ops:
        for t in op.inputs:
            p = fg.tensors[t].producer
            if p is None:
                continue
            if seg[p] != seg[op.index] and not (t in cand and seg[op.index] == seg[p] + 1):
                return False
    return True


def choose(problem: Problem) -> str:
    """The solver ``"auto"`` picks: ``dp`` on small chains, ``milp`` on small
    graphs when highspy is installed, ``greedy`` otherwise."""
    m = len(problem.candidates)
    if m <= DP_MAX_CUTS and is_chain(problem):
        return "dp"
    if m <= MILP_MAX_CUTS:
        try:
            import highspy  # noqa: F401
        except ImportError:
            return "greedy"
        return "milp"
    return "greedy"


def solve(problem: Problem, budget_bytes: int, *, solver: str = "auto",
          time_limit_s: float | None = None) -> SolveResult:
    """Least recompute cost with forecast peak <= ``budget_bytes``.

    Parameters
    ----------
    problem : Problem
    budget_bytes : int
        Forecast peak bytes allowed (variables and inputs included).
    solver : str
        A registered name, or ``"auto"`` (:func:`choose`).
    time_limit_s : float, optional
        Passed to the solver (``milp`` returns its best plan and gap then).

    Returns
    -------
    SolveResult
        ``feasible=False`` when no plan fits; ``predicted_peak_bytes`` is then
        the smallest peak found.
    """
    name = choose(problem) if solver == "auto" else solver
    return get(name)(problem, budget_bytes, time_limit_s=time_limit_s)
