#!/usr/bin/env bash
# First machine: phase A compiles candidate and baseline cold (compile-only runs) beside the GPU tests;
# phase B times base_s1, the candidate's SEEDS=1,2,3, base_s2, base_s3. The candidate's compile-only
# run failed (the traced GEMM launch, see gpu_tests_part1.log); the machine was given back idle
# before phase B.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
(LOG_DIR=$L/warm RUN_ID=base_warm STOP_AFTER=1 python /tmp/stage/base.py > $L/base_warm.out 2>&1; note "base_warm rc=$?") &
(LOG_DIR=$L/warm RUN_ID=new_warm STOP_AFTER=1 python train_gpt.py > $L/new_warm.out 2>&1; echo $? > $L/new_warm.rc; note "new_warm rc=$(cat $L/new_warm.rc)") &
(timeout 600 python -m pytest -q -m gpu tests/test_mlp.py tests/test_optimizer.py tests/test_attention_backends.py > $L/gpu_tests.log 2>&1; note "gpu tests rc=$?") &
wait
CAND="train_gpt.py"
if [ "$(cat $L/new_warm.rc)" != 0 ]; then CAND=/tmp/stage/main.py; note "candidate failed: main.py instead (cold)"; fi
note phase B
LOG_DIR=$L/full RUN_ID=base_s1 SEED=1 python /tmp/stage/base.py > $L/base_s1.out 2>&1; note "base_s1 rc=$?"
LOG_DIR=$L/full RUN_ID=new SEEDS=1,2,3 python $CAND > $L/new.out 2>&1; note "new rc=$? ($CAND)"
for s in 2 3; do LOG_DIR=$L/full RUN_ID=base_s$s SEED=$s python /tmp/stage/base.py > $L/base_s$s.out 2>&1; note "base_s$s rc=$?"; done
note queue done
