"""The command line: ``python -m memsave plan MODEL``.

``plan`` forecasts one Keras ``fit`` step of a model, plain and with
memsave, before anything runs, and with ``--memory`` the largest batch
that fits each way::

    python -m memsave plan model.keras --batch-size 64 --memory 8GiB
    python -m memsave plan mypackage.models:build --checkpoints memory --json

Data flow::

    main(argv)
      -> argparse (one line on stderr and exit status 2 for bad arguments)
      -> load MODEL: a saved .keras file (keras.saving.load_model, compiled as
         saved) or module:function (called with no arguments)
      -> a batch of TensorSpecs: inputs from model.inputs, targets from
         model.outputs (integer class ids for a sparse cross-entropy loss)
      -> capacity.Forecasts: memsave.keras.plan at --batch-size (the table);
         with --memory, the largest batch plain and checkpointed, sharing traces
      -> the table, or one JSON object with --json

Every mistake a user can make (a missing file, a model that is not
compiled, an unparsable size, a bad module:function, any
:class:`memsave.MemsaveError`) ends with one line on stderr, ``memsave:
error: ...``, and exit status 2, never a traceback. TensorFlow and Keras
are imported only once the arguments are read.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence

from memsave.capacity import (
    FORECAST_MARGIN_CHECKPOINTED,
    FORECAST_MARGIN_PLAIN,
    NoBatchFitsError,
    parse_bytes,
)
from memsave.errors import MemsaveError

__all__ = ["main", "UsageError"]

PROG = "python -m memsave"

#: ``--batch-size`` when none is given: Keras ``fit``'s own default.
DEFAULT_BATCH_SIZE = 32

#: How many checkpoints the table lists (largest first); ``--json`` lists all.
TABLE_CHECKPOINTS = 8


class UsageError(MemsaveError, ValueError):
    """A command-line argument the command cannot use."""


class _Parser(argparse.ArgumentParser):
    """argparse, with every error as one line on stderr and exit status 2."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 for bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError(f"give a command: plan (see {PROG} --help)")
        return args.run(args)
    except MemsaveError as e:
        print(f"memsave: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="memsave: gradient checkpointing for TensorFlow 2. "
                    "Commands: plan (forecast a Keras fit step and the largest batch that fits).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    plan = commands.add_parser(
        "plan",
        help="forecast one Keras fit step's peak memory, plain and with memsave, and the "
             "largest batch that fits",
        description="Forecast the allocator peak of one Keras fit step of MODEL, plain and "
                    "with memsave's checkpointing, without running it; with --memory, the "
                    "largest batch that fits each way.",
        epilog=f"Sizes: a number of bytes or a number and a unit: B, KiB, MiB, GiB, TiB "
               f"(1024) or KB, MB, GB, TB (1000), e.g. 8GiB. The largest batch covers the "
               f"forecast's known error with a margin: {FORECAST_MARGIN_PLAIN:.0%} of the "
               f"forecast for plain fit, {FORECAST_MARGIN_CHECKPOINTED:.0%} with memsave. "
               f"Exit status 2 on bad input, with one line on stderr.")
    plan.add_argument("model", metavar="MODEL",
                      help="a saved .keras model, or module:function (or path/file.py:function) "
                           "returning a compiled keras.Model")
    plan.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                      metavar="N", help=f"the batch to forecast (default {DEFAULT_BATCH_SIZE})")
    plan.add_argument("--memory", type=_size, metavar="SIZE",
                      help="the memory a step may use, e.g. 8GiB: also print the largest batch "
                           "that fits, plain and with memsave")
    plan.add_argument("--checkpoints", default="memory", metavar="STRATEGY",
                      help="memsave's planner (default 'memory'; also 'speed', or any name "
                           "memsave.planners.available() lists)")
    plan.add_argument("--memory-budget", type=_budget, metavar="BUDGET",
                      help="plan memsave's checkpoints to a budget: a fraction such as 0.5 (of "
                           "the plain forecast), or bytes such as 2GiB")
    plan.add_argument("--json", action="store_true",
                      help="print one JSON object instead of the table")
    plan.set_defaults(run=_run_plan)
    return parser


