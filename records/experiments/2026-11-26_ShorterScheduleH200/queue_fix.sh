#!/usr/bin/env bash
# GPU check of d4cb046: NUM_SCHEDULED_ITERATIONS=1250 validates at step 1250, the extension's first
# step (it stopped there before the fix, SKIP_GUARD_CHECKS=1).
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
LOG_DIR=$L/full RUN_ID=fix1250 NUM_SCHEDULED_ITERATIONS=1250 SEED=1 python train_gpt.py > $L/fix1250.out 2>&1; note "fix1250 rc=$?"
note queue done
