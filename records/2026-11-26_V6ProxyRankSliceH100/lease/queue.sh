#!/usr/bin/env bash
# Record lease (issue #24). Candidate: the carried tree (branch host-time: fused MLP GEMMs launched
# from inductor's code, FA4's forward called directly, SKIP_GUARD_CHECKS). Fallback: main
# (/tmp/stage/main.py) if the candidate fails before its clock. Baseline: df4131e (/tmp/stage/base.py).
# Phase A, beside the candidate's cold compile: df4131e's full warm-up (stopped after it: later seeds
# compile warm) and the candidate tree's GPU tests. Whatever still runs at the candidate's clock
# start is paused (SIGSTOP) and resumed after the candidate's runs.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
LOG_DIR=$L/warm RUN_ID=base_warm setsid python /tmp/stage/base.py > $L/base_warm.out 2>&1 & BW=$!
( until grep -q "Compile and warm-up took" $L/base_warm.out 2>/dev/null || ! kill -0 $BW 2>/dev/null; do sleep 1; done
  kill -- -$BW 2>/dev/null; note "base_warm: warm-up done, stopped" ) &
run_new() { LOG_DIR=$L/full RUN_ID=new SEEDS=1,2,3 python $1 > $L/new.out 2>&1 & NEW=$!
  until grep -q "Compile and warm-up took" $L/new.out 2>/dev/null || ! kill -0 $NEW 2>/dev/null; do sleep 0.2; done
  for g in $BW; do kill -0 $g 2>/dev/null && kill -STOP -- -$g && note "paused $g at the candidate's clock start"; done
  wait $NEW; rc=$?; note "new rc=$rc ($1)"
  for g in $BW; do kill -CONT -- -$g 2>/dev/null; done
  return $rc; }
run_new train_gpt.py || { grep -q "step:1/" $L/new.out || { mv $L/new.out $L/new_failed.out; run_new /tmp/stage/main.py; }; }
wait; note "phase A leftovers done"
for s in 1 2 3; do LOG_DIR=$L/full RUN_ID=base_s$s SEED=$s python /tmp/stage/base.py > $L/base_s$s.out 2>&1; note "base_s$s rc=$?"; done
note queue done
