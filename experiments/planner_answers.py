"""Record what the planner answers on the forecast benchmark's models, to compare two versions.

For every model of ``experiments/forecast.py``'s registry, every mode it
runs in, and every planning request (``checkpoints`` = 'memory', 'speed',
'collection'; ``memory_budget`` = 0.2, 0.35, 0.5, 0.75 of the plain
forecast), this records the Plan memsave forecasts: the plain and planned
peaks, the checkpoints, the ops recomputed and their FLOPs, and for budgets
the solver and whether it fits (or the smallest peak of an infeasible
budget). Nothing is run: the planner only reads the graphs.

A change meant to keep the planner's answers (a refactor, a speed-up) is
checked by recording before and after and comparing::

    .venv/bin/python experiments/planner_answers.py --out results/answers_before.json
    ... change memsave ...
    .venv/bin/python experiments/planner_answers.py --out results/answers_after.json
    .venv/bin/python experiments/planner_answers.py --compare results/answers_before.json \\
        results/answers_after.json

``--compare`` prints every request whose answer changed, with both
answers, and exits 1 when one did.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STRATEGIES = ("memory", "speed", "collection")
BUDGETS = (0.2, 0.35, 0.5, 0.75)


def _answer(make_plan) -> dict:
    """The plan's answer as plain data, or the error it raised."""
    import memsave

    try:
        p = make_plan()
    except memsave.MemoryBudgetError as e:
        return {"infeasible": True, "min_peak_bytes": e.min_peak_bytes}
    except Exception as e:  # recorded, so a version that newly fails shows up
        return {"error": f"{type(e).__name__}: {e}"}
    out = {
        "baseline_peak_bytes": p.baseline_peak_bytes,
        "predicted_peak_bytes": p.predicted_peak_bytes,
        "checkpoints": list(p.checkpoints),
        "recomputed_ops": p.recomputed_ops,
        "recompute_cost": p.recompute_cost,
        "fell_back": not p.steps,
    }
    if p.budget_bytes is not None:
        out.update(solver=p.solver, feasible=p.feasible, budget_bytes=p.budget_bytes)
    return out


def _requests(plan_fn, budgets: bool) -> dict:
    out = {}
    for c in STRATEGIES:
        out[c] = _answer(lambda c=c: plan_fn(checkpoints=c))
    if budgets:
        for b in BUDGETS:
            out[f"budget={b:g}"] = _answer(lambda b=b: plan_fn(checkpoints="memory", memory_budget=b))
    return out


def record(models: list[str]) -> dict:
    import tensorflow as tf

    import forecast
    import memsave

    out: dict = {}
    for name in models:
        entry = forecast.MODELS[name]
        for mode in entry.modes:
            t0 = time.perf_counter()
            case = entry.build()
            key = f"{name}/{mode}"
            if mode == forecast.FIT:
                import memsave.keras

                def keras_plan(**kw):
                    return memsave.keras.plan(case.model, case.x, case.y, **kw)

                out[key] = _requests(keras_plan, budgets=False)
            elif mode == forecast.SESSION:
                graph, fwd, _ = forecast._session_graph(case)
                with graph.as_default():
                    out[key] = _requests(
                        lambda **kw: memsave.plan(fwd.ys, fwd.xs, stop_gradients=fwd.stop_gradients, **kw),
                        budgets=True)
            else:
                variables = case.make_variables()

                def trace():
                    fwd = case.forward(variables)
                    out[key] = _requests(
                        lambda **kw: memsave.plan(fwd.ys, fwd.xs, stop_gradients=fwd.stop_gradients,
                                                  **kw),
                        budgets=True)
                    return tf.constant(0)

                tf.function(trace).get_concrete_function()
            print(f"{key}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def compare(before: dict, after: dict) -> int:
    changed = 0
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key, {}), after.get(key, {})
        for req in sorted(set(b) | set(a)):
            if b.get(req) != a.get(req):
                changed += 1
                print(f"{key} {req}:\n  before {b.get(req)}\n  after  {a.get(req)}")
    total = sum(len(v) for v in after.values())
    print(f"{changed} of {total} answers changed")
    return 1 if changed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the answers here (JSON)")
    p.add_argument("--models", nargs="+", help="registry names (default: all)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(f.read_text()) for f in args.compare))
    import forecast

    answers = record(args.models or list(forecast.MODELS))
    text = json.dumps(answers, indent=1, sort_keys=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
