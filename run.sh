#!/usr/bin/env bash
# The speedrun: torchrun on all GPUs of this node (override with NGPU=1|2|4|8).
# Extra environment variables are hyperparameter overrides (see README).
# SMOKE=1 ./run.sh: a tiny model on the repository's text sample instead, in a minute or two on
# one GPU or the CPU, with nothing to download (data/smoke/preset.py).
set -euo pipefail
cd "$(dirname "$0")"
if [ "${SMOKE:-0}" = 1 ]; then
    exec python data/smoke/preset.py "$@"
fi
torchrun --standalone --nproc_per_node="${NGPU:-8}" train_gpt.py "$@"
