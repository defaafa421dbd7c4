#!/usr/bin/env bash
# Issue #25 item 3: schedule levers at equal steps (control / LR_FLOOR=0.05 / COOLDOWN_FRAC=0.7, three
# processes at once on one H200, SEEDS=1,2,3 each), every run's final model then scored under other
# final-validation windows by bench/eval_windows.py (quality only).
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
W=6:20,6:16,6:24,6:32,6:20y,6:32y,8:20,10:20,10:28
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
arm() { ( env "$@" LOG_DIR=$L/full SEEDS=1,2,3 python bench/eval_windows.py --windows $W --out $L/$RUN_ID.windows > $L/$RUN_ID.out 2>&1; note "$RUN_ID rc=$?" ) & }
RUN_ID=control arm RUN_ID=control
RUN_ID=floor05 arm RUN_ID=floor05 LR_FLOOR=0.05
RUN_ID=cool70 arm RUN_ID=cool70 COOLDOWN_FRAC=0.7
wait
note queue done