# -- argument types (argparse turns their UsageError into parser.error) --------------------


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except MemsaveError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size of at least one byte; write a number and a unit, such as "
            "8GiB or 512MB (B, KiB, MiB, GiB, TiB or KB, MB, GB, TB; none means bytes)"
        ) from None


def _budget(text: str) -> int | float:
    """A fraction (a number with a decimal point) or bytes (an integer, or a size with a unit)."""
    if "." in text and text.replace(".", "", 1).strip().isdigit():
        value = float(text)
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a fraction must be in (0, 1]; give bytes with a unit, e.g. 2GiB")
        return value
    return _size(text)


# -- the plan command ------------------------------------------------------------------------


def _run_plan(args) -> int:
    from memsave import planners

    # A mistake fails now, before the model loads (a command line names
    # planners only: no list of tensors instead).
    planners.check(args.checkpoints, budget=args.memory_budget, api="memsave plan",
                   instead=None)
    model = _load_model(args.model)
    from memsave.capacity import Forecasts

    x, y = _batch_specs(model)
    forecasts = Forecasts(model, x, y, checkpoints=args.checkpoints,
                          memory_budget=args.memory_budget, api="memsave plan")
    try:
        plan = forecasts.plan(args.batch_size)
    except ValueError as e:  # Keras' own, tracing fit's step of a model compiled without a loss
        if "No loss to compute" not in str(e):
            raise
        raise UsageError(
            f"MODEL {args.model!r}: model {model.name!r} was compiled without a loss and adds "
            "none itself, so fit has no step to forecast; compile it with one (model.compile("
            "optimizer=..., loss=...))") from None
    if plan is None:  # the budget cannot be met at this batch
        raise forecasts.unmet(args.batch_size)
    fits = {}
    if args.memory is not None:
        for method, plain in (("plain", True), ("memsave", False)):
            try:
                b = forecasts.max_batch_size(args.memory, plain=plain, start=args.batch_size)
                fits[method] = {"batch_size": b,
                                "peak_bytes": int(forecasts.peak(b, plain=plain)),
                                "margin": forecasts.margin(b, plain=plain)}
            except NoBatchFitsError as e:
                fits[method] = {"batch_size": None, "batch_1_peak_bytes": e.batch_1_peak_bytes,
                                "margin": forecasts.margin(1, plain=plain)}
    report = _report(model, x, y, args, plan, fits, forecasts.traces)
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report))
    return 0


def _load_model(spec: str):
    """The model MODEL names: a .keras file, or module:function (see --help)."""
    if spec.endswith(".keras") or os.path.exists(spec):
        if not os.path.isfile(spec):
            raise UsageError(f"MODEL {spec!r}: no such file")
        import keras

        try:
            with warnings.catch_warnings():
                # "Skipping variable loading for optimizer ...": a model saved before
                # its first fit step has no optimizer slots yet; the forecast builds them.
                warnings.simplefilter("ignore")
                model = keras.saving.load_model(spec, compile=True)
        except Exception as e:  # noqa: BLE001 - any loading failure is the file's
            raise UsageError(f"MODEL {spec!r}: cannot load it as a Keras model "
                             f"({type(e).__name__}: {_one_line(e)})") from None
    elif ":" in spec:
        model = _call_factory(spec)
    else:
        raise UsageError(f"MODEL {spec!r} is neither a .keras file nor module:function "
                         "(e.g. mypackage.models:build)")
    import keras

    if not isinstance(model, keras.Model):
        raise UsageError(f"MODEL {spec!r} gave {type(model).__name__}, not a keras.Model")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise UsageError(
            f"MODEL {spec!r}: model {model.name!r} is not compiled; the forecast is of fit's "
            "train step, which needs its loss and optimizer: compile it (model.compile("
            "optimizer=..., loss=...)) before saving it or returning it")
    return model


