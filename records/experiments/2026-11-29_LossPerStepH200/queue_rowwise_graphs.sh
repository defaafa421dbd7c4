#!/usr/bin/env bash
# One H200, ~16 minutes held with staging (what a session had left after losing queue_record.sh's machine): the
# n-gram table's GPU tests, then the loss-per-step arm with the row-wise table (NGRAM_OPTIMIZER=rowwise, T3.19) at
# record #92's 10,575,360 rows per rank, alone on the GPU with step and optimizer graphs on, seeds 19-21 as lease
# 2's Adam arm at 3.9M rows (3.6059 at 1270 steps), which they pair with. Proxy train shards 1-4 (setup:
# SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup), rank-slice.
# arm, check, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
source records/experiments/2026-11-29_LossPerStepH200/per_step.sh
check 0 table_gpu_tests 240 python -m pytest -q -p no:cacheprovider tests/optimizer/test_ngram_table.py -m gpu
SEEDS=19,20,21 arm 0 rowwise_10575k $PER_STEP NGRAM_OPTIMIZER=rowwise NGRAM_ROWS=10575360
python records/tool.py stages $L/rowwise_10575k_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
