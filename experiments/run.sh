#!/usr/bin/env bash
# The flagship experiment: memsave vs tf.gradients vs GradientTape on a
# CIFAR-10-shaped ResNet. Installs what it needs on first use, then passes
# all arguments to experiments/resnet_cifar.py (see --help there).
#   ./experiments/run.sh                       # a few minutes on 2 cores
#   ./experiments/run.sh --blocks-per-stage 9  # ResNet-56
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/experiments/resnet_cifar.py" "$@"
