#!/usr/bin/env bash
# Record lease (issue #24). Candidate: the carried tree (main). Baseline: df4131e (/tmp/stage/base.py).
# Phase A: the candidate's SEEDS=1,2,3 process compiles cold; beside it df4131e's warm-up (full, then
# killed: its compile cache is what later seeds use) and the GPU tests of traced_gemm.patch
# (/tmp/stage/traced.tar). Whatever is still running when the candidate's clock starts is stopped
# (SIGSTOP on its process group) and resumed after the candidate's runs, before the baseline's seeds.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
mkdir -p /tmp/traced && tar -xf /tmp/stage/traced.tar -C /tmp/traced
LOG_DIR=$L/warm RUN_ID=base_warm setsid python /tmp/stage/base.py > $L/base_warm.out 2>&1 & BW=$!
(cd /tmp/traced && exec setsid timeout 900 python -m pytest -q -m gpu tests/test_mlp.py tests/test_attention_backends.py > $L/gpu_tests_traced.log 2>&1) & GT=$!
# base warm-up: kill once its warm-up is done (it would go on to train)
( until grep -q "Compile and warm-up took" $L/base_warm.out 2>/dev/null || ! kill -0 $BW 2>/dev/null; do sleep 1; done
  kill -- -$BW 2>/dev/null; note "base_warm: warm-up done, stopped" ) &
LOG_DIR=$L/full RUN_ID=new SEEDS=1,2,3 python train_gpt.py > $L/new.out 2>&1 & NEW=$!
until grep -q "Compile and warm-up took" $L/new.out 2>/dev/null || ! kill -0 $NEW 2>/dev/null; do sleep 0.2; done
for g in $BW $GT; do kill -0 $g 2>/dev/null && kill -STOP -- -$g && note "paused $g at the candidate's clock start"; done
wait $NEW; note "new rc=$?"
for g in $BW $GT; do kill -CONT -- -$g 2>/dev/null; done
wait $GT; note "gpu tests (traced) rc=$?"
wait; note "phase A leftovers done"
for s in 1 2 3; do LOG_DIR=$L/full RUN_ID=base_s$s SEED=$s python /tmp/stage/base.py > $L/base_s$s.out 2>&1; note "base_s$s rc=$?"; done
note queue done
