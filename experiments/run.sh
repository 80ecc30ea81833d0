#!/usr/bin/env bash
# The memory/speed study (experiments/study.py): peak memory, step time and
# build time of memsave vs GradientTape, tf.gradients and tf.recompute_grad on
# a CIFAR-10-shaped ResNet (up to ResNet-110), a deep MLP chain, a U-Net-like
# net and an LSTM run by a tf.while_loop (T=32..128: memsave's per-step and
# chunked loop gradients), plus the deepest ResNet each method trains under a
# memory cap.
# Installs what it needs on first use, then passes all arguments to study.py.
#   ./experiments/run.sh                        # the default study, about 8-9 min on 2 cores
#   ./experiments/run.sh --help                 # sizes, methods, cap, output folder
#   ./experiments/run.sh --models resnet --blocks-per-stage 1 3 --no-search   # a quick look
# Writes results/study.csv, fits.csv, max_depth.csv and *.png; tables on stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/experiments/study.py" "$@"
