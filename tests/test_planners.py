"""Every planner through one case table: one signature, one record, nothing planned twice.

A planner is ``(problem, *, budget=None, **options) -> Plan``
(memsave.planners). The table runs each registered planner (the strategies,
the budget solvers), a user's planner registered with
``memsave.planners.register``, a strategy written for
``memsave.strategies.register`` and the user's list, on hand-built graphs,
without a budget and with one, and checks what every planner must do:

* return a :class:`memsave.record.Plan` of the problem it was given, whose
  checkpoints are activations the problem lets a plan keep;
* hand on the schedule it chose: the problem's own cached object, not a
  rebuilt one, whose figures are the simulator's (a fresh simulation of it
  gives the Plan's forecast) and are read from the problem's caches
  (reading them twice simulates nothing);
* with a budget: fit it (or refuse with MemoryBudgetError), and a planner
  that cannot take a budget refuses it with a MemsaveError;
* refuse an option it does not take with an OptionsError naming the ones it does.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

import handgraphs as H
import memsave
from memsave import planners, strategies
from memsave.errors import ArgumentError, MemsaveError, OptionsError
from memsave.memory_model import BFC, MemoryModel
from memsave.planners.segments import Segments
from memsave.planners.strategies import given
from memsave.problem import Problem
from memsave.record import Plan
from memsave.simulate import simulate
from memsave.strategies import Selection

BUDGET_SOLVERS = ("auto", "dp", "milp", "greedy")
#: Planners that take a budget (the strategies hand it to the solver 'auto').
TAKE_BUDGETS = (*BUDGET_SOLVERS, "memory", "collection")


def _tagged_chain(n=12):
    b = H.Builder()
    h = b.source("x")
    for i in range(n):
        h = b.op(f"op{i}", "MatMul" if i % 3 == 0 else "Tanh", [h], tagged=i in (3, 7))
    return b.build(["x"], [h])


GRAPHS = {
    "chain": lambda: H.chain(12),
    "tagged chain": _tagged_chain,
    "residual block": H.residual_block,
    "unet": H.unet,
}


@pytest.fixture(scope="module", autouse=True)
def user_planners():
    """A user's planner and a strategy of the older interface, registered for this module."""

    @planners.register("every_third")
    def every_third(problem, *, budget=None, offset: int = 0):
        if budget is not None:
            raise memsave.CheckpointError("every_third plans without a budget")
        keep = problem.keepable()[offset::3]
        return problem.plan("every_third", keep, {t: "every third" for t in keep})

    @strategies.register("legacy_first_half")
    def first_half(fg, *, costs=None):
        assert costs is not None  # it asked for them
        keep = [t for op in fg.ops[: len(fg.ops) // 2] for t in op.outputs
                if t not in fg.ys and fg.tensors[t].trainable][1:]
        return Selection(tuple(keep), {t: "first half" for t in keep})

    yield
    planners.unregister("every_third")
    planners.unregister("legacy_first_half")


def _run(name, problem, *, budget=None, **options):
    if name == "list":
        return given(problem, problem.keepable()[2::4])
    return planners.run(name, problem, budget=budget, options=options)


NAMES = ["collection", "memory", "speed", *BUDGET_SOLVERS, "every_third", "legacy_first_half",
         "list"]


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("name", NAMES)
def test_a_planner_returns_the_plan_it_chose_and_passes_it_on(name, graph):
    problem = Problem(GRAPHS[graph]())
    if name in BUDGET_SOLVERS:
        with pytest.raises(OptionsError, match="memory_budget"):
            _run(name, problem)
        return
    plan = _run(name, problem, **({"min_saving_fraction": 0.0} if name in ("memory", "speed") else {}))
    assert isinstance(plan, Plan) and plan.problem is problem
    ids = plan.checkpoint_ids
    assert list(ids) == sorted(set(ids)) and set(ids) <= set(problem.keepable())
    assert set(plan.reason_of) >= set(ids)
    if not ids:
        # Nothing kept by choice: plain tf.gradients, with a note saying why;
        # or segments stored whole and the rest recomputed from what they keep.
        assert (plan.schedule is None and plan.note) or plan.schedule.in_place
        if plan.schedule is None:
            return
    # The schedule the planner built is the one handed on: the problem's
    # cached object, not a rebuilt one (with the segments it stores, if any:
    # 'memory' and 'speed' may store some).
    built = problem.schedules
    assert built >= 1
    assert plan.schedule is problem.schedule(ids, plan.schedule.in_place)
    assert problem.schedules == built
    # Its figures are the simulator's, read from the problem's caches.
    fresh = simulate(problem.fg, plan.schedule, problem.costs, model=problem.model, timeline=False)
    assert plan.predicted_peak_bytes == fresh.peak_bytes and plan.baseline_peak_bytes > 0
    before = problem.simulations
    assert (plan.predicted_peak_bytes, plan.baseline_peak_bytes) == (fresh.peak_bytes,
                                                                     problem.peak(None))
    assert problem.simulations == before
    assert plan.recompute_cost == problem.costs.recompute_flops(plan.schedule)
    assert plan.recomputed_ops == plan.schedule.recomputed_ops > 0


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("name", NAMES)
def test_a_budget_is_met_or_refused(name, graph):
    problem = Problem(GRAPHS[graph]())
    plain = problem.peak(None)
    budget = int(0.75 * plain)
    if name == "list":
        return  # a list is checked by memsave.gradients: a budget cannot come with one
    if name not in TAKE_BUDGETS:
        with pytest.raises(MemsaveError, match="budget"):
            _run(name, problem, budget=budget)
        return
    try:
        plan = _run(name, problem, budget=budget)
    except memsave.MemoryBudgetError as e:
        assert e.min_peak_bytes > budget
        return
    assert plan.budget is not None and plan.budget.feasible
    assert plan.budget_bytes == budget and plan.predicted_peak_bytes <= budget
    assert plan.solver in planners.budget.CORES
    if name in planners.budget.CORES:
        assert plan.solver == name
    # A fraction is of the forecast plain peak.
    again = _run(name, Problem(problem.fg), budget=0.75)
    assert again.budget_bytes == int(0.75 * plain)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("list", "legacy_first_half")])
