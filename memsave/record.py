"""The plan: what a planner chose, as the one record passed from planning to the rewrite.

Data flow: a planner (:mod:`memsave.planners`) returns a :class:`Plan`
holding its decision (the checkpoints and why, the
:class:`~memsave.schedule.Schedule` it built, whose steps carry the gating
decision, and the :class:`Budget` facts of a budgeted plan) and the
:class:`~memsave.problem.Problem` it was chosen in. ``memsave.plan(...)``
returns it to the user; ``memsave.gradients`` hands its schedule to
:func:`memsave.rewrite.rewrite`. Every figure the Plan shows (forecast
peaks, timelines, recompute cost, what is kept) is read from the problem's
caches: a forecast the planner already ran is not run again, and one it did
not need (the device's timeline, for a planner that compared plans counting
every byte) is simulated once, when first asked for. Nothing here touches
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from memsave.costs import is_activation
from memsave.errors import ArgumentError
from memsave.schedule import Schedule

__all__ = ["Plan", "Budget", "KeptTensor", "BackwardStep", "GRADIENTS_CONSUMED_NOTE_FRACTION"]

#: The forecast holds the xs' gradients to the end of the step (as a step
#: that returns them, or an optimizer that applies them once all are
#: computed, does). When a step that applies each gradient as it is written
#: could peak lower by more than this fraction of the forecast, the Plan's
#: assumptions say so and give the lower bound (no gradient counted):
#: measured on keras ResNet50 (64x64, batch 32, 'memory'), 194-197 MiB with
#: an assign_sub per gradient, between that bound (152 MiB) and the forecast
#: (237 MiB), whose peak comes late in the backward pass where nearly every
#: weight's gradient has been written.
GRADIENTS_CONSUMED_NOTE_FRACTION = 0.10

#: Backward steps :meth:`Plan.summary` lists unless asked for all (``full=True``).
SUMMARY_STEPS = 12

#: Why a tensor is kept when no planner chose it, by kind (KeptTensor.kind).
_KEPT_ANYWAY = {
    "variable read": "variable reads",
    "x": "xs (differentiated with respect to)",
    "input": "inputs of stateful ops",
    "stateful output": "outputs of stateful ops (never recomputed)",
    "captured": "arguments a tf.custom_gradient's gradient captured",
    "shared": "tensors two segments would both recompute",
    "stored": "tensors of stored segments (differentiated in place)",
}


@dataclasses.dataclass(frozen=True)
class Budget:
    """How a budgeted plan was chosen (``memory_budget=``).

    Attributes
    ----------
    budget_bytes : int
        The forecast peak allowed.
    feasible : bool
        Whether the plan's forecast peak fits it.
    optimal : bool
        Proven optimal: least forecast recompute time among the decisions
        the solver searched.
    solver : str
        The solver that chose the plan (:mod:`memsave.planners`).
    solve_time_s : float
        Its wall time, simulations included.
    gap : float
        Relative optimality gap on recompute time (0 when proven optimal,
        ``inf`` when unknown).
    """

    budget_bytes: int
    feasible: bool
    optimal: bool
    solver: str
    solve_time_s: float
    gap: float = float("inf")


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """One tensor the checkpointed step keeps from the forward pass.

    ``kind``: ``"checkpoint"`` (a planner chose it) or why it is kept anyway
    (``"variable read"``, ``"x"``, ``"input"``, ``"stateful output"``,
    ``"captured"``, ``"shared"``, ``"stored"``); ``why`` says it in words.
    """

    name: str
    op_type: str
    shape: tuple | None
    dtype: str
    bytes: int
    why: str
    kind: str = "checkpoint"


@dataclasses.dataclass(frozen=True)
class BackwardStep:
    """One call of the stock gradient code in the checkpointed backward pass."""

    kind: str
    heads: tuple[str, ...]
    recomputed_ops: int
    recompute_cost: int
    boundary: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What :func:`memsave.gradients` will keep and recompute, and the peak it forecasts.

    The decision (fields) and the figures read from its problem (properties).

    Attributes
    ----------
    strategy : str
        The planner that chose it (``'memory'``, ``'greedy'``, ...), or
        ``"list"`` for tensors given by the user.
    problem : memsave.problem.Problem
        The graph, costs and memory model it was chosen in.
    checkpoint_ids : tuple of int
        Tensor ids of the chosen checkpoints (topological order).
    reason_of : mapping of int to str
        Why each chosen tensor (and each tensor of a stored segment) is kept.
    schedule : Schedule or None
        The backward steps the rewrite runs (None: plain tf.gradients).
    note : str
        Empty, or why nothing was chosen and what to do.
    budget : Budget or None
        With ``memory_budget=``: how the plan was chosen.
    loops : tuple of memsave.loopmodel.LoopDecision
        Per While op of the graph, the gradient the planner chose for it
        (plain, per-step, chunks of k trips), T, bytes per step and the
        forecast of every choice weighed; empty when the planner does not
        choose for loops (:mod:`memsave.planners.loops`). ``problem`` then
        forecasts with those choices, ``problem.base`` with every loop plain.

    Properties
    ----------
    predicted_peak_bytes, baseline_peak_bytes : int
        Forecast allocator peak of one call of the step (forward and
        gradients) with the plan and with plain ``tf.gradients``, variables
        and inputs resident: what ``tf.config.experimental.get_memory_info(
        device)['peak']`` reads when reset just before the call.
    resident_bytes : int
        Bytes alive before the step (variables, inputs), in both figures.
    forward_cost, recompute_cost : int
        FLOPs of one forward pass, and of the copies the plan makes.
    recompute_seconds : float
        Forecast seconds the plan adds to plain backprop: the copies that
        run, the loop trips its loop gradients run again, and the rewrite's
        gates (:func:`memsave.timemodel.step_time`, under the problem's
        device profile). What the planners minimise.
    step_seconds, baseline_step_seconds : float
        Forecast seconds of one step (forward and gradients) with the plan
        and with plain ``tf.gradients``.
    step_time_ratio : float
        ``step_seconds / baseline_step_seconds``.
    checkpoints, reasons : tuple of str
        Names of the chosen tensors, and why each.
    kept : tuple of KeptTensor
        Every tensor kept (checkpoints, xs, what stateful ops need).
    steps : tuple of BackwardStep
    timeline, baseline_timeline : tuple of (int, str)
        Forecast bytes alive after each event, checkpointed and plain.
    peak_event, baseline_peak_event : str
    assumptions : tuple of str
        Every guess the forecast made.
    solver, solve_time_s, optimal, feasible, budget_bytes
        The :class:`Budget` facts, None without a budget.
    """

    strategy: str
    problem: object = dataclasses.field(repr=False)
    checkpoint_ids: tuple[int, ...]
    reason_of: Mapping[int, str] = dataclasses.field(repr=False)
    schedule: Schedule | None = dataclasses.field(repr=False)
    note: str = ""
    budget: Budget | None = None
    loops: tuple = ()

    # -- figures -------------------------------------------------------------------

    @property
    def predicted_peak_bytes(self) -> int:
        return self.problem.peak(self.schedule)

    @property
    def baseline_peak_bytes(self) -> int:
        return self.problem.base.peak(None)

    @property
    def resident_bytes(self) -> int:
        return self.problem.forecast(None).resident_bytes

    @property
    def forward_cost(self) -> int:
        return self.problem.costs.forward_flops

    @property
    def recompute_cost(self) -> int:
        return self.problem.costs.recompute_flops(self.schedule) + self.problem.loop_recompute_flops()

    @property
    def recompute_seconds(self) -> float:
        st = self.problem.step_time(self.schedule)
        return st.recompute_s + st.loop_recompute_s + st.rewrite_s

    @property
    def step_seconds(self) -> float:
        return self.problem.step_time(self.schedule).total_s

    @property
    def baseline_step_seconds(self) -> float:
        return self.problem.base.step_time(None).total_s

    @property
    def step_time_ratio(self) -> float:
        return self.step_seconds / self.baseline_step_seconds

    @property
    def recomputed_ops(self) -> int:
        return 0 if self.schedule is None else self.schedule.recomputed_ops

    @property
    def forward_ops(self) -> int:
        return len(self.problem.fg.ops)

    @property
    def allocator(self) -> str:
        return self.problem.model.allocator.name

    @property
    def checkpoints(self) -> tuple[str, ...]:
        return tuple(self.problem.fg.describe(self.checkpoint_ids))

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(self.reason_of[i] for i in self.checkpoint_ids)

    @property
    def checkpoint_bytes(self) -> int:
        tensor_bytes = self.problem.costs.tensor_bytes
        return sum(tensor_bytes[i] for i in self.checkpoint_ids)

    @property
    def activation_bytes(self) -> int:
        fg, tensor_bytes = self.problem.fg, self.problem.costs.tensor_bytes
        return sum(tensor_bytes[t.id] for t in fg.internal_tensors() if is_activation(fg, t.id))

    @property
    def timeline(self) -> tuple[tuple[int, str], ...]:
        return self.problem.timeline(self.schedule).timeline

    @property
    def baseline_timeline(self) -> tuple[tuple[int, str], ...]:
        return self.problem.base.timeline(None).timeline

    @property
    def peak_event(self) -> str:
        return self.problem.forecast(self.schedule).peak_event

    @property
    def baseline_peak_event(self) -> str:
        return self.problem.base.forecast(None).peak_event

    @functools.cached_property
    def assumptions(self) -> tuple[str, ...]:
        problem = self.problem
        out = problem.costs.assumptions
        ours = self.predicted_peak_bytes
        consumed = problem.peak(self.schedule, gradients_kept=False)
        if ours - consumed > GRADIENTS_CONSUMED_NOTE_FRACTION * ours:
            out += (
                f"the xs' gradients are counted alive to the end of the step (returned, or applied "
                f"once all are computed); a step that applies each gradient as soon as it is "
                f"written (e.g. a custom loop's assign_sub per variable) peaks lower: between "
                f"{consumed:,} bytes (each gradient freed at once) and the forecast",)
        if problem.extra_resident_bytes:
            out += (
                f"the step also holds {problem.extra_resident_bytes:,} bytes besides what the "
                "graph reads (extra_resident_bytes; in a Keras fit step the optimizer's slots, "
                "metric state, non-trainable variables and the next batch the input pipeline "
                "prefetches): resident, counted in both peaks",)
        return out

    @property
    def kept_tensors(self) -> int:
        """How many tensors are kept."""
        return len(self.kept)

    @functools.cached_property
    def kept(self) -> tuple[KeptTensor, ...]:
        if self.schedule is None:
            return ()
        fg, costs = self.problem.fg, self.problem.costs
        xs = set(fg.xs)
        captured = fg.captured()
        stored = set(self.schedule.in_place)
        out = []
        for t in self.schedule.kept:
            node = fg.tensors[t]
            producer = fg.ops[node.producer] if node.producer is not None else None
            if t in self.reason_of and t in self.checkpoint_ids:
                kind, why = "checkpoint", self.reason_of[t]
            elif t in self.reason_of:
                kind, why = "stored", self.reason_of[t]
            elif t in xs:
                kind, why = "x", "x (differentiated with respect to)"
            elif producer is not None and producer.index in stored:
                kind, why = "stored", "stored segment (differentiated in place, not recomputed)"
            elif producer is not None and not producer.recomputable:
                kind = "variable read" if producer.type == "ReadVariableOp" else "stateful output"
                why = f"output of stateful {producer.type} (never recomputed)"
            elif t in captured:
                kind, why = "captured", "captured by a tf.custom_gradient's gradient function"
            elif node.kind == "internal":
                kind, why = "shared", "input of a stateful op, or shared by two segments"
            else:
                kind, why = "input", "input of a stateful op"
            out.append(KeptTensor(
                name=node.name, op_type=producer.type if producer is not None else node.kind,
                shape=node.shape, dtype=node.dtype, bytes=costs.tensor_bytes[t], why=why,
                kind=kind))
        return tuple(out)

    @functools.cached_property
    def steps(self) -> tuple[BackwardStep, ...]:
        if self.schedule is None:
            return ()
        fg, op_flops = self.problem.fg, self.problem.costs.op_flops
        out = []
        for s in self.schedule.steps:
            recompute = s.kind == "recompute"
            out.append(BackwardStep(
                kind=s.kind, heads=tuple(fg.describe(s.heads)),
                recomputed_ops=len(s.ops) if recompute else 0,
                recompute_cost=sum(op_flops[o] for o in s.ops) if recompute else 0,
                boundary=tuple(fg.describe(s.boundary))))
        return tuple(out)

    # -- the budget's facts --------------------------------------------------------

    @property
    def solver(self) -> str | None:
        return None if self.budget is None else self.budget.solver

    @property
    def solve_time_s(self) -> float | None:
        return None if self.budget is None else self.budget.solve_time_s

    @property
    def optimal(self) -> bool | None:
        return None if self.budget is None else self.budget.optimal

    @property
    def feasible(self) -> bool | None:
        return None if self.budget is None else self.budget.feasible

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget is None else self.budget.budget_bytes

    # -- presentation --------------------------------------------------------------

    def summary(self, *, full: bool = False) -> str:
        """The plan as aligned text.

        Figures first, then the decision: the checkpoints (activations kept)
        by size, then one line per kind of tensor kept anyway (variable
        reads, inputs, outputs of stateful ops: count and bytes), the
        first backward steps (:data:`SUMMARY_STEPS`) and the assumptions.
        ``full=True`` lists every kept tensor and every step (as
        :meth:`to_dict` does).
        """
        mib = 1 << 20
        # A plain peak of 0 bytes: every buffer under what the allocator counts.
        change = (self.predicted_peak_bytes / self.baseline_peak_bytes - 1.0
                  if self.baseline_peak_bytes else 0.0 if not self.predicted_peak_bytes
                  else float("inf"))
        overhead = self.recompute_cost / max(self.forward_cost, 1)
        lines = [
            f"memsave plan ({self.strategy}): {len(self.checkpoint_ids)} checkpoints, "
            f"{self.recomputed_ops} ops recomputed in {len(self.steps)} steps, over "
            f"{self.forward_ops} forward ops",
            f"  predicted peak   {self.predicted_peak_bytes / mib:12.2f} MiB"
            f"  ({change:+.1%} vs tf.gradients; at {self.peak_event})",
            f"  tf.gradients     {self.baseline_peak_bytes / mib:12.2f} MiB"
            f"  (at {self.baseline_peak_event})",
            f"  resident         {self.resident_bytes / mib:12.2f} MiB  (variables and inputs)",
            f"  recompute cost   {self.recompute_cost:14,} FLOPs ({overhead:.2f} forward passes)",
            f"  recompute time   {1e3 * self.recompute_seconds:12.2f} ms   (forecast step "
            f"{self.step_time_ratio:.3f}x tf.gradients'; {self.problem.profile.name})",
            f"  allocator        {self.allocator}",
        ]
        if self.budget is not None:
            lines.append(
                f"  budget           {self.budget_bytes / mib:12.2f} MiB  (solver {self.solver}, "
                f"{'optimal' if self.optimal else 'not proven optimal'}, "
                f"{self.solve_time_s:.3f} s)")
        chosen = [k for k in self.kept if k.kind == "checkpoint"]
        if chosen:
            lines.append("  checkpoints (largest first):")
            lines += _table(_kept_rows(sorted(chosen, key=lambda k: -k.bytes)))
        anyway = [k for k in self.kept if k.kind != "checkpoint"]
        if anyway and not full:
            lines.append("  kept anyway:")
            for kind, label in _KEPT_ANYWAY.items():
                of_kind = [k for k in anyway if k.kind == kind]
                if of_kind:
                    total = sum(k.bytes for k in of_kind)
                    lines.append(f"    {len(of_kind):5d} {label} ({_size(total)})")
        elif anyway:
            lines.append("  kept anyway:")
            lines += _table(_kept_rows(anyway))
        if self.steps:
            rows = [("#", "kind", "heads", "ops", "FLOPs", "boundary")]
            shown = self.steps if full else self.steps[:SUMMARY_STEPS]
            for i, s in enumerate(shown):
                rows.append((str(i), s.kind, _short(s.heads), str(s.recomputed_ops),
                             f"{s.recompute_cost:,}", _short(s.boundary)))
            lines.append("  backward steps:")
            lines += _table(rows)
            if len(shown) < len(self.steps):
                lines.append(f"    ... {len(self.steps) - len(shown)} more (summary(full=True) "
                             "lists every step)")
        if self.loops:
            lines += _loop_lines(self.loops)
        for a in self.assumptions:
            lines.append(f"  assumed: {a}")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    def __reduce_ex__(self, protocol):
        raise ArgumentError(
            "a memsave Plan cannot be pickled or copied: it holds the forward graph it was "
            "planned for, and memsave.gradients builds it in that graph only; keep its figures "
            "with plan.to_dict() (JSON-able) or plan.summary(), or plan again where it is used")

    def to_dict(self) -> dict:
        """The plan as JSON-able built-in types (every kept tensor, both timelines)."""
        return {
            "strategy": self.strategy,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "resident_bytes": self.resident_bytes,
            "forward_cost": self.forward_cost,
            "recompute_cost": self.recompute_cost,
            "recompute_seconds": self.recompute_seconds,
            "step_seconds": self.step_seconds,
            "baseline_step_seconds": self.baseline_step_seconds,
            "step_time_ratio": self.step_time_ratio,
            "checkpoints": list(self.checkpoints),
            "reasons": list(self.reasons),
            "kept": [dataclasses.asdict(k) for k in self.kept],
            "steps": [dataclasses.asdict(s) for s in self.steps],
            "timeline": [list(e) for e in self.timeline],
            "baseline_timeline": [list(e) for e in self.baseline_timeline],
            "peak_event": self.peak_event,
            "baseline_peak_event": self.baseline_peak_event,
            "assumptions": list(self.assumptions),
            "allocator": self.allocator,
            "activation_bytes": self.activation_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "forward_ops": self.forward_ops,
            "recomputed_ops": self.recomputed_ops,
            "note": self.note,
            "solver": self.solver,
            "solve_time_s": self.solve_time_s,
            "optimal": self.optimal,
            "feasible": self.feasible,
            "budget_bytes": self.budget_bytes,
            **({"loops": [_loop_dict(d) for d in self.loops]} if self.loops else {}),
        }

    def plot(self, path) -> None:
        """Draw the forecast memory timeline, plain vs checkpointed, to ``path``.

        Needs matplotlib (``pip install 'memsave[plot]'`` or ``pip install
        matplotlib``), imported only here.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(
                "memsave.Plan.plot needs matplotlib, which is not installed; install the "
                "extra with pip install 'memsave[plot]' (or pip install matplotlib)"
            ) from e
        mib = 1 << 20
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([b / mib for b, _ in self.baseline_timeline], label="tf.gradients")
        ax.plot([b / mib for b, _ in self.timeline], label=f"memsave ({self.strategy})")
        ax.axhline(self.resident_bytes / mib, color="gray", linestyle=":", label="resident")
        ax.set_xlabel("event (execution order)")
        ax.set_ylabel("allocated (MiB)")
        ax.set_title("forecast memory of one step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _kept_rows(kept: Sequence[KeptTensor]) -> list[tuple]:
    rows = [("tensor", "op type", "shape", "dtype", "bytes", "why kept")]
    for k in kept:
        shape = "?" if k.shape is None else "[" + ", ".join(
            "?" if d is None else str(d) for d in k.shape) + "]"
        rows.append((k.name, k.op_type, shape, k.dtype, f"{k.bytes:,}", k.why))
    return rows


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _short(names: Sequence[str], limit: int = 2) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", ... ({len(names)})"


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["    " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _loop_lines(loops) -> list[str]:
    """The summary's lines on loops: per loop, the choice, T, k, bytes per step
    and what each choice weighed keeps."""
    lines = ["  loops (gradient chosen per While op):"]
    rows = [("loop", "choice", "T", "k", "state/step", "kept by each choice")]
    for d in loops:
        weighed = ", ".join(f"{f.choice} {_size(f.kept_bytes)}" for f in d.forecasts)
        rows.append((d.name, str(d.choice), f"{d.trips}{'' if d.trips_known else '?'}",
                     str(d.k) if d.k else "-", _size(d.state_bytes), weighed))
    pinned = [f"    loop {d.name} keeps while_v2's gradient: {d.pinned}" for d in loops if d.pinned]
    return lines + _table(rows) + pinned


def _loop_dict(d) -> dict:
    return {"name": d.name, "choice": str(d.choice), "trips": d.trips,
            "trips_known": d.trips_known, "k": d.k, "pinned": d.pinned,
            "state_bytes_per_step": d.state_bytes,
            "plain_bytes_per_step": d.trip_bytes,
            "kept_bytes": None if d.chosen is None else d.chosen.kept_bytes,
            "recompute_flops": None if d.chosen is None else d.chosen.recompute_flops,
            "forecasts": [{"choice": str(f.choice), "kept_bytes": f.kept_bytes,
                           "recompute_flops": f.recompute_flops} for f in d.forecasts]}
