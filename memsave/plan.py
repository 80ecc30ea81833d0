"""The plan: what a checkpointed step keeps, recomputes and peaks at, as data.

Data flow: :func:`make_plan` takes the forward graph, the chosen checkpoints
(and their reasons), their :class:`~memsave.schedule.Schedule` and the
:class:`~memsave.costs.Costs`, runs the simulator on plain
``tf.gradients`` and on the schedule (twice: with the xs' gradients held to
the end of the step, the forecast, and consumed as written, for the
assumption it may state) and returns a :class:`Plan`: plain values
first; :meth:`Plan.summary`, :meth:`Plan.to_dict` and :meth:`Plan.plot` only
present them. ``memsave.plan(...)`` (in :mod:`memsave.gradients`) builds it
for a TensorFlow graph. Nothing here touches TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from memsave.costs import Costs, is_activation
from memsave.graph import ForwardGraph
from memsave.schedule import Schedule
from memsave.simulate import CPU_ONEDNN, Allocator, simulate

__all__ = ["Plan", "KeptTensor", "BackwardStep", "make_plan", "GRADIENTS_CONSUMED_NOTE_FRACTION"]

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


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """One tensor the checkpointed step keeps from the forward pass."""

    name: str
    op_type: str
    shape: tuple | None
    dtype: str
    bytes: int
    why: str


@dataclasses.dataclass(frozen=True)
class BackwardStep:
    """One call of the stock gradient code in the checkpointed backward pass."""

    kind: str
    heads: tuple[str, ...]
    recomputed_ops: int
    recompute_cost: int
    boundary: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`memsave.gradients` will keep and recompute, and the peak it forecasts.

    Attributes
    ----------
    strategy : str
        Strategy name, or ``"list"`` for tensors given by the user.
    predicted_peak_bytes : int
        Forecast allocator peak of one call of the checkpointed step (forward
        and gradients), variables and inputs resident: what
        ``tf.config.experimental.get_memory_info(device)['peak']`` reads when
        reset just before the call. The plain figure when nothing is kept.
    baseline_peak_bytes : int
        The same for plain ``tf.gradients`` on the same graph.
    resident_bytes : int
        Bytes alive before the step (variables, inputs), in both figures.
    forward_cost, recompute_cost : int
        FLOPs of one forward pass, and of what the plan recomputes.
    checkpoints, reasons : tuple of str
        Names of the chosen tensors (topological order), and why each.
    kept : tuple of KeptTensor
        Every tensor kept (checkpoints, xs, what stateful ops need).
    steps : tuple of BackwardStep
        The backward steps in the order they run.
    timeline, baseline_timeline : tuple of (int, str)
        Forecast bytes alive after each event, checkpointed and plain.
    peak_event, baseline_peak_event : str
        Where each peak is reached.
    assumptions : tuple of str
        Every guess the forecast made (unknown sizes, unlearned gradients).
    allocator : str
        Allocator model of the forecast.
    activation_bytes, checkpoint_bytes : int
        Bytes of all activations, and of the chosen checkpoints.
    forward_ops, recomputed_ops : int
        Ops between xs and ys; op copies the rewrite makes.
    note : str
        Empty, or why nothing was chosen and what to do.
    solver, solve_time_s, optimal, feasible, budget_bytes
        With ``memory_budget=``: the solver that chose the plan
        (:mod:`memsave.solvers`), its wall time, whether it proved the plan
        optimal, whether the forecast fits, and the budget in bytes; None
        otherwise.
    """

    strategy: str
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    resident_bytes: int
    forward_cost: int
    recompute_cost: int
    checkpoints: tuple[str, ...]
    reasons: tuple[str, ...]
    kept: tuple[KeptTensor, ...]
    steps: tuple[BackwardStep, ...]
    timeline: tuple[tuple[int, str], ...]
    baseline_timeline: tuple[tuple[int, str], ...]
    peak_event: str
    baseline_peak_event: str
    assumptions: tuple[str, ...]
    allocator: str
    activation_bytes: int
    checkpoint_bytes: int
    forward_ops: int
    recomputed_ops: int
    note: str = ""
    solver: str | None = None
    solve_time_s: float | None = None
    optimal: bool | None = None
    feasible: bool | None = None
    budget_bytes: int | None = None

    @property
    def kept_tensors(self) -> int:
        """How many tensors are kept."""
        return len(self.kept)

    def summary(self) -> str:
        """The plan as aligned text: figures, kept tensors, steps, assumptions."""
        mib = 1 << 20
        change = self.predicted_peak_bytes / max(self.baseline_peak_bytes, 1) - 1.0
        overhead = self.recompute_cost / max(self.forward_cost, 1)
        lines = [
            f"memsave plan ({self.strategy}): {len(self.checkpoints)} checkpoints, "
            f"{len(self.kept)} kept tensors, {self.recomputed_ops} ops recomputed in "
            f"{len(self.steps)} steps, over {self.forward_ops} forward ops",
            f"  predicted peak   {self.predicted_peak_bytes / mib:12.2f} MiB"
            f"  ({change:+.1%} vs tf.gradients; at {self.peak_event})",
            f"  tf.gradients     {self.baseline_peak_bytes / mib:12.2f} MiB"
            f"  (at {self.baseline_peak_event})",
            f"  resident         {self.resident_bytes / mib:12.2f} MiB  (variables and inputs)",
            f"  recompute cost   {self.recompute_cost:14,} FLOPs ({overhead:.2f} forward passes)",
            f"  allocator        {self.allocator}",
        ]
        if self.budget_bytes is not None:
            lines.append(
                f"  budget           {self.budget_bytes / mib:12.2f} MiB  (solver {self.solver}, "
                f"{'optimal' if self.optimal else 'not proven optimal'}, "
                f"{self.solve_time_s:.3f} s)")
        if self.kept:
            rows = [("tensor", "op type", "shape", "dtype", "bytes", "why kept")]
            for k in self.kept:
                shape = "?" if k.shape is None else "[" + ", ".join(
                    "?" if d is None else str(d) for d in k.shape) + "]"
                rows.append((k.name, k.op_type, shape, k.dtype, f"{k.bytes:,}", k.why))
            lines.append("  kept tensors:")
            lines += _table(rows)
        if self.steps:
            rows = [("#", "kind", "heads", "ops", "FLOPs", "boundary")]
            for i, s in enumerate(self.steps):
                rows.append((str(i), s.kind, _short(s.heads), str(s.recomputed_ops),
                             f"{s.recompute_cost:,}", _short(s.boundary)))
            lines.append("  backward steps:")
            lines += _table(rows)
        for a in self.assumptions:
            lines.append(f"  assumed: {a}")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The plan as JSON-able built-in types."""
        return dataclasses.asdict(self)

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


def _short(names: Sequence[str], limit: int = 2) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", ... ({len(names)})"


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["    " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def make_plan(
    fg: ForwardGraph,
    costs: Costs,
    *,
    strategy: str,
    checkpoints: Sequence[int],
    reasons: Mapping[int, str],
    schedule: Schedule | None,
    note: str = "",
    allocator: Allocator = CPU_ONEDNN,
    budget=None,
) -> Plan:
    """Build the :class:`Plan` of ``schedule`` (None: plain tf.gradients).

    ``budget``: the :class:`memsave.solvers.SolveResult` that chose it, if any.
    """
    base = simulate(fg, None, costs, allocator=allocator)
    ours = simulate(fg, schedule, costs, allocator=allocator) if schedule is not None else base
    assumptions = costs.assumptions
    consumed = simulate(fg, schedule, costs, allocator=allocator, timeline=False,
                        gradients_kept=False).peak_bytes
    if ours.peak_bytes - consumed > GRADIENTS_CONSUMED_NOTE_FRACTION * ours.peak_bytes:
        assumptions += (
            f"the xs' gradients are counted alive to the end of the step (returned, or applied "
            f"once all are computed); a step that applies each gradient as soon as it is "
            f"written (e.g. a custom loop's assign_sub per variable) peaks lower: between "
            f"{consumed:,} bytes (each gradient freed at once) and the forecast",)
    kept: list[KeptTensor] = []
    steps: list[BackwardStep] = []
    recompute_cost = 0
    recomputed_ops = 0
    if schedule is not None:
        xs = set(fg.xs)
        captured = fg.captured()
        for t in schedule.kept:
            node = fg.tensors[t]
            if t in reasons:
                why = reasons[t]
            elif t in xs:
                why = "x (differentiated with respect to)"
            elif node.producer is not None and not fg.ops[node.producer].recomputable:
                why = f"output of stateful {fg.ops[node.producer].type} (never recomputed)"
            elif t in captured:
                why = "captured by a tf.custom_gradient's gradient function"
            elif node.kind == "internal":
                why = "input of a stateful op, or shared by two segments"
            else:
                why = "input of a stateful op"
            kept.append(KeptTensor(
                name=node.name,
                op_type=fg.ops[node.producer].type if node.producer is not None else node.kind,
                shape=node.shape, dtype=node.dtype, bytes=costs.tensor_bytes[t], why=why,
            ))
        for s in schedule.steps:
            cost = sum(costs.op_flops[o] for o in s.ops) if s.kind == "recompute" else 0
            n = len(s.ops) if s.kind == "recompute" else 0
            recompute_cost += cost
            recomputed_ops += n
            steps.append(BackwardStep(
                kind=s.kind, heads=tuple(fg.describe(s.heads)), recomputed_ops=n,
                recompute_cost=cost, boundary=tuple(fg.describe(s.boundary)),
            ))
    return Plan(
        strategy=strategy,
        predicted_peak_bytes=ours.peak_bytes,
        baseline_peak_bytes=base.peak_bytes,
        resident_bytes=base.resident_bytes,
        forward_cost=costs.forward_flops,
        recompute_cost=recompute_cost,
        checkpoints=tuple(fg.describe(checkpoints)),
        reasons=tuple(reasons[i] for i in checkpoints),
        kept=tuple(kept),
        steps=tuple(steps),
        timeline=ours.timeline,
        baseline_timeline=base.timeline,
        peak_event=ours.peak_event,
        baseline_peak_event=base.peak_event,
        assumptions=assumptions,
        allocator=allocator.name,
        activation_bytes=sum(costs.tensor_bytes[t.id] for t in fg.internal_tensors()
                             if is_activation(fg, t.id)),
        checkpoint_bytes=sum(costs.tensor_bytes[i] for i in checkpoints),
        forward_ops=len(fg.ops),
        recomputed_ops=recomputed_ops,
        note=note,
        **({} if budget is None else dict(
            solver=budget.solver, solve_time_s=budget.solve_time_s, optimal=budget.optimal,
            feasible=budget.feasible, budget_bytes=budget.budget_bytes)),
    )
