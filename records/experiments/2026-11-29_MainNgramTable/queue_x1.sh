#!/usr/bin/env bash
# Two quality lanes sharing one H200 (~16 minutes held with the staging), eager (CUDA_GRAPHS=0: less memory, same math):
#   A: record V9LossPerStep's configuration with VAL_MASK=1, seeds 22-24 (issue #48's masked report; each
#      validation logs the masked loss and, on its `unmasked` line, the plain one of the same forward)
#   B: main's defaults with the hashed n-gram table of record V9LossPerStep (row-wise, 10,575,360 rows), seeds 1-3,
#      against main's seeds 1-3 of ../2026-11-28_NarrowVoDropLayer7 (lease 4, same math since)
# Each lane's allocator is capped so that both fit the GPU. Times here are shared-GPU times: not a speed claim.
# Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash
# bench/lease.sh setup), rank-slice.
# arm, note, need_shards, watch_gpus, pack_cache: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
source records/experiments/2026-11-29_LossPerStepH200/per_step.sh
TABLE="NGRAM_OPTIMIZER=rowwise NGRAM_ROWS=10575360"
note "lanes A (record V9LossPerStep, VAL_MASK=1) and B (main + the n-gram table), eager, sharing GPU 0"
( SEEDS=22,23,24 arm 0 v9_mask $PER_STEP $TABLE VAL_MASK=1 CUDA_GRAPHS=0 GPU_MEMORY_GIB=64 ) & lane_a=$!
SEEDS=1,2,3 arm 0 main_table $TABLE CUDA_GRAPHS=0 GPU_MEMORY_GIB=72
wait $lane_a
python records/tool.py stages $L/v9_mask_s*.txt $L/main_table_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
pack_cache
