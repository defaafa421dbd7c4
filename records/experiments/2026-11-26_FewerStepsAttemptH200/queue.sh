#!/usr/bin/env bash
# Record lease for issue #25 (fewer steps), one H100 alone. Candidate: the carried train_gpt.py (new
# defaults, NUM_SCHEDULED_ITERATIONS set as its default before the lease), SEEDS=7,8,9. Baseline: record
# V6's own script (records/2026-11-26_V6ProxyRankSliceH100/train_gpt.py), same seeds, after it.
# The baseline's warm-up compiles beside the candidate's (untimed) and is stopped when it is done, so
# its later run compiles warm; anything still compiling at the candidate's clock start is paused.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
V6=records/2026-11-26_V6ProxyRankSliceH100/train_gpt.py
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
LOG_DIR=$L/warm RUN_ID=base_warm setsid python $V6 > $L/base_warm.out 2>&1 & BW=$!
( until grep -q "Compile and warm-up took" $L/base_warm.out 2>/dev/null || ! kill -0 $BW 2>/dev/null; do sleep 1; done
  kill -- -$BW 2>/dev/null; note "base_warm: warm-up done, stopped" ) &
LOG_DIR=$L/full RUN_ID=new SEEDS=7,8,9 python train_gpt.py > $L/new.out 2>&1 & NEW=$!
until grep -q "Compile and warm-up took" $L/new.out 2>/dev/null || ! kill -0 $NEW 2>/dev/null; do sleep 0.2; done
kill -0 $BW 2>/dev/null && kill -STOP -- -$BW && note "paused base_warm at the candidate's clock start"
wait $NEW; note "new rc=$?"
kill -CONT -- -$BW 2>/dev/null; wait; note "base_warm finished"
LOG_DIR=$L/full RUN_ID=base SEEDS=7,8,9 python $V6 > $L/base.out 2>&1; note "base rc=$?"
note queue done
