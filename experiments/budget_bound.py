"""How fast can any recomputation plan be at a given peak? A bound from memsave's own models.

For the study's models (``models.py``: ResNet-110 and U-Net-64, batch 32),
under memsave's memory and time models (the ones ``memsave.plan`` forecasts
with, which ``run.sh`` checks against measured steps), this prints, per
peak fraction of plain's forecast peak: a lower bound on the forecast step
ratio of *any* plan that recomputes to reach that peak, beside the ratio
memsave's own plan for ``memory_budget=fraction`` forecasts, and its peak.

The bound is a fractional knapsack. Plain backprop holds every activation
a gradient reads (``Costs.gradient_reads``) at the end of the forward pass;
a plan whose peak is ``f`` times plain's holds at most ``f`` times plain's
peak there, less the resident bytes, so it drops the rest of those
activations, and each byte it drops is recomputed at least once: the
tensor's producer runs again, with the producers of its inputs that plain
does not keep either (a ReLU's batch norm: plain frees the batch norm's
output, so the ReLU cannot run again without it), each at its forecast
recompute seconds (``OpSeconds.recompute``). Taking the
tensors in decreasing bytes per second until enough bytes are freed gives
the least recompute time; the rewrite's gates, the tensors recomputation
holds while it runs and the graph's constraints (a recomputed segment
starts at kept tensors) only add to it.

Usage::

    .venv/bin/python experiments/budget_bound.py     # about half a minute
"""

from __future__ import annotations

import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: (label, models.MODELS key, size n, batch)
GRAPHS = (("ResNet-110", "resnet", 18, 32), ("U-Net-64", "unet", 8, 32))
FRACTIONS = (0.15, 0.2, 0.265, 0.35, 0.5, 0.6, 0.75, 0.9)


def recompute_floor(problem, fraction: float) -> float | None:
    """Least forecast seconds of recomputation that frees ``1 - fraction`` of
    plain's forecast peak (module docstring); None when freeing every
    activation a gradient reads is not enough."""
    fg, costs, seconds = problem.fg, problem.costs, problem.seconds
    read: set[int] = set()
    for op in fg.ops:
        if costs.gradient[op.index].has_gradient:
            ins, outs = costs.gradient_reads[op.index]
            read.update(ins + outs)

    def recomputable(t: int) -> bool:
        tensor = fg.tensors[t]
        return (tensor.kind == "internal" and tensor.producer is not None
                and fg.ops[tensor.producer].recomputable)

    items = []  # (bytes freed, seconds to recompute it)
    for t in read:
        if not recomputable(t):
            continue
        cost, stack, seen = 0.0, [fg.tensors[t].producer], set()
        while stack:
            o = stack.pop()
            if o in seen:
                continue
            seen.add(o)
            cost += seconds.recompute[o]
            stack.extend(fg.tensors[i].producer for i in fg.ops[o].inputs
                         if i not in read and recomputable(i))
        items.append((costs.tensor_bytes[t], cost))
    items.sort(key=lambda item: item[1] / item[0] if item[0] else float("inf"))
    # What plain holds at the end of the forward pass that a plan may drop:
    # the activations above; the rest of its peak (resident bytes, what is
    # alive with them) counts as held by every plan.
    plain = problem.forecast(None)
    activations = sum(nbytes for nbytes, _ in items)
    need = activations - (fraction * plain.peak_bytes - plain.resident_bytes)
    spent = 0.0
    for nbytes, cost in items:
        if need <= 0:
            break
        if nbytes:
            take = min(1.0, need / nbytes)
            spent += take * cost
            need -= take * nbytes
    return spent if need <= 0 else None


def main() -> None:
    import tensorflow as tf

    import memsave
    import models
    from memsave.errors import MemoryBudgetError

    logging.getLogger("memsave").setLevel(logging.ERROR)
    print("| model | peak fraction | bound on step ratio | memsave's plan: step ratio | its peak |")
    print("|---|---|---|---|---|")
    for label, name, n, batch in GRAPHS:
        m = models.MODELS[name]
        params = m.init(n, 0)
        x, y = m.batch(batch, 0)
        with tf.Graph().as_default():
            v = {k: tf.Variable(val) for k, val in params.items()}
            loss = m.loss(n, v, tf.constant(x), tf.constant(y), models.Arch())
            weights = list(v.values())
            problem = memsave.plan(loss, weights, checkpoints="memory").problem
            plain = problem.step_time(None).total_s
            for fraction in FRACTIONS:
                floor = recompute_floor(problem, fraction)
                bound = "none can reach it" if floor is None else f"{1 + floor / plain:.3f}"
                try:
                    plan = memsave.plan(loss, weights, memory_budget=fraction)
                    ratio = plan.problem.step_time(plan.schedule).total_s / plain
                    ours = (f"{ratio:.3f}",
                            f"{plan.predicted_peak_bytes / plan.baseline_peak_bytes:.3f}")
                except MemoryBudgetError:
                    ours = ("refused", "")
                print(f"| {label} | {fraction:g} | {bound} | {ours[0]} | {ours[1]} |", flush=True)


if __name__ == "__main__":
    main()
