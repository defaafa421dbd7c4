#!/usr/bin/env bash
# The speedrun: torchrun on all GPUs of this node (override with NGPU=1|2|4|8).
# Extra environment variables are hyperparameter overrides (see README).
# SMOKE=1 ./run.sh: a tiny model on the repository's text sample instead, in a minute or two on
# one GPU or the CPU, with nothing to download (data/smoke/preset.py).
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    cat <<'USAGE'
usage: [NGPU=1|2|4|8] [SETTING=value ...] ./run.sh
       SMOKE=1 ./run.sh [--cache-dir DIR] [--script PATH]
                             a tiny model on the repository's text sample (CPU or one GPU;
                             its options: python data/smoke/preset.py --help)

SMOKE: 1, true, yes or on runs the smoke preset (data/smoke/preset.py); 0, false, no, off or
empty (the default) runs the speedrun (any case).

Checks the settings, the GPUs and the input files in one process (python train_gpt.py --check),
then runs: torchrun --standalone --nproc_per_node=8 train_gpt.py (NGPU processes).
Settings are environment variables named like train_gpt.py's Hyperparameters fields in upper
case (MUON_LR=0.02, SEEDS=1,2,3, RANK_SLICE=1, ...): README.md lists them.
USAGE
    exit 0
fi
# NGPU and SMOKE before anything runs: a bad value is one line naming the values they take.
NGPU="${NGPU:-8}"
case "$NGPU" in
    1|2|4|8) ;;
    *) echo "error: NGPU=$NGPU: use NGPU=1, 2, 4 or 8 (the GPUs of this node to train on; default 8)" >&2; exit 1 ;;
esac
case "$(printf '%s' "${SMOKE:-}" | tr '[:upper:]' '[:lower:]')" in
    1|true|yes|on) exec python data/smoke/preset.py "$@" ;;
    ""|0|false|no|off) ;;
    *) echo "error: SMOKE=$SMOKE: use SMOKE=1, true, yes or on for the smoke preset, or 0, false, no, off or" \
            "empty for the speedrun" >&2; exit 1 ;;
esac
# Settings, world size, GPUs and input files first, in one process: a bad one is one line, not a
# traceback from every rank inside torchrun's report.
WORLD_SIZE="$NGPU" python train_gpt.py --check
exec torchrun --standalone --nproc_per_node="$NGPU" train_gpt.py "$@"
