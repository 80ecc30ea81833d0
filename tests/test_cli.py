"""The command line, ``python -m memsave plan MODEL`` (memsave/cli.py).

In-process tests call :func:`memsave.cli.main` on a small saved ``.keras``
model: the table and the JSON carry the plan's figures and the largest
batches :func:`memsave.keras.max_batch_size` gives, and every bad input
ends in exit status 2 with exactly one line on stderr. The slow test runs
``python -m memsave`` itself in fresh processes: ``--help``, a table, and
each bad input (exit status 2, one line of memsave's on stderr, no
traceback; TensorFlow's own C++ start-up lines, which loading TensorFlow
prints before any memsave code runs, are recognised by comparison with a
bare ``import memsave.keras`` and set aside). Two quick processes check
that ``import memsave`` and ``--help`` load no TensorFlow, and that without
TensorFlow ``import memsave`` says what to install.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import memsave.keras
from memsave.cli import main

MEMORY = "64MiB"

#: The module-scoped files and answers are built once, on one worker (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("test_cli")


def _mlp(compiled=True, depth=12, width=256):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + [keras.layers.Dense(10)], name="cli_mlp")
    if compiled:
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A saved compiled model, a saved uncompiled one, and a module of model factories."""
    d = tmp_path_factory.mktemp("cli")
    _mlp().save(d / "mlp.keras")
    _mlp(compiled=False).save(d / "raw.keras")
    (d / "broken.keras").write_bytes(b"not a zip file")
    (d / "factories.py").write_text(textwrap.dedent("""
        import keras

        def compiled():
            m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64), keras.layers.Dense(3)])
            m.compile(optimizer="sgd", loss="mse")
            return m

        def uncompiled():
            return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])

        def without_loss():
            m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
            m.compile(optimizer="adam")
            return m

        def by_name():
            z, a = keras.Input((32,), name="z"), keras.Input((16,), name="a")
            h = keras.layers.Concatenate()([keras.layers.Dense(8)(z), keras.layers.Dense(8)(a)])
            m = keras.Model({"z": z, "a": a}, keras.layers.Dense(1)(h))
            m.compile(optimizer="sgd", loss="mse")
            return m

        def fails():
            raise RuntimeError("cannot build\\nthis model")

        def not_a_model():
            return 42
    """))
    return d


@pytest.fixture(scope="module")
def expected(files):
    """max_batch_size's answers for the saved model, plain and memsave."""
    model = keras.saving.load_model(files / "mlp.keras")
    x, y = np.zeros((1, 256), np.float32), np.zeros((1,), np.int32)
    return {c: memsave.keras.max_batch_size(model, x, y, memory=MEMORY, checkpoints=c)
            for c in (None, "memory")}


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table(files, expected, capsys):
    code, out, err = _run(capsys, "plan", files / "mlp.keras", "--memory", MEMORY,
                          "--batch-size", 2048)
    assert code == 0, err
    model = keras.saving.load_model(files / "mlp.keras")
    x, y = np.zeros((1, 256), np.float32), np.zeros((1,), np.int32)
    p = memsave.keras.plan(model, x, y, batch_size=2048)
    assert "model 'cli_mlp'" in out and "batch 2048" in out
    assert "input [2048, 256] float32; target [2048] int32" in out
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    peak_row = next(line for line in out.splitlines() if "forecast peak" in line)
    assert mib(p.baseline_peak_bytes) in peak_row and mib(p.predicted_peak_bytes) in peak_row
    assert p.predicted_peak_bytes < p.baseline_peak_bytes, "memsave keeps fewer at this batch"
    assert f"{len(p.checkpoints)} checkpoints" in out and "recompute" in out
    row = next(line for line in out.splitlines() if "largest batch" in line)
    assert row.split()[2:4] == [f"{expected[None]:,}", f"{expected['memory']:,}"], row
    assert expected["memory"] > expected[None]
    assert "checkpoints (largest first):" in out and "kept anyway:" in out


def test_json(files, expected, capsys):
    code, out, err = _run(capsys, "plan", files / "mlp.keras", "--memory", MEMORY, "--json")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1, "one JSON object, one line"
    r = json.loads(out)
    assert r["batch_size"] == 32 and r["memory_bytes"] == 64 * 2**20
    assert r["plain"]["max_batch_size"]["batch_size"] == expected[None]
    assert r["memsave"]["max_batch_size"]["batch_size"] == expected["memory"]
    assert r["inputs"] == [{"shape": [32, 256], "dtype": "float32"}]
    assert r["targets"] == [{"shape": [32], "dtype": "int32"}]
    assert r["plain"]["peak_bytes"] >= r["memsave"]["peak_bytes"] > r["resident_bytes"] > 0


