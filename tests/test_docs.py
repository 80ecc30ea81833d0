"""The documentation runs: every ```python block of README.md and docs/*.md.

Each file's blocks run in order in one namespace (a block may use what an
earlier block of the same file defined), in a fresh process per file
(tests/fresh.py: a block's settings, such as a Keras dtype policy, reach no
other test) whose working directory is an empty temporary one. A block
that fails fails its file's test, naming the block's line. Text that is
not meant to run is not a ```python block (```text, or indented).

Blocks that use an API not merged yet (:data:`PENDING_APIS`) are skipped
while it is missing, and listed by a test of their own that is skipped with
their lines; they run as soon as the API exists.

Also: the README stays a front door (at most :data:`README_MAX_LINES`
lines), and every relative link in these files points at a file in the
repository.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 150
RUN_TIMEOUT_S = 600

#: Public names documented ahead of their merge: (module, attribute) and
#: the text that marks a block using it.
PENDING_APIS = {"max_batch_size": ("memsave.keras", "max_batch_size")}

_FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block, in order."""
    blocks, lang, start, lines = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(line)
        if lang is None and m:
            lang, start, lines = m.group(1), n + 1, []
        elif lang is not None and line.rstrip() == "```":
            if lang == "python":
                blocks.append((start, "\n".join(lines) + "\n"))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, f"{path.name}: a ``` fence opened at line {start - 1} is never closed"
    return blocks


def _missing_apis() -> set[str]:
    missing = set()
    for marker, (module, attr) in PENDING_APIS.items():
        __import__(module)
        if not hasattr(sys.modules[module], attr):
            missing.add(marker)
    return missing


def _pending(source: str, missing: set[str]) -> bool:
    return any(marker in source for marker in missing)


def run_blocks(spec: str) -> str:
    """Run the blocks listed in the file ``spec`` in one namespace, in order, in
    ``spec``'s directory; on the first failure raise, naming the block (with
    the traceback); return what they printed. Called in a fresh process
    (tests/fresh.py).

    Each block is written to a file of its own first, as a user's script
    would be, so that code reading its source (autograph, in tf.function)
    finds it.
    """
    os.chdir(Path(spec).parent)
    os.environ["MPLBACKEND"] = "Agg"
    namespace = {"__name__": "__main__"}
    printed = io.StringIO()
    for i, (where, source) in enumerate(json.loads(Path(spec).read_text())):
        path = Path(f"block_{i:02d}.py").resolve()
        path.write_text(source)
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(source, str(path), "exec"), namespace)
        except BaseException as e:
            raise AssertionError(f"FAILED: the block at {where} ({path.name})") from e
    return printed.getvalue()


def _id(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=_id)
def test_python_blocks_run(fresh, path, tmp_path):
    missing = _missing_apis()
    blocks = [(f"{_id(path)}:{line}", source) for line, source in python_blocks(path)
              if not _pending(source, missing)]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    printed = fresh.call(run_blocks, str(spec), timeout_s=RUN_TIMEOUT_S)
    if path.name == "README.md":  # the prose states what the first example prints
        said = re.search(r"forecasts are (\d+) MiB for plain `fit` and (\d+) MiB with memsave",
                         " ".join(path.read_text().split()))
        shown = re.search(r"plain fit: (\d+) MiB, memsave: (\d+) MiB", printed)
        assert said and shown, printed
        assert said.groups() == shown.groups(), (said.group(0), shown.group(0))


def test_blocks_waiting_for_an_api():
    missing = _missing_apis()
    waiting = [f"{_id(p)}:{line}" for p in DOCS for line, source in python_blocks(p)
               if _pending(source, missing)]
    if waiting:
        pytest.skip(f"not merged yet: {sorted(missing)}; blocks not run: {', '.join(waiting)}")


def test_every_doc_has_runnable_examples_where_it_promises_them():
    # The README and the user guide teach by example: each must hold blocks
    # the test above runs (a block turned into text would slip through).
    for path in (REPO / "README.md", REPO / "docs" / "guide.md"):
        assert len(python_blocks(path)) >= 3, f"{_id(path)} has almost no ```python blocks"


def test_readme_is_short():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/")


_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)]*)?\)")


def test_relative_links_point_at_files():
    broken = []
    for path in [*DOCS, REPO / "CHANGELOG.md"]:
        for target, _ in _LINK.findall(path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{_id(path)} -> {target}")
    assert not broken, f"links to missing files: {broken}"
