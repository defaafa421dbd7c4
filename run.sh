#!/usr/bin/env bash
# The speedrun: torchrun on all GPUs of this node (override with NGPU=1|2|4|8).
# Extra environment variables are hyperparameter overrides (see README).
set -euo pipefail
cd "$(dirname "$0")"
torchrun --standalone --nproc_per_node="${NGPU:-8}" train_gpt.py "$@"
