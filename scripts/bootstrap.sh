#!/usr/bin/env bash
# Make sure <repo>/.venv exists and holds memsave (editable) with its test and
# experiment extras plus a pinned TensorFlow. Idempotent and quiet: when the
# environment already matches, it returns in about a second without touching
# the network.
#
# Usage: scripts/bootstrap.sh            (prints nothing on success)
#   PYTHON=python3.11 scripts/bootstrap.sh         interpreter for a new venv
#   MEMSAVE_TF_REQUIREMENT='tensorflow==2.21.0' scripts/bootstrap.sh
#                                        another TF distribution or version
#   MEMSAVE_BOOTSTRAP_FORCE=1 scripts/bootstrap.sh  reinstall unconditionally
#
# Needs only python3 (>=3.10, with venv or pip) and a reachable package index.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"
TF_REQUIREMENT="${MEMSAVE_TF_REQUIREMENT:-tensorflow-cpu==2.21.0}"
EXTRAS="test,experiments"
LOG="$VENV/bootstrap.log"

say() { echo "bootstrap: $*" >&2; }

# Two scripts started at once (tests and the experiment) must not both
# install into the same venv: serialise on a lock file next to it.
mkdir -p "$VENV"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV/.bootstrap.lock"
    flock 9
fi

# Everything the install decides on; when it changes, the venv is refreshed.
stamp_value() {
    {
        echo "tf=$TF_REQUIREMENT extras=$EXTRAS root=$ROOT"
        cat "$ROOT/pyproject.toml"
    } | cksum | cut -d' ' -f1
}

# True when the venv already holds what we would install. Checks installed
# distributions (not `import memsave`, which would succeed from the repo root
# by accident, and which may be mid-edit), and that the editable memsave
# points at this checkout.
satisfied() {
    [ -x "$VPY" ] || return 1
    [ -f "$VENV/.memsave-bootstrap-stamp" ] || return 1
    [ "$(cat "$VENV/.memsave-bootstrap-stamp")" = "$(stamp_value)" ] || return 1
    "$VPY" -I - "$ROOT" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util, json, os, sys
root = sys.argv[1]
for mod in ("tensorflow", "networkx", "pytest", "xdist", "build", "matplotlib"):
    if importlib.util.find_spec(mod) is None:
        sys.exit(f"missing {mod}")
direct = json.loads(md.distribution("memsave").read_text("direct_url.json") or "{}")
url = direct.get("url", "")
if not (direct.get("dir_info", {}).get("editable")
        and os.path.realpath(url.removeprefix("file://")) == os.path.realpath(root)):
    sys.exit(f"memsave installed from {url!r}, not {root!r}")
# An editable install made while memsave/ had no __init__.py maps it as a
# namespace package for good; reinstall once the package is a real one.
init = os.path.join(root, "memsave", "__init__.py")
if os.path.exists(init):
    origin = importlib.util.find_spec("memsave").origin or ""
    if os.path.realpath(origin) != os.path.realpath(init):
        sys.exit(f"memsave resolves to {origin!r}, not {init!r}")
EOF
}

if [ "${MEMSAVE_BOOTSTRAP_FORCE:-0}" != 1 ] && satisfied; then
    exit 0
fi

if [ ! -x "$VPY" ]; then
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        say "need Python >= 3.10 as \$PYTHON (got: $("$PYTHON" -V 2>&1 || echo "no $PYTHON"))"
        exit 1
    fi
    say "creating $VENV with $("$PYTHON" -V 2>&1)"
    # Debian's python3 may lack ensurepip (python3-venv); fall back to virtualenv.
    if ! "$PYTHON" -m venv "$VENV" >"$LOG.venv" 2>&1; then
        say "python -m venv failed ($(tail -n 1 "$LOG.venv")); trying virtualenv"
        "$PYTHON" -m pip install -q --user virtualenv
        "$PYTHON" -m virtualenv -q "$VENV"
    fi
fi

say "installing memsave[$EXTRAS] and $TF_REQUIREMENT into $VENV (log: $LOG)"
start=$(date +%s)
if ! "$VPY" -m pip install --disable-pip-version-check \
        -e "$ROOT[$EXTRAS]" "$TF_REQUIREMENT" >"$LOG" 2>&1; then
    say "pip install failed; last lines of $LOG:"
    tail -n 30 "$LOG" >&2
    exit 1
fi
stamp_value >"$VENV/.memsave-bootstrap-stamp"
if ! satisfied; then
    say "installed, but the environment check still fails; see $LOG"
    exit 1
fi
say "done in $(( $(date +%s) - start )) s"
