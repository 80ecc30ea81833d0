#!/usr/bin/env bash
# Install what the tests need (scripts/bootstrap.sh, quiet when nothing to
# do), then run the whole test suite. Extra arguments go to pytest, e.g.
#   ./run_all_tests.sh -x -k gradients
# Exits non-zero when pytest collects no test (its exit code 5): a suite
# that runs nothing must not look green.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

scripts/bootstrap.sh

# TensorFlow's C++ INFO lines (oneDNN notices) drown pytest's output.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

rc=0
.venv/bin/python -m pytest -q tests "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_all_tests.sh: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