def _call_factory(spec: str):
    module_name, _, function_name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise UsageError(f"MODEL {spec!r}: no such file {module_name!r}")
            loader_spec = importlib.util.spec_from_file_location("_memsave_model", module_name)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any import failure is the module's
        raise UsageError(f"MODEL {spec!r}: cannot import {module_name!r} "
                         f"({type(e).__name__}: {_one_line(e)})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UsageError(f"MODEL {spec!r}: {module_name!r} has no function {function_name!r}")
    try:
        return function()
    except Exception as e:  # noqa: BLE001 - the user's function failed
        raise UsageError(f"MODEL {spec!r}: {function_name}() raised "
                         f"{type(e).__name__}: {_one_line(e)}") from None


def _batch_specs(model) -> tuple:
    """TensorSpecs of one sample's batch: inputs from the model, targets from its outputs and loss."""
    import keras
    import tensorflow as tf

    try:
        inputs, outputs = list(model.inputs), list(model.outputs)
    except (AttributeError, ValueError):
        inputs, outputs = [], []
    if not inputs or not outputs:
        raise UsageError(
            f"model {model.name!r} has no input shape (a subclassed model, or one built "
            "without keras.Input); use memsave.keras.max_batch_size(model, x, y, memory=...) "
            "with a batch instead")
    for t in inputs:
        if any(d is None for d in t.shape[1:]):
            raise UsageError(
                f"model {model.name!r}: input {t.name!r} has shape {tuple(t.shape)}, with unknown "
                "dimensions besides the batch; use memsave.keras.max_batch_size with a batch")
    x = [tf.TensorSpec((1, *t.shape[1:]), t.dtype) for t in inputs]
    try:
        structure = model.input  # a dict for keras.Model({"a": ...}, ...): fed by name
    except (AttributeError, ValueError):
        structure = None
    if isinstance(structure, dict):
        x = {name: tf.TensorSpec((1, *t.shape[1:]), t.dtype) for name, t in structure.items()}
    losses = model.loss if isinstance(model.loss, (list, tuple)) else [model.loss] * len(outputs)
    if isinstance(model.loss, dict):
        losses = [model.loss.get(_output_name(t)) for t in outputs]
    sparse = {keras.losses.sparse_categorical_crossentropy}
    y = []
    for t, loss in zip(outputs, losses):
        fn = keras.losses.get(loss) if isinstance(loss, str) else loss
        if getattr(fn, "fn", fn) in sparse:  # class ids, one per sample
            y.append(tf.TensorSpec((1, *t.shape[1:-1]), tf.int32))
        else:
            y.append(tf.TensorSpec((1, *t.shape[1:]), keras.config.floatx()))
    return (x[0] if isinstance(x, list) and len(x) == 1 else x), (y[0] if len(y) == 1 else y)


def _output_name(t) -> str:
    history = getattr(t, "_keras_history", None)
    return history.operation.name if history is not None else t.name


# -- what is printed ------------------------------------------------------------------------


def _report(model, x, y, args, plan, fits: dict, traces: int) -> dict:
    """Everything the command prints, as JSON-able values (the table formats this)."""
    import tensorflow as tf

    checkpoints = set(plan.checkpoints)
    kept = [k for k in plan.kept if k.name in checkpoints]
    others: dict = {}
    for k in plan.kept:
        if k.name not in checkpoints:
            entry = others.setdefault(k.op_type, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += k.bytes

    def spec(s):
        return {"shape": [args.batch_size, *s.shape[1:]], "dtype": s.dtype.name}

    return {
        "model": model.name,
        "weights": sum(math.prod(v.shape) for v in model.trainable_weights),
        "batch_size": args.batch_size,
        "inputs": [spec(s) for s in tf.nest.flatten(x)],
        "targets": [spec(s) for s in tf.nest.flatten(y)],
        "checkpoints": args.checkpoints,
        "memory_budget": args.memory_budget,
        "memory_bytes": args.memory,
        "plain": {
            "peak_bytes": plan.baseline_peak_bytes,
            "max_batch_size": fits.get("plain"),
        },
        "memsave": {
            "peak_bytes": plan.predicted_peak_bytes,
            "recompute_flops": plan.recompute_cost,
            "forward_flops": plan.forward_cost,
            "recomputed_ops": plan.recomputed_ops,
            "checkpoints": [{"name": k.name, "shape": list(k.shape) if k.shape else None,
                             "bytes": k.bytes} for k in sorted(kept, key=lambda k: -k.bytes)],
            "checkpoint_bytes": plan.checkpoint_bytes,
            "kept_anyway": others,
            "max_batch_size": fits.get("memsave"),
        },
        "resident_bytes": plan.resident_bytes,
        "allocator": plan.allocator,
        "note": plan.note,
        "assumptions": list(plan.assumptions),
        "traces": traces,
    }


def _table(r: dict) -> str:
    plain, ours = r["plain"], r["memsave"]

    def shapes(specs):
        return ", ".join(f"[{', '.join(map(str, s['shape']))}] {s['dtype']}" for s in specs)

    # (A plain peak of 0 bytes: every buffer under the allocator's counting threshold.)
    change = (f"({ours['peak_bytes'] / plain['peak_bytes'] - 1:+.1%})" if plain["peak_bytes"]
              else "(n/a)")
    passes = ours["recompute_flops"] / max(ours["forward_flops"], 1)
    budget = "" if r["memory_budget"] is None else f", memory budget {r['memory_budget']}"
    lines = [
        f"memsave plan: model {r['model']!r} ({r['weights']:,} trainable weights), batch "
        f"{r['batch_size']}, checkpoints={r['checkpoints']!r}{budget}",
        f"  input {shapes(r['inputs'])}; target {shapes(r['targets'])}",
        "",
        f"  {'':22}{'plain fit':>18}{'memsave':>18}",
        f"  {'forecast peak':22}{_mib(plain['peak_bytes']):>18}{_mib(ours['peak_bytes']):>18}"
        f"  {change}",
        f"  {'resident':22}{_mib(r['resident_bytes']):>18}{_mib(r['resident_bytes']):>18}"
        "  (weights, optimizer slots, metrics, the batch)",
        f"  {'recompute':22}{'-':>18}{f'{passes:.2f} fwd passes':>18}"
        f"  ({ours['recompute_flops']:,} FLOPs, {ours['recomputed_ops']} ops)",
        f"  {'kept':22}{'every activation':>18}{str(len(ours['checkpoints'])) + ' checkpoints':>18}"
        f"  ({_mib(ours['checkpoint_bytes'])})",
    ]
    if r["memory_bytes"] is not None:
        fits = plain["max_batch_size"], ours["max_batch_size"]
        lines.append(
            f"  {'largest batch':22}{_answer(fits[0]):>18}{_answer(fits[1]):>18}"
            f"  in {_mib(r['memory_bytes'])}, forecast padded by {fits[0]['margin']:.0%} / "
            f"{fits[1]['margin']:.0%}")
    if ours["checkpoints"]:
        lines += ["", "  checkpoints (largest first):"]
        for k in ours["checkpoints"][:TABLE_CHECKPOINTS]:
            shape = "?" if k["shape"] is None else "[" + ", ".join(
                "?" if d is None else str(d) for d in k["shape"]) + "]"
            lines.append(f"    {_mib(k['bytes']):>12}  {shape:<22} {k['name']}")
        if len(ours["checkpoints"]) > TABLE_CHECKPOINTS:
            lines.append(f"    ... {len(ours['checkpoints']) - TABLE_CHECKPOINTS} more (--json lists all)")
    if ours["kept_anyway"]:
        kinds = sorted(ours["kept_anyway"].items(), key=lambda kv: -kv[1]["bytes"])
        lines.append("  kept anyway: " + ", ".join(
            f"{v['count']} {op} ({_mib(v['bytes'])})" for op, v in kinds))
    if r["note"]:
        lines.append(f"  note: {r['note']}")
    return "\n".join(lines)


def _answer(fit) -> str:
    if fit["batch_size"] is not None:
        return f"{fit['batch_size']:,}"
    return f"none (1: {_mib(fit['batch_1_peak_bytes'])})"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
