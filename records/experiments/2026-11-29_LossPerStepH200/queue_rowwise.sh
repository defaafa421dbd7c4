#!/usr/bin/env bash
# One H200 (nvidia-h200, ~20 minutes held with staging): the n-gram table's row-wise state (NGRAM_OPTIMIZER=rowwise,
# T3.19) in the loss-per-step arm, two quality lanes sharing the GPU (eager, so that both fit: their times mean
# nothing), seeds 19-21 as lease 2's Adam arm (3.6059 at 1270 steps), which they pair with:
#   lane 1  rowwise at Adam's 3.9M rows: the optimizer alone
#   lane 2  rowwise at 10,575,360 rows, record #92's rows per rank, which Adam's state cannot hold beside the model
# Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash
# bench/lease.sh setup), rank-slice. First the table's GPU tests (the compiled row-wise update against the eager
# one). arm, check, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
source records/experiments/2026-11-29_LossPerStepH200/per_step.sh
PER_STEP="$PER_STEP NGRAM_OPTIMIZER=rowwise CUDA_GRAPHS=0"
check 0 table_gpu_tests 300 python -m pytest -q -p no:cacheprovider tests/optimizer/test_ngram_table.py -m gpu
note "quality lanes: rowwise at 3.9M and at 10.6M rows, seeds 19-21"
( SEEDS=19,20,21 arm 0 rowwise_3900k $PER_STEP NGRAM_ROWS=3900000 ) & p1=$!
( SEEDS=19,20,21 arm 0 rowwise_10575k $PER_STEP NGRAM_ROWS=10575360 ) & p2=$!
wait $p1 $p2
python records/tool.py ablation $L/rowwise_*_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