def test_an_unknown_option_names_the_accepted_ones(name):
    with pytest.raises(OptionsError, match="not options of") as info:
        planners.run(name, Problem(H.chain(6)), options={"nope": 1})
    assert isinstance(info.value, TypeError)


def test_solver_options_without_a_budget_are_refused():
    with pytest.raises(OptionsError, match="without a memory_budget"):
        planners.run("memory", Problem(H.chain(6)), options={"solver": "dp"})


@pytest.fixture
def registered():
    """Register planners for one test; unregister them after it."""
    names = []

    def register(name, planner):
        planners.register(name, planner)
        names.append(name)

    yield register
    for name in names:
        planners.unregister(name)


def test_a_planners_plan_must_be_a_plan_of_the_problem_it_was_given(registered):
    other = Problem(H.chain(12))
    foreign = planners.run("memory", other, options={"min_saving_fraction": 0.0})
    registered("foreign", lambda problem, *, budget=None: foreign)
    registered("returns_none", lambda problem, *, budget=None: None)
    registered("returns_ids", lambda problem, *, budget=None: problem.keepable()[::2])
    with pytest.raises(memsave.GraphMismatchError, match="planner 'foreign' returned a Plan of "
                                                         "another forward graph"):
        planners.run("foreign", Problem(H.chain(6)))
    with pytest.raises(ArgumentError, match="planner 'returns_none' returned NoneType"):
        planners.run("returns_none", Problem(H.chain(6)))
    with pytest.raises(ArgumentError, match="planner 'returns_ids' returned list"):
        planners.run("returns_ids", Problem(H.chain(6)))
    # A plan of another problem of an equal graph numbers the same tensors: accepted.
    assert planners.run("foreign", Problem(H.chain(12))) is foreign


@pytest.mark.parametrize("bad", [-1, 10**6, "y", True, 1.0])
def test_a_plan_keeps_tensor_ids_of_its_graph_and_no_y(registered, bad):
    problem = Problem(H.chain(6))
    bad = problem.fg.ys[0] if bad == "y" else bad
    # -1 is not the last tensor (a y), nor is an id past the end any tensor.
    with pytest.raises(memsave.CheckpointError, match=r"problem.plan\('mine', ...\) keeps"):
        problem.plan("mine", (bad,), {bad: "bad"})
    # A Plan built without problem.plan is checked when the planner returns it.
    good = problem.plan("mine", problem.keepable()[:1], {})
    registered("bad_ids", lambda problem, *, budget=None: dataclasses.replace(
        good, checkpoint_ids=(bad,)))
    with pytest.raises(memsave.CheckpointError, match="planner 'bad_ids' keeps"):
        planners.run("bad_ids", problem)


@pytest.mark.parametrize("register", [lambda: planners.register("not_callable", 42),
                                      lambda: strategies.register("not_callable")(42)])
def test_registering_what_is_not_callable_is_refused_at_once(register):
    with pytest.raises(ArgumentError, match="42 for 'not_callable' is not callable"):
        register()
    assert "not_callable" not in planners.available()


