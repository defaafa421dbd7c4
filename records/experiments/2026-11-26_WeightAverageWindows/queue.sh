#!/usr/bin/env bash
# Issue #25: AVERAGE_LAST_STEPS windows 0/25/50/100/200 scored on one trajectory per seed (main's source,
# records/experiments/2026-11-26_WeightAverageWindows/average_windows.py), seeds 1-4 in one process.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
LOG_DIR=$L/full RUN_ID=avg AVERAGE_LAST_STEPS=200 AVERAGE_WINDOWS=25,50,100 SEEDS=1,2,3,4 \
  python records/experiments/2026-11-26_WeightAverageWindows/average_windows.py > $L/avg.out 2>&1
note "avg rc=$?"
note queue done
