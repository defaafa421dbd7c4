#!/usr/bin/env bash
# Record lease (issue #24), second machine of the 2026-11-25 evening session. Candidate: the carried
# tree (main 62d17d5 + FA4 forward called directly + NorMuon bank steps as CUDA graphs); fallback
# /tmp/stage/main.py (main 62d17d5). Baseline df4131e (/tmp/stage/base.py), compiled cold beside the
# candidate and stopped when the candidate's clock starts; then its seeds one at a time.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
(LOG_DIR=$L/warm RUN_ID=base_warm STOP_AFTER=1 python /tmp/stage/base.py > $L/base_warm.out 2>&1; note "base_warm rc=$?") &
run_new() { LOG_DIR=$L/full RUN_ID=new SEEDS=1,2,3 python $1 > $L/new.out 2>&1 & NEW=$!
  until grep -q "Compile and warm-up took" $L/new.out 2>/dev/null || ! kill -0 $NEW 2>/dev/null; do sleep 2; done
  if pkill -f "python /tmp/stage/base.py"; then note "base_warm stopped at the candidate's clock start"; fi
  wait $NEW; rc=$?; note "new rc=$rc ($1)"; return $rc; }
run_new train_gpt.py || run_new /tmp/stage/main.py
for s in 1 2 3; do LOG_DIR=$L/full RUN_ID=base_s$s SEED=$s python /tmp/stage/base.py > $L/base_s$s.out 2>&1; note "base_s$s rc=$?"; done
note queue done
