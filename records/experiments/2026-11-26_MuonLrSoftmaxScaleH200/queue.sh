#!/usr/bin/env bash
# Next lease (quality only, three processes at once on one H200):
#  main1285: main's defaults (1285 steps) on seeds 7,8,9 -- the equal-step partner of V6's seeds 7-9 in
#            records/experiments/2026-11-26_FewerStepsAttemptH200 (step cost vs seed luck);
#  mlr020 / mlr026: MUON_LR 0.023 -> 0.020 / 0.026 on seeds 1,2,3, paired with the defaults' seeds 1-3
#            (records/experiments/2026-11-26_CooldownFinalWindowH200, "new defaults together").
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 VAL_LOSS_EVERY=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
# bench/eval_windows.py trains exactly as train_gpt.py, then scores each final model with the softmax
# scale x0.95 / x1.05 / x1.1 at the final windows (eval only; 6:32 reproduces the run's number).
W=6:32,6:32x0.95,6:32x1.05,6:32x1.1
arm() { local id=$1; shift; ( env "$@" RUN_ID=$id LOG_DIR=$L/full python bench/eval_windows.py --windows $W --out $L/$id.windows.json > $L/$id.out 2>&1; note "$id rc=$?" ) & }
arm main1285 SEEDS=7,8,9
arm mlr020 SEEDS=1,2,3 MUON_LR=0.020
arm mlr026 SEEDS=1,2,3 MUON_LR=0.026
wait
note queue done