def test_module_function(files, capsys, monkeypatch):
    """module:function and path/file.py:function; a mse loss's target is shaped like the output."""
    monkeypatch.syspath_prepend(str(files))
    for spec in ("factories:compiled", f"{files / 'factories.py'}:compiled"):
        code, out, err = _run(capsys, "plan", spec, "--json")
        assert code == 0, err
        assert json.loads(out)["targets"] == [{"shape": [32, 3], "dtype": "float32"}]


def test_a_model_fed_by_name(files, capsys, monkeypatch):
    """Inputs given as a dict, its keys not in sorted order: the batch is
    fed by name (it was a list, which Keras refused, with a traceback).
    Every buffer of this model is under the CPU allocator's counting
    threshold: both peaks are 0 bytes, and the change is n/a (it read
    -100.0%)."""
    monkeypatch.syspath_prepend(str(files))
    code, out, err = _run(capsys, "plan", "factories:by_name", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert sorted(map(str, r["inputs"])) == sorted(map(str, [
        {"shape": [32, 32], "dtype": "float32"}, {"shape": [32, 16], "dtype": "float32"}]))
    code, out, err = _run(capsys, "plan", "factories:by_name")
    assert code == 0, err
    peak_row = next(line for line in out.splitlines() if "forecast peak" in line)
    assert r["plain"]["peak_bytes"] == 0 and peak_row.endswith("(n/a)"), peak_row


def test_without_memory_there_is_no_batch_search(files, capsys):
    code, out, _ = _run(capsys, "plan", files / "mlp.keras", "--json")
    assert code == 0
    r = json.loads(out)
    assert r["memory_bytes"] is None and r["plain"]["max_batch_size"] is None
    assert r["traces"] == 1


def test_nothing_fits_is_an_answer(files, capsys):
    code, out, _ = _run(capsys, "plan", files / "mlp.keras", "--memory", "1MiB", "--json")
    assert code == 0
    fit = json.loads(out)["plain"]["max_batch_size"]
    assert fit["batch_size"] is None and fit["batch_1_peak_bytes"] > 2**20


def _bad_inputs(d) -> dict:
    """argv of each bad input, and what its one line must say."""
    return {
        "missing file": (["plan", d / "missing.keras"], "no such file"),
        "not compiled (file)": (["plan", d / "raw.keras"], "not compiled"),
        "not compiled (function)": (["plan", "factories:uncompiled"], "not compiled"),
        "compiled without a loss": (["plan", "factories:without_loss"], "without a loss"),
        "not a model file": (["plan", d / "broken.keras"], "cannot load it"),
        "unparsable size": (["plan", d / "mlp.keras", "--memory", "8 gigs"], "'8 gigs' is not a size"),
        "zero size": (["plan", d / "mlp.keras", "--memory", "0"], "'0' is not a size"),
        "no such module": (["plan", "no_such_module_xyz:build"], "cannot import"),
        "no such function": (["plan", "factories:nope"], "has no function 'nope'"),
        "function raises": (["plan", "factories:fails"], "fails() raised RuntimeError"),
        "not a model": (["plan", "factories:not_a_model"], "gave int, not a keras.Model"),
        "neither": (["plan", "justaword"], "neither a .keras file nor module:function"),
        "bad batch size": (["plan", d / "mlp.keras", "--batch-size", "-3"], "not a positive integer"),
        "bad strategy": (["plan", d / "mlp.keras", "--checkpoints", "fastest"], "'fastest'"),
        "bad budget": (["plan", d / "mlp.keras", "--memory-budget", "2.5"], "fraction must be"),
        "budget refused": (["plan", d / "mlp.keras", "--checkpoints", "speed", "--memory-budget",
                            "0.5"], "cannot be combined with checkpoints='speed'"),
        "unmet budget": (["plan", d / "mlp.keras", "--memory-budget", "1KiB"], "memory_budget"),
        "no command": ([], "give a command"),
        "unknown command": (["fit"], "invalid choice"),
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs(pathlib.Path("."))))
def test_bad_input_is_one_line_and_status_2(files, capsys, monkeypatch, case):
    monkeypatch.syspath_prepend(str(files))
    argv, says = _bad_inputs(files)[case]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("memsave: error: ") and says in lines[0], lines[0]
    assert "Traceback" not in err and out == ""


def test_an_unknown_planner_lists_the_planners_before_the_model_loads(capsys):
    code, out, err = _run(capsys, "plan", "no_such_file.keras", "--checkpoints", "fastest")
    assert code == 2 and out == ""
    assert "checkpoints='fastest' is not a known strategy; use one of [" in err
    assert "'memory'" in err and "tensors" not in err  # a command line cannot pass tensors


