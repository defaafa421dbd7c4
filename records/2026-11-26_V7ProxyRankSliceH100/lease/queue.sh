#!/usr/bin/env bash
# Record lease, one GPU alone: the carried train_gpt.py (candidate) then record V6's script (baseline),
# SEEDS=10,11,12 each (override with RECORD_SEEDS). Each arm compiles alone: inductor benchmarks kernel
# configurations while compiling, and a compile beside another process's picks them under its load
# (records/experiments/2026-11-26_FewerStepsAttemptH200, a 0.7 % per-step gap in stages 2-3).
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
V6=records/2026-11-26_V6ProxyRankSliceH100/train_gpt.py
SEEDS_=${RECORD_SEEDS:-10,11,12}
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
LOG_DIR=$L/full RUN_ID=new SEEDS=$SEEDS_ python train_gpt.py > $L/new.out 2>&1; note "new rc=$?"
LOG_DIR=$L/full RUN_ID=base SEEDS=$SEEDS_ python $V6 > $L/base.out 2>&1; note "base rc=$?"
python -m pytest -q -m gpu tests/test_mlp.py tests/test_attention_backends.py tests/test_gpu_training.py > $L/gpu_tests.log 2>&1; note "gpu tests rc=$?"
note queue done
