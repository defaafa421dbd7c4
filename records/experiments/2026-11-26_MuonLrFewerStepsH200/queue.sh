#!/usr/bin/env bash
# Issue #25 record candidates, quality only: three processes at once on one H200, four seeds each.
# main at 1285 steps (partner), and 15 fewer steps (NUM_SCHEDULED_ITERATIONS 1255, 1270 in all) with
# MUON_LR 0.020 and 0.017.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 VAL_LOSS_EVERY=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
arm() { local id=$1; shift; ( env "$@" RUN_ID=$id LOG_DIR=$L/full python train_gpt.py > $L/$id.out 2>&1; note "$id rc=$?" ) & }
arm main SEEDS=1,2,3,4
arm mlr020n1255 SEEDS=1,2,3,4 MUON_LR=0.020 NUM_SCHEDULED_ITERATIONS=1255
arm mlr017n1255 SEEDS=1,2,3,4 MUON_LR=0.017 NUM_SCHEDULED_ITERATIONS=1255
wait
note queue done
