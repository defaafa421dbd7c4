#!/usr/bin/env bash
# Last seeds lost when the machine went back mid-queue: mlr020 seed 3 and main1285 seed 9, two at once.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 VAL_LOSS_EVERY=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
arm() { local id=$1; shift; ( env "$@" RUN_ID=$id LOG_DIR=$L/full python bench/eval_windows.py --windows 6:32 --out $L/$id.windows.json > $L/$id.out 2>&1; note "$id rc=$?" ) & }
arm main1285 SEEDS=9
arm mlr020 SEEDS=3 MUON_LR=0.020
wait
note queue done
