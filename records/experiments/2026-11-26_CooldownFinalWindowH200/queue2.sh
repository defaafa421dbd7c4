#!/usr/bin/env bash
# Issue #25 item 3, second set: cooldown 0.50 and 0.55, LR floor 0.25 (controls: the previous queue), three
# processes at once on one H200, SEEDS=1,2,3 each, final-window sweep after each run; VAL_LOSS_EVERY=0.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 VAL_LOSS_EVERY=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
W=6:20,6:32,6:48,6:64,5:32,4:32
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
arm() { ( env "$@" LOG_DIR=$L/full SEEDS=1,2,3 python bench/eval_windows.py --windows $W --out $L/$RUN_ID.windows > $L/$RUN_ID.out 2>&1; note "$RUN_ID rc=$?" ) & }
RUN_ID=cool50 arm RUN_ID=cool50 COOLDOWN_FRAC=0.5
RUN_ID=cool55 arm RUN_ID=cool55 COOLDOWN_FRAC=0.55
RUN_ID=floor25 arm RUN_ID=floor25 LR_FLOOR=0.25
wait
note queue done
