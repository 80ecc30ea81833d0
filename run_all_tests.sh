#!/usr/bin/env bash
# Install what the tests need (scripts/bootstrap.sh, quiet when nothing to
# do), then run the whole test suite. Extra arguments go to pytest, e.g.
#   ./run_all_tests.sh -m "not slow"     the fast tier (a few minutes)
#   ./run_all_tests.sh -x -k gradients
# Tests run in parallel on pytest-xdist workers, one per CPU
# (MEMSAVE_TEST_WORKERS=N sets how many; -n N on the command line too;
# -n 0 runs them in this process, e.g. for --pdb).
# Exits non-zero when pytest collects no test (its exit code 5): a suite
# that runs nothing must not look green.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

scripts/bootstrap.sh

# TensorFlow's C++ INFO lines (oneDNN notices) drown pytest's output.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

# Workers, unless the arguments choose (-n, --numprocesses, --dist, -p no:xdist).
# --dist loadgroup: tests one by one to whichever worker is free, except
# those marked pytest.mark.xdist_group(name), which share a worker (see
# tests/conftest.py).
parallel=(-n "${MEMSAVE_TEST_WORKERS:-auto}" --dist loadgroup)
for arg in "$@"; do
    case "$arg" in
        -n|-n[0-9]*|-nauto|--numprocesses|--numprocesses=*|--dist|--dist=*|no:xdist)
            parallel=() ;;
    esac
done

rc=0
.venv/bin/python -m pytest -q tests ${parallel[@]+"${parallel[@]}"} "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_all_tests.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
