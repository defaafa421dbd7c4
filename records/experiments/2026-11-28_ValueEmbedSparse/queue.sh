#!/usr/bin/env bash
# Issue #51 item 5 on one GPU (bench/lease.sh start; proxy shards 1-3, rank-slice): first the gpu test of
# the sparse value embeddings (a compiled tiny run beside the dense default, T3.20); then main against
# VALUE_EMBED_SPARSE=1, SEEDS=1,2,3 per arm, each arm alone on the GPU (time and loss). Both arms
# CUDA_GRAPHS=0: the sparse path loads its rows between micro-batches, outside the step's graphs. The A/B
# runs only if the gpu test passes.
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
export CUDA_GRAPHS=0 CUDA_VISIBLE_DEVICES=0
note "gpu test: start"
timeout 900 python -m pytest -q -m gpu tests/optimizer/test_value_embed_sparse.py > $L/gpu_test.out 2>&1
tests=$?
note "gpu test: rc=$tests"
[ $tests -eq 0 ] || { note "A/B: skipped (gpu test failed)"; exit 1; }
RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
note "main: rc=$?"
RUN_ID=ve_sparse VALUE_EMBED_SPARSE=1 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/ve_sparse.out 2>&1
note "ve_sparse: rc=$?"
python records/tool.py ablation $L/main_s*.txt $L/ve_sparse_s*.txt > $L/ablation.md 2>&1
note "ablation: rc=$?"
