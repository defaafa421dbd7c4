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
NGPU="${NGPU:-8}"
# Settings, world size and input files first, in one process: a bad one is one line, not a
# traceback from every rank and torchrun's report.
WORLD_SIZE="$NGPU" python train_gpt.py --check
exec torchrun --standalone --nproc_per_node="$NGPU" train_gpt.py "$@"