def test_a_planner_without_a_budget_keyword_is_refused_at_once():
    """It was registered, and every call then raised a bare TypeError."""
    with pytest.raises(ArgumentError, match="for 'no_budget' takes no budget= keyword"):
        planners.register("no_budget", lambda problem: problem.plan("no_budget", (), {}))
    assert "no_budget" not in planners.available()


def test_a_planner_that_ignores_the_budget_is_refused_above_it(registered):
    @registered_as(registered, "last_only")
    def last_only(problem, *, budget=None):
        keep = problem.keepable()[-1:]
        return problem.plan("last_only", keep, {t: "last" for t in keep})

    problem = Problem(H.chain(12))
    peak = last_only(problem).predicted_peak_bytes
    with pytest.raises(memsave.MemoryBudgetError, match="planner 'last_only' returned a plan "
                                                        "whose forecast peak") as info:
        planners.run("last_only", problem, budget=peak - 1)
    assert info.value.min_peak_bytes == peak
    with pytest.raises(memsave.MemoryBudgetError, match="memory_budget=0.1"):
        planners.run("last_only", problem, budget=0.1)
    # Within the budget, its plan is the planner's.
    kept = planners.run("last_only", problem, budget=peak).checkpoint_ids
    assert kept == tuple(problem.keepable()[-1:])


def registered_as(registered, name):
    """A decorator registering a planner with the ``registered`` fixture."""
    def deco(fn):
        registered(name, fn)
        return fn
    return deco


def test_the_memory_model_is_a_value_of_the_problem():
    # The judge counts every byte; the device's model is the problem's.
    fg = H.chain(8, size_bytes=128 * 1024)
    cpu = Problem(fg)
    bfc = Problem(fg, model=MemoryModel(allocator=BFC))
    # (the 128 KiB activations are under the CPU allocator's 256 KiB floor)
    assert cpu.peak(None) < bfc.peak(None) == cpu.peak(None, model=cpu.judge)
    assert planners.run("memory", cpu).checkpoint_ids == planners.run("memory", bfc).checkpoint_ids


def test_extra_resident_bytes_count_in_every_figure():
    fg = H.chain(12)
    plain, extra = Problem(fg), Problem(fg, extra_resident_bytes=5 * H.MiB)
    a, b = planners.run("memory", plain), planners.run("memory", extra)
    assert b.predicted_peak_bytes == a.predicted_peak_bytes + 5 * H.MiB
    assert b.baseline_peak_bytes == a.baseline_peak_bytes + 5 * H.MiB
    assert b.resident_bytes == a.resident_bytes + 5 * H.MiB
    assert any("5,242,880 bytes" in s for s in b.assumptions)
    # A fraction of the budget is of the whole step, extra bytes included.
    assert planners.run("memory", extra, budget=0.8).budget_bytes == int(0.8 * b.baseline_peak_bytes)
    with pytest.raises(ValueError, match="extra_resident_bytes"):
        Problem(fg, extra_resident_bytes=-1)


def test_a_summary_leads_with_the_decision():
    # 30 weights read by 30 layers: the 30 variable reads are kept anyway and
    # must not bury the few activations the planner chose.
    b = H.Builder()
    h = b.external("data")
    for i in range(30):
        w = b.op(f"read{i}", "ReadVariableOp", [b.source(f"w{i}", size_bytes=1024)],
                 recomputable=False, size_bytes=1024)
        h = b.op(f"t{i}", "Tanh", [b.op(f"mm{i}", "MatMul", [h, w])])
    problem = Problem(b.build([f"w{i}" for i in range(30)], [h]))
    plan = planners.run("memory", problem)
    assert plan.checkpoint_ids
    text = plan.summary()
    lines = text.splitlines()
    first_checkpoint = next(i for i, line in enumerate(lines) if "articulation point" in line)
    anyway = lines.index("  kept anyway:")
    assert first_checkpoint < anyway
    assert any(line.split()[:3] == ["30", "variable", "reads"] for line in lines[anyway:])
    kept_section = "\n".join(lines[:lines.index("  backward steps:")])
    assert "read0:0" not in kept_section  # one line for the 30 reads, not 30
    sizes = [int(line.split()[-3].replace(",", "")) for line in lines[first_checkpoint:anyway]
             if "articulation point" in line]
    assert sizes == sorted(sizes, reverse=True)
    full = plan.summary(full=True).splitlines()
    full_kept = "\n".join(full[:full.index("  backward steps:")])
    assert "read0:0" in full_kept and "read29:0" in full_kept
    assert len(plan.to_dict()["kept"]) == len(plan.kept)


