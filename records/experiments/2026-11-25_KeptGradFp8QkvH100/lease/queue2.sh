#!/usr/bin/env bash
# Replan (device time counts in full): the candidate's SEEDS run compiles cold now, beside the
# baseline's cold compile, which is stopped once the candidate's warm-up is done (its cache stays).
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1
L=/tmp/q
cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue2 start
(LOG_DIR=$L/full RUN_ID=new SEEDS=1,2,3 python train_gpt.py > $L/new.out 2>&1; note "new rc=$?") &
NEW=$!
until grep -q "Compile and warm-up took" $L/new.out 2>/dev/null || ! kill -0 $NEW 2>/dev/null; do sleep 2; done
if pkill -f "python /tmp/stage/base.py"; then note "base_warm stopped at the candidate's clock start"; fi
pkill -f "pytest" && note "gpu tests stopped (unfinished)"
wait $NEW
run_base() { LOG_DIR=$L/full RUN_ID=base_s$1 SEED=$1 python /tmp/stage/base.py > $L/base_s$1.out 2>&1; note "base_s$1 rc=$?"; }
run_base 1
run_base 2
run_base 3
note queue2 done
