"""The one planning problem: what every way of choosing checkpoints reads (no TensorFlow).

Data flow::

    ForwardGraph (memsave.extract)
      -> Problem(fg, model=..., profile=..., extra_resident_bytes=...)
           costs            memsave.costs.estimate_costs, once
           seconds          memsave.timemodel.op_seconds under the device
                            profile, once
           candidates       articulation points, topological cuts, 'memory''s
                            plans (memsave.candidates), each computed once
           evaluator        schedule(checkpoints)  -> Schedule   (cached)
                            forecast(schedule)     -> MemoryTrace (cached)
                            timeline(schedule)     -> MemoryTrace with events
                            step_time(schedule)    -> StepTime    (cached)
      -> a planner (memsave.planners): (problem, *, budget=None, **options) -> Plan
      -> Plan (memsave.record): what memsave.plan shows and memsave.rewrite runs

A planner only chooses: it asks the problem for candidates, builds
schedules and reads their forecast peaks through the problem, whose caches
make every schedule built once and every forecast simulated once, whoever
asks (the planner's search, its tie-breaks, the no-saving warning, the
Plan's figures). The Plan it returns holds the problem, so nothing
downstream rebuilds or re-simulates what the planner already did.

Time is the time model's (:mod:`memsave.timemodel`): the forecast seconds
of each op under the problem's :class:`~memsave.timemodel.DeviceProfile`
(``profile``; default :data:`memsave.timemodel.CPU_DEFAULT`, what
:func:`memsave.calibrate.calibrate` measured on the reference machine, so
planning never pays a calibration). A user who wants their own device's
figures measures it once, ``profile = memsave.calibrate.device_profile()``
(a few seconds), and passes ``Problem(fg, profile=profile)``: a value, like
the memory model, not a setting to toggle.

Two memory models are read: the device's (``model``: its allocator's
reported peak, what ``tf.config.experimental.get_memory_info`` shows and
what a budget bounds) and :attr:`Problem.judge`, the same model counting
every byte, with which the strategies compare plans (a buffer the CPU
allocator does not report still takes memory).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping

from memsave import candidates as _candidates
from memsave.costs import Costs, estimate_costs
from memsave.errors import ArgumentError, CheckpointError
from memsave.graph import ForwardGraph
from memsave.memory_model import MemoryModel
from memsave.schedule import Schedule, build_schedule
from memsave.simulate import ForwardProgram, MemoryTrace, copies_that_run, paused_gc, simulate
from memsave.timemodel import CPU_DEFAULT, DeviceProfile, OpSeconds, StepTime, op_seconds, \
    step_seconds, step_time
from memsave.xla import xla_costs

__all__ = ["Problem"]


class Problem:
    """A forward graph, its costs, the memory model, candidate cuts and the cached evaluator.

    Parameters
    ----------
    fg : ForwardGraph
    model : MemoryModel
        The memory model of the device the step runs on.
    costs : Costs, optional
        :func:`memsave.costs.estimate_costs` of ``fg`` (computed here with
        ``batch_size`` and the model's ``early_gradient_values`` when not given).
    batch_size : int, optional
        Size of unknown first dimensions, for the costs.
    extra_resident_bytes : int
        Bytes the step holds besides what the graph reads (an optimizer's
        slots, metric state): resident in every forecast, so that a
        fractional budget is a fraction of the whole step.
    profile : DeviceProfile, optional
        What the device does per second, for the time model
        (:mod:`memsave.timemodel`): :data:`memsave.timemodel.CPU_DEFAULT`
        when not given; ``memsave.calibrate.device_profile()`` measures the
        current device.

    Examples
    --------
    >>> problem = Problem(fg)  # doctest: +SKIP
    >>> plan = memsave.planners.get("memory")(problem)  # doctest: +SKIP
    >>> plan.predicted_peak_bytes, plan.baseline_peak_bytes  # doctest: +SKIP
    """

    def __init__(self, fg: ForwardGraph, *, model: MemoryModel = MemoryModel(),
                 costs: Costs | None = None, batch_size: int | None = None,
                 extra_resident_bytes: int = 0, profile: DeviceProfile | None = None) -> None:
        if isinstance(extra_resident_bytes, bool) or not isinstance(extra_resident_bytes, int) \
                or extra_resident_bytes < 0:
            raise ArgumentError(
                f"memsave: extra_resident_bytes={extra_resident_bytes!r}; pass a number of bytes >= 0")
        self.fg = fg
        self.model = model
        if costs is None:
            # Under XLA, what each gradient reads as XLA reads it (memsave.xla).
            costs = xla_costs(fg, estimate_costs(
                fg, batch_size=batch_size, early_gradient_values=model.early_gradient_values))
        self.costs = costs
        self.extra_resident_bytes = extra_resident_bytes
        if profile is not None and not isinstance(profile, DeviceProfile):
            raise ArgumentError(
                f"memsave: profile={profile!r}; pass a memsave.timemodel.DeviceProfile (e.g. "
                "memsave.calibrate.device_profile()) or None for the default")
        self.profile = CPU_DEFAULT if profile is None else profile
        self.judge = model.counting_every_byte()
        self._step_times: dict[tuple, StepTime] = {}
        self._step_ns: dict[object, int] = {}
        self._forward: dict[MemoryModel, ForwardProgram] = {}
        self._schedules: dict[tuple, Schedule] = {}
        self._forecasts: dict[tuple, MemoryTrace] = {}
        self._timelines: dict[tuple, MemoryTrace] = {}
        self._cached: dict[tuple, object] = {}
        # Loops (memsave.loopmodel): op index -> LoopChoice of a loop whose
        # gradient is not while_v2's, and the problem with every loop plain.
        self.loop_choices: dict[int, object] = {}
        self.base: Problem = self
        # The share of a preset's bounded search for time
        # (memsave.planners.strategies) that planning this problem may take:
        # all of it, but where many combinations of loop choices are weighed
        # (memsave.planners.loops), each of which gets a share.
        self.search_share = 1.0

    # -- candidates (memsave.candidates, each computed once) -------------------

    def _once(self, key: tuple, make):
        found = self._cached.get(key)
        if found is None:
            found = self._cached[key] = make()
        return found

    def keepable(self) -> list[int]:
        """Activations a plan may keep (:func:`memsave.candidates.keepable`)."""
        return self._once(("keepable",), lambda: _candidates.keepable(self.fg))

    def fused_away(self) -> dict[int, int]:
        """:func:`memsave.candidates.fused_away`: sums no plan keeps, each with
        the tensor kept in its place."""
        return self._once(("fused_away",), lambda: _candidates.fused_away(self.fg))

    def articulation_points(
        self, *, small_tensor_fraction: float = _candidates.SMALL_TENSOR_FRACTION
    ) -> list[int]:
        """:func:`memsave.candidates.articulation_points` of the graph."""
        return self._once(("articulation", small_tensor_fraction),
                          lambda: _candidates.articulation_points(
                              self.fg, small_tensor_fraction=small_tensor_fraction,
                              sizes=self.costs.tensor_bytes))

    def topological_cuts(self) -> list[_candidates.Cut]:
        """:func:`memsave.candidates.topological_cuts` of the graph."""
        return self._once(("cuts",), lambda: _candidates.topological_cuts(self.fg, self.costs))

    def positions(self) -> tuple[list[int], int]:
        """:func:`memsave.candidates.positions`: activation bytes up to each op, and in all."""
        return self._once(("positions",), lambda: _candidates.positions(self.fg, self.costs))

    def memory_plans(
        self, *, segment_live_fraction: float = _candidates.SEGMENT_LIVE_FRACTION,
        small_tensor_fraction: float = _candidates.SMALL_TENSOR_FRACTION,
    ) -> list[tuple[int, ...]]:
        """The plans ``'memory'`` weighs (:func:`memsave.candidates.memory_plans`)."""
        return self._once(
            ("memory_plans", segment_live_fraction, small_tensor_fraction),
            lambda: _candidates.memory_plans(
                self.fg, self.costs,
                self.articulation_points(small_tensor_fraction=small_tensor_fraction),
                self.topological_cuts(), segment_live_fraction=segment_live_fraction))

    # -- the evaluator -----------------------------------------------------------

    def schedule(self, checkpoints: Iterable[int], in_place: Iterable[int] = ()) -> Schedule:
        """:func:`memsave.schedule.build_schedule` of these checkpoints (cached)."""
        key = (tuple(sorted(set(checkpoints))), tuple(sorted(set(in_place))))
        found = self._schedules.get(key)
        if found is None:
            found = self._schedules[key] = build_schedule(self.fg, key[0], in_place=key[1])
        return found

    def forward(self, model: MemoryModel | None = None) -> ForwardProgram:
        """The forward program every simulation under ``model`` shares."""
        model = self.model if model is None else model
        found = self._forward.get(model)
        if found is None:
            with paused_gc():
                found = self._forward[model] = ForwardProgram(
                    self.fg, self.costs, model, loop_figures=self._loop_figures(model),
                    loops_prepared=any(c.kind != "plain" for c in self.loop_choices.values()))
        return found

    def forecast(self, schedule: Schedule | None, *, model: MemoryModel | None = None,
                 gradients_kept: bool = True) -> MemoryTrace:
        """The forecast of ``schedule`` (None: plain tf.gradients), without its timeline; cached.

        Under the device's model unless ``model`` is given (e.g.
        :attr:`judge`); ``gradients_kept`` as for
        :func:`memsave.simulate.simulate`. Schedules with the same steps
        share one simulation.
        """
        model = self.model if model is None else model
        key = (None if schedule is None else schedule.steps, model, gradients_kept)
        found = self._forecasts.get(key)
        if found is None:
            found = self._forecasts[key] = simulate(
                self.fg, schedule, self.costs, model=model, timeline=False,
                forward=self.forward(model), gradients_kept=gradients_kept,
                extra_resident_bytes=self.extra_resident_bytes)
        return found

    def peak(self, schedule: Schedule | None, *, model: MemoryModel | None = None,
             gradients_kept: bool = True) -> int:
        """Forecast peak bytes of ``schedule`` (:meth:`forecast`)."""
        return self.forecast(schedule, model=model, gradients_kept=gradients_kept).peak_bytes

    def peak_floor(self, schedule: Schedule | None, *, model: MemoryModel | None = None,
                   gradients_kept: bool = True) -> int:
        """A lower bound on :meth:`peak` of ``schedule`` without simulating it
        (:meth:`memsave.simulate.ForwardProgram.peak_floor`): the most bytes
        certainly alive when backprop starts or as one of its steps'
        gradients start, the extra resident bytes included."""
        return self.extra_resident_bytes + self.forward(model).peak_floor(
            schedule, gradients_kept=gradients_kept)

    def timeline(self, schedule: Schedule | None, *, model: MemoryModel | None = None) -> MemoryTrace:
        """The forecast with its timeline of bytes alive per event (for the Plan), cached."""
        model = self.model if model is None else model
        key = (None if schedule is None else schedule.steps, model)
        found = self._timelines.get(key)
        if found is None:
            found = self._timelines[key] = simulate(
                self.fg, schedule, self.costs, model=model, timeline=True,
                forward=self.forward(model), extra_resident_bytes=self.extra_resident_bytes)
        return found

    def floor(self, *, model: MemoryModel | None = None) -> int:
        """Bytes every plan holds at the end of the step: a lower bound on any
        plan's forecast peak (with the gradients kept, as planners compare).

        The inputs and variables (resident from start to end), the extra
        resident bytes, and the xs' gradients (the step's outputs): no
        choice of checkpoints frees any of them.
        """
        model = self.model if model is None else model
        return self._once(("floor", model), lambda: self._floor(model))

    def _floor(self, model: MemoryModel) -> int:
        fg, counted, tensor_bytes = self.fg, model.allocator.counted, self.costs.tensor_bytes
        held = sum(counted(tensor_bytes[t.id]) for t in fg.tensors if t.kind != "internal")
        reached = {t for targets in self.costs.gradient_targets for _, t in targets}
        grads = sum(counted(tensor_bytes[x]) for x in dict.fromkeys(fg.xs)
                    if x in reached and fg.tensors[x].kind != "internal")
        return self.extra_resident_bytes + held + grads

    # -- the time model --------------------------------------------------------------

    @property
    def seconds(self) -> OpSeconds:
        """:func:`memsave.timemodel.op_seconds` of the graph under :attr:`profile` (once)."""
        return self._once(("seconds",), lambda: op_seconds(self.fg, self.costs, self.profile))

    @property
    def copies_that_run(self):
        """:func:`memsave.simulate.copies_that_run` of the graph (once): which
        copies of a recompute step's ops run, ``ops -> ops``."""
        return self._once(("copies_that_run",), lambda: copies_that_run(self.fg, self.costs))

    def step_time(self, schedule: Schedule | None) -> StepTime:
        """:func:`memsave.timemodel.step_time` of ``schedule`` (None: plain), cached."""
        key = None if schedule is None else schedule.steps
        found = self._step_times.get(key)
        if found is None:
            found = step_time(self.fg, self.costs, schedule, seconds=self.seconds)
            if self.loop_choices:
                found = dataclasses.replace(found, loop_recompute_s=self.loop_recompute_seconds())
            self._step_times[key] = found
        return found

    def step_nanoseconds(self, step) -> int:
        """Forecast nanoseconds one backward step adds to plain backprop (its
        copies that run and its gates; :func:`memsave.timemodel.step_seconds`),
        rounded to an integer so that a plan's cost is an exact sum over its
        steps, whoever adds them (the budget solvers compare sums); cached per step."""
        found = self._step_ns.get(step)
        if found is None:
            found = self._step_ns[step] = round(
                1e9 * step_seconds(self.fg, self.costs, step, self.seconds,
                                   needed_copies=self.copies_that_run).total_s)
        return found

    def recompute_nanoseconds(self, schedule: Schedule | None) -> int:
        """Forecast nanoseconds ``schedule`` adds to plain backprop: the sum of
        :meth:`step_nanoseconds` over its steps (0 for None)."""
        if schedule is None:
            return 0
        return sum(self.step_nanoseconds(s) for s in schedule.steps)

    # -- loops (memsave.loopmodel) ---------------------------------------------------

    @property
    def loops(self):
        """The While ops of the graph, each with its choices forecast (a tuple
        of :class:`memsave.loopmodel.LoopDecision`, nothing chosen yet)."""
        from memsave import loopmodel

        return self._once(("loops",), lambda: loopmodel.options(self.fg, self.costs, self.model))

    def with_loops(self, choices: Mapping[int, object]) -> Problem:
        """This graph with the loops' gradients as ``choices`` says (op index ->
        :class:`memsave.loopmodel.LoopChoice`; a loop not in it stays
        plain): the same model and costs (but for what the changed loops'
        gradients read, :func:`memsave.loopmodel.recomputing_costs`), its own
        caches; ``base`` is this problem's. Cached per choices."""
        base = self.base
        key = tuple(sorted((i, c) for i, c in choices.items() if c.kind != "plain"))
        if not key:
            return base
        return base._once(("with_loops", key), lambda: base._variant(dict(key)))

    def _variant(self, choices: dict) -> Problem:
        from memsave import loopmodel

        # A loop whose gradient memsave.loops.prepare changes is rewritten in
        # place (its body, its inputs): a recompute step cannot copy it from
        # the graph as extracted, so its outputs are kept, as a stateful op's.
        # Its gradient runs its trips again: it reads the loop's inputs.
        fg = dataclasses.replace(self.fg, ops=tuple(
            dataclasses.replace(op, recomputable=False) if op.index in choices else op
            for op in self.fg.ops))
        variant = Problem(fg, model=self.model,
                          costs=loopmodel.recomputing_costs(fg, self.costs, choices),
                          extra_resident_bytes=self.extra_resident_bytes, profile=self.profile)
        variant.loop_choices = choices
        variant.base = self
        return variant

    def loop_recompute_flops(self) -> int:
        """FLOPs of the loop trips the gradients of ``loop_choices`` run again."""
        return round(self._loop_recompute(self.costs.op_flops))

    def loop_recompute_seconds(self) -> float:
        """Forecast seconds of the loop trips the gradients of ``loop_choices``
        run again (one trip: the While op's forward seconds over its trips)."""
        return self._loop_recompute(self.seconds.recompute)

    def _loop_recompute(self, per_op) -> float:
        from memsave import loopmodel

        ops = self.fg.ops
        return sum(loopmodel.recomputed_trips(ops[i].body, c) * per_op[i] / max(ops[i].body.trips, 1)
                   for i, c in self.loop_choices.items())

    def _loop_figures(self, model: MemoryModel) -> dict:
        """Every loop's figures under its choice (plain when not chosen):
        :func:`memsave.loopmodel.figures`, which also leaves out the per-trip
        gradients nobody reads (a loop's input sequence's)."""
        from memsave import loopmodel

        plain = loopmodel.LoopChoice.plain()
        readers = self.fg.consumers()
        return {op.index: loopmodel.figures(
                    op.body, self.loop_choices.get(op.index, plain), model,
                    read_outputs=frozenset(k for k, t in enumerate(op.outputs) if readers[t]))
                for op in self.fg.ops if op.body is not None and op.body.loop}

    @property
    def simulations(self) -> int:
        """Distinct forecasts simulated so far (without timelines)."""
        return len(self._forecasts)

    @property
    def schedules(self) -> int:
        """Distinct schedules built so far (what planning spends most of its time
        on where plans are many: experiments/bench_planner.py counts them)."""
        return len(self._schedules)

    # -- results ------------------------------------------------------------------

    def checkpoint_ids(self, checkpoints: Iterable[int], *, who: str,
                       api: str = "memsave") -> tuple[int, ...]:
        """``checkpoints`` as sorted distinct tensor ids of the graph.

        Raises :class:`~memsave.errors.CheckpointError` (saying ``who``
        chose it) for one that is no tensor id (``-1`` is not the last
        tensor) or is a y: keeping a y saves nothing, and the rewrite would
        read another graph's id as a tensor of this one.
        """
        fg = self.fg
        ids = []
        for t in checkpoints:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) \
                    or not 0 <= t < len(fg.tensors):
                raise CheckpointError(
                    f"{api}: {who} keeps {t!r}, which is not a tensor id of this forward graph "
                    f"(0 to {len(fg.tensors) - 1}); keep ids from problem.keepable()")
            ids.append(int(t))
        ys = set(fg.ys)
        for t in ids:
            if t in ys:
                raise CheckpointError(
                    f"{api}: {who} keeps {fg.tensors[t].name!r} (id {t}), one of the ys; keeping "
                    "a y saves nothing: keep ids from problem.keepable()")
        return tuple(sorted(set(ids)))

    def plan(self, strategy: str, checkpoints: Iterable[int], reasons: Mapping[int, str], *,
             schedule: Schedule | None | type = ..., note: str = "", budget=None):
        """The :class:`memsave.record.Plan` keeping ``checkpoints``.

        ``schedule``: the one the planner already built (default: this
        problem's schedule of ``checkpoints``, or None when there are none:
        plain tf.gradients). ``budget``: the :class:`memsave.record.Budget`
        facts of a budgeted plan.
        """
        from memsave.record import Plan

        ids = self.checkpoint_ids(checkpoints, who=f"problem.plan({strategy!r}, ...)")
        if schedule is ...:
            schedule = self.schedule(ids) if ids else None
        return Plan(strategy=strategy, problem=self, checkpoint_ids=ids,
                    reason_of=dict(reasons), schedule=schedule, note=note, budget=budget)
