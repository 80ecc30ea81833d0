"""The package as a user installs it: built, installed outside the checkout, run.

The other tests import memsave from the checkout (an editable install), so
a wheel that leaves a subpackage out would pass them all. Here the sdist
and the wheel are built from a copy of the checkout with this environment's
``build`` and setuptools (``--no-isolation``: nothing is downloaded), the
wheel is installed by pip into an empty directory, and a fresh interpreter
that cannot see the checkout imports memsave from there and differentiates
a small model with ``checkpoints='memory'`` and with ``memory_budget=0.5``
(the solvers), against ``tf.gradients``.

"Cannot see the checkout": the interpreter runs with ``-I -S`` from an
empty directory, so neither the checkout nor the editable install's import
hook (a ``.pth`` file in site-packages) is on its path; this environment's
site-packages is appended, without its ``.pth`` files, for TensorFlow. It
reports the file of every memsave module it loaded, and each must be in the
install directory.

Checked by breaking the packaging: with ``packages = ["memsave"]`` in place
of the package discovery in pyproject.toml, the wheel lacks memsave/planners
(memsave/solvers before it) and both the file-list test and the installed
run fail.

Also here: the declared dependencies are exactly the third-party modules
memsave imports, and the changelog, ``memsave.__version__`` and the
wheel's metadata name one version.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "memsave"

#: Not part of a build: the environment, caches, outputs of earlier builds
#: (setuptools would pack a stale build/lib into the wheel) and results.
NOT_SOURCE = (".git", ".venv", "build", "dist", "results", "*.egg-info", "__pycache__",
              ".pytest_cache", "*.pyc")

BUILD_TIMEOUT_S = 600
RUN_TIMEOUT_S = 600

#: The module-scoped build and install happen once, on one worker (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("test_packaging")


def package_files() -> set[str]:
    """Every file of the package in the checkout, as ``memsave/...`` paths."""
    return {
        p.relative_to(REPO).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def checkout_version() -> str:
    """``memsave.__version__``, read from memsave/__init__.py without importing it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)):
            return ast.literal_eval(node.value)
    raise AssertionError("memsave/__init__.py assigns no __version__")


def changelog_version() -> str:
    """The newest released version in CHANGELOG.md (the first ``## [X.Y.Z]`` heading)."""
    for line in (REPO / "CHANGELOG.md").read_text().splitlines():
        m = re.match(r"## \[(\d+\.\d+\.\d+[^\]]*)\]", line)
        if m:
            return m.group(1)
    raise AssertionError("CHANGELOG.md has no '## [X.Y.Z] - date' heading")


@pytest.fixture(scope="module")
def built(fresh, tmp_path_factory) -> dict:
    """The sdist and the wheel built from a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    r = fresh.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
         "--outdir", dist, src],
        cwd=tmp, timeout_s=BUILD_TIMEOUT_S,
    )
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (wheel,) = dist.glob("memsave-*.whl")
    (sdist,) = dist.glob("memsave-*.tar.gz")
    return {"tmp": tmp, "wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def installed(fresh, built) -> dict:
    """The wheel installed into an empty directory, and what a run from there reports."""
    tmp = built["tmp"]
    target, cwd = tmp / "target", tmp / "cwd"
    cwd.mkdir()
    r = fresh.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
         "--disable-pip-version-check", "--target", target, built["wheel"]],
        cwd=cwd, timeout_s=BUILD_TIMEOUT_S,
    )
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout}\n{r.stderr}"
    site_packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    r = fresh.run(
        [sys.executable, "-I", "-S", "-c", INSTALLED_RUN, target, *site_packages],
        cwd=cwd, env=env, timeout_s=RUN_TIMEOUT_S,
    )
    assert r.returncode == 0, (
        f"the installed memsave failed (exit {r.returncode}):\n{r.stderr[-6000:]}")
    report = json.loads(r.stdout.strip().splitlines()[-1])
    return {"target": target, "report": report}


#: Run by a fresh ``python -I -S`` with argv [target, site-packages...]:
#: import memsave from target, take the gradients of a 12-layer tanh chain
#: (activations of 512 KiB, above the CPU allocator's 256 KiB counting
#: threshold, so checkpointing is forecast to pay) with 'memory' and with
#: memory_budget=0.5, check them against tf.gradients (float32 tolerances
#: of tests/test_gradients_zoo.py), and print what was built as JSON.
INSTALLED_RUN = textwrap.dedent("""
    import json, sys
    target, *site_packages = sys.argv[1:]
    sys.path.insert(0, target)
    sys.path.extend(site_packages)

    import numpy as np
    import tensorflow as tf
    import memsave

    LAYERS, BATCH, WIDTH = 12, 1024, 128
    report = {
        "version": memsave.__version__,
        "file": memsave.__file__,
        "runs": {},
    }
    g = tf.Graph()
    with g.as_default():
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((BATCH, WIDTH)), tf.float32)
        ws = [tf.Variable(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH), dtype=tf.float32)
              for _ in range(LAYERS)]
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)

        def new_tanh_ops(build):
            before = len(g.get_operations())
            out = build()
            return out, sum(op.type == "Tanh" for op in g.get_operations()[before:])

        ref, ref_copies = new_tanh_ops(lambda: tf.gradients(loss, ws))
        report["reference_copies"] = ref_copies
        runs = {"memory": {"checkpoints": "memory"}, "budget": {"memory_budget": 0.5}}
        built = {}
        for name, kwargs in runs.items():
            p = memsave.plan(loss, ws, **kwargs)
            built[name], copies = new_tanh_ops(lambda: memsave.gradients(loss, ws, **kwargs))
            report["runs"][name] = {
                "checkpoints": list(p.checkpoints),
                "predicted_peak_bytes": p.predicted_peak_bytes,
                "baseline_peak_bytes": p.baseline_peak_bytes,
                "recomputed_copies": copies,
            }
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = sess.run({"ref": ref, **built})
    for name in runs:
        for w, r, m in zip(ws, values["ref"], values[name]):
            np.testing.assert_allclose(m, r, rtol=1e-5, atol=1e-5 * np.abs(r).max(),
                                       err_msg=f"{name}: gradient of {w.name}")
    report["modules"] = sorted(
        m.__file__ for n, m in sys.modules.items()
        if (n == "memsave" or n.startswith("memsave.")) and getattr(m, "__file__", None))
    print(json.dumps(report))