def test_the_commands_the_docs_show_parse_and_plan():
    from memsave import planners
    from memsave.cli import _parser

    repo = pathlib.Path(__file__).resolve().parent.parent
    shown = [line.split()[3:]
             for path in (repo / "README.md", *sorted((repo / "docs").glob("*.md")),
                          repo / "memsave" / "cli.py")
             for line in path.read_text().splitlines()
             if line.strip().startswith("python -m memsave plan ")]
    assert len(shown) >= 3
    for argv in shown:
        args = _parser().parse_args(argv)
        # What memsave plan checks before it loads the model (a budget with a
        # planner that refuses one is refused there).
        planners.check(args.checkpoints, budget=args.memory_budget, api=" ".join(argv))


# -- importing memsave -------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def test_import_memsave_and_help_load_no_tensorflow():
    # PEP 562: memsave's names load on first use; errors and the CLI's
    # argument parsing need no TensorFlow (--help answers in a fraction of a second).
    proc = _python(textwrap.dedent("""
        import runpy, sys
        import memsave
        assert "tensorflow" not in sys.modules, "import memsave"
        assert issubclass(memsave.MemoryBudgetError, memsave.MemsaveError)
        assert "tensorflow" not in sys.modules, "memsave.MemsaveError"
        sys.argv = ["memsave", "--help"]
        try:
            runpy.run_module("memsave", run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, e.code
        assert "tensorflow" not in sys.modules, "python -m memsave --help"
        print("ok")
    """))
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "ok", proc.stderr
    assert "plan" in proc.stdout  # the help text


def test_names_load_on_first_use_and_patch_is_the_function():
    proc = _python(textwrap.dedent("""
        import sys
        import memsave
        import memsave.patching  # the module first: memsave.patch must stay the function
        assert callable(memsave.patch) and memsave.patch is memsave.patching.patch
        assert memsave.gradients.__module__ == "memsave.api"
        assert memsave.simulate.__name__ == "memsave.simulate"
        assert "tensorflow" in sys.modules
        assert set(memsave.__all__) <= set(dir(memsave))
        import memsave.errors  # every error class, as `except memsave.<Name>:` (docs/guide.md)
        for name in memsave.errors.__all__:
            assert getattr(memsave, name) is getattr(memsave.errors, name), name
        try:
            memsave.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("memsave.no_such_name did not raise")
        print("ok")
    """))
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "ok", proc.stderr


def test_without_tensorflow_import_memsave_says_what_to_install():
    proc = _python("import sys; sys.modules['tensorflow'] = None; import memsave")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: memsave needs TensorFlow"), proc.stderr
    assert "pip install tensorflow-cpu" in last and "'.[tensorflow-cpu]'" in last


# -- as a command, in fresh processes ------------------------------------------------------


def _normalized(line: str) -> str:
    # digits and the spaces that pad them (a thread id's width varies)
    return re.sub(r"[\d\s]+", " ", line).strip()


#: Processes run at once (each mostly waits on importing TensorFlow, ~300 MB each).
PARALLEL = 4

#: Bad inputs also run as commands: the first stage that can fail (the
#: arguments) and the last (planning). Every bad input's message, status and
#: single line is checked in-process above, where loading a file and calling
#: a factory fail through the same handler; what a process adds (exit
#: status, no traceback, nothing but TensorFlow's start-up lines besides
#: ours) does not depend on the message, and each process costs a TensorFlow
#: start-up (seconds on 2 busy cores: all 17 took 150 s).
AS_COMMANDS = ("no command", "unmet budget")


@pytest.mark.slow
def test_python_m_memsave(fresh, files, expected):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(files), os.environ.get("PYTHONPATH", "")]))

    def run(argv):
        proc = fresh.run([sys.executable, *argv], env=env, cwd=files, timeout_s=600)
        return proc.returncode, proc.stdout, proc.stderr

    bad = {case: v for case, v in _bad_inputs(files).items() if case in AS_COMMANDS}
    assert len(bad) == len(AS_COMMANDS)
    commands = {
        "banner": ["-c", "import memsave.keras"],
        "help": ["-m", "memsave", "--help"],
        "table": ["-m", "memsave", "plan", files / "mlp.keras", "--memory", MEMORY],
        **{case: ["-m", "memsave", *argv] for case, (argv, _) in bad.items()},
    }
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        results = dict(zip(commands, pool.map(run, commands.values())))

    tensorflow_lines = {_normalized(line) for line in results["banner"][2].splitlines()}
    code, out, err = results["help"]
    assert code == 0 and "plan" in out, err
    code, out, err = results["table"]
    assert code == 0, err
    row = next(line for line in out.splitlines() if "largest batch" in line)
    assert row.split()[2:4] == [f"{expected[None]:,}", f"{expected['memory']:,}"]

    for case, (argv, says) in bad.items():
        code, out, err = results[case]
        ours = [line for line in err.splitlines() if _normalized(line) not in tensorflow_lines]
        assert code == 2, (case, err)
        assert "Traceback" not in err, (case, err)
        assert len(ours) == 1 and ours[0].startswith("memsave: error: "), (case, err)
        assert says in ours[0], (case, ours[0])