@pytest.mark.parametrize("graph", ["unet", "chain"])
def test_a_presets_search_simulates_a_bounded_number_of_plans(monkeypatch, graph):
    """'memory''s search for time on a small graph simulates at most
    MEMORY_SEARCH_PLANS plans per set of candidates it searches (at most
    two: the articulation points, then the cuts' activations; a U-Net has
    only the cuts), besides its own candidate plans: the bound in simulated
    ops alone allowed thousands of plans on a graph of a few dozen ops,
    where tf.gradients takes milliseconds. Unbounded (the constant raised),
    the same search simulates more, so the bound is what holds it. On a
    chain of 10 cuts (of at most budget.DP_MAX_CUTS, where 'auto' is the
    exact dp) dp's probes count too: about 6 m^2 of them (some 650 here),
    so the capped search is greedy's, and the unbounded one dp's."""
    from memsave.planners import budget as B
    from memsave.planners import dp as planner_dp
    from memsave.planners import strategies as planner_strategies

    make = {"unet": H.unet, "chain": lambda: H.random_chain(random.Random(0), 12)}[graph]
    probes = []
    traced = planner_dp.program_and_timeline
    monkeypatch.setattr(planner_dp, "program_and_timeline",
                        lambda *a, **k: probes.append(1) or traced(*a, **k))

    def simulations(plans_bound):
        monkeypatch.setattr(planner_strategies, "MEMORY_SEARCH_PLANS", plans_bound)
        problem = Problem(make())
        candidates = len(problem.memory_plans())
        probes.clear()
        plan = _run("memory", problem, min_saving_fraction=0.0)
        assert plan.schedule is not None and plan.recomputed_ops > 0
        return problem.simulations + len(probes), candidates

    if graph == "chain":  # the case is the one the docstring describes
        problem = Problem(make())
        space = Segments(problem, problem.articulation_points())
        assert len(space.candidates) == 10 and B.choose(space, milp=False) == "dp"
    bound = planner_strategies.MEMORY_SEARCH_PLANS
    bounded, candidates = simulations(bound)
    # the plain step, each candidate plan, and two searches of at most `bound` plans
    assert bounded <= 1 + candidates + 2 * bound, bounded
    unbounded, _ = simulations(10**9)
    assert unbounded > 2 * bound, (bounded, unbounded)


def test_a_budget_only_a_memory_plan_meets_is_met_and_a_refusal_names_a_feasible_peak():
    # On this 120-op chain the plans 'memory' weighs reach a lower forecast
    # peak (33.6 MB) than any plan of the budget solvers' coarsened cuts
    # (40.9 MB): a budget between the two is met by one of them, and a
    # refusal's smallest peak is one memsave can plan.
    fg = H.random_chain(random.Random(0), 120)
    problem = Problem(fg)
    peaks = {c: problem.peak(problem.schedule(c)) for c in problem.memory_plans()}
    lowest = min(peaks.values())
    try:
        planners.run("greedy", Problem(fg), budget=lowest)
    except memsave.MemoryBudgetError as e:
        solvers_lowest = e.min_peak_bytes
    else:
        pytest.fail("the solver meets the budget alone: the case no longer tests the fallback")
    assert solvers_lowest > lowest

    plan = planners.run("auto", Problem(fg), budget=lowest)
    assert plan.solver == "memory" and plan.budget.feasible and not plan.optimal
    assert plan.predicted_peak_bytes <= lowest
    assert plan.schedule is not None and plan.recomputed_ops > 0
    fresh = simulate(fg, plan.schedule, problem.costs, model=problem.model, timeline=False)
    assert fresh.peak_bytes == plan.predicted_peak_bytes
    # Of the plans that fit, the least forecast recompute time.
    fitting = [c for c, p in peaks.items() if p <= lowest]
    assert plan.recompute_seconds <= min(
        problem.recompute_nanoseconds(problem.schedule(c)) for c in fitting) / 1e9 + 1e-9

    with pytest.raises(memsave.MemoryBudgetError, match="solver 'memory'") as info:
        planners.run("auto", Problem(fg), budget=lowest - 1)
    assert info.value.min_peak_bytes == lowest
    # Across the switch from 'memory''s plans to the solver's: every plan
    # fits, and a smaller budget never gets a larger forecast peak.
    last = 0
    for budget in (lowest, (lowest + solvers_lowest) // 2, solvers_lowest, 2 * solvers_lowest):
        p = planners.run("auto", Problem(fg), budget=budget)
        assert p.predicted_peak_bytes <= budget
        assert p.predicted_peak_bytes >= last
        last = p.predicted_peak_bytes