""")


@pytest.mark.slow
def test_wheel_and_sdist_hold_every_package_file(built):
    expected = package_files()
    assert "memsave/py.typed" in expected and "memsave/planners/__init__.py" in expected
    with zipfile.ZipFile(built["wheel"]) as z:
        in_wheel = {n for n in z.namelist() if n.startswith("memsave/")}
    assert in_wheel == expected, (
        f"the wheel lacks {sorted(expected - in_wheel)} and has extra {sorted(in_wheel - expected)}")
    with tarfile.open(built["sdist"]) as t:
        names = t.getnames()
    root = names[0].split("/")[0]
    in_sdist = {n.removeprefix(root + "/") for n in names}
    assert expected <= in_sdist, f"the sdist lacks {sorted(expected - in_sdist)}"
    for f in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        assert f in in_sdist, f"the sdist lacks {f}"


@pytest.mark.slow
def test_installed_wheel_imports_and_checkpoints_outside_the_checkout(installed):
    target = installed["target"].resolve()
    report = installed["report"]
    assert Path(report["file"]).resolve().is_relative_to(target), report["file"]
    outside = [f for f in report["modules"] if not Path(f).resolve().is_relative_to(target)]
    assert not outside, f"memsave modules loaded from outside the install: {outside}"
    assert any("/memsave/planners/" in f for f in report["modules"])
    # The rewrite ran: recomputed copies of forward Tanh ops (tf.gradients'
    # own gradient adds none), checkpoints chosen, and the budget met.
    assert report["reference_copies"] == 0
    for name, run in report["runs"].items():
        assert run["checkpoints"], f"{name}: nothing kept: {run}"
        assert run["recomputed_copies"] > 0, f"{name}: no recomputed copies: {run}"
        assert run["predicted_peak_bytes"] < run["baseline_peak_bytes"], f"{name}: {run}"
    budget = report["runs"]["budget"]
    assert budget["predicted_peak_bytes"] <= 0.5 * budget["baseline_peak_bytes"], budget


@pytest.mark.slow
def test_wheel_version_is_memsave_version_is_changelog_version(built, installed):
    with zipfile.ZipFile(built["wheel"]) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        wheel_version = re.search(r"^Version: (.+)$", z.read(metadata).decode(), re.M).group(1)
    assert wheel_version == installed["report"]["version"] == changelog_version()


def test_changelog_names_the_version():
    assert checkout_version() == changelog_version()


#: Third-party modules memsave may import without declaring them: TensorFlow
#: (the user picks a distribution, or an extra) and Keras 3, which every
#: TensorFlow >= 2.16 installs.
BROUGHT_BY_TENSORFLOW = {"tensorflow", "keras"}


def _imported_top_level_modules() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"memsave"}


def _module_of(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
    return {"tensorflow-cpu": "tensorflow"}.get(name, name.replace("-", "_"))


def test_declared_dependencies_are_what_memsave_imports():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {_module_of(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    optional = {_module_of(r) for e in ("tensorflow", "tensorflow-cpu", "milp", "plot")
                for r in extras[e]}
    imported = _imported_top_level_modules()
    assert base <= imported, f"declared but never imported: {sorted(base - imported)}"
    undeclared = imported - base - optional - BROUGHT_BY_TENSORFLOW
    assert not undeclared, f"imported but not declared: {sorted(undeclared)}"
