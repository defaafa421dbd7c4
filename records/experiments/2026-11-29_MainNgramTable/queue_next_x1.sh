#!/usr/bin/env bash
# Next lease on one H200 (~25 minutes held with the compile caches of lease 3 carried): main's end-to-end time with
# lease 4's table step against the pair's table arm, then the GPU tests the table's default touches.
# Stage the old file first (the start call): mkdir -p /tmp/oldrepo && git show b64bbc8:train_gpt.py, carried as
# .bench/old/train_gpt.py, copied to /tmp/oldrepo/train_gpt.py. Proxy train shards 1-4 (setup:
# SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz'), rank-slice, each arm alone on GPU 0.
need_shards 1 2 3 4
watch_gpus 60
# "before": the pair's table arm (b64bbc8, the table's step before summed_row_gradients) with its settings
SEEDS=1,2,3 check 0 step_before 900 env RUN_ID=step_before SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 \
    NGRAM_ROWS=10575360 NGRAM_OPTIMIZER=rowwise NUM_SCHEDULED_ITERATIONS=1350 python /tmp/oldrepo/train_gpt.py
# "after": main's defaults (the same settings since 7799600)
SEEDS=1,2,3 arm 0 step_after GPU_MEMORY_GIB=77
python records/tool.py stages $L/step_before_s*.txt $L/step_after_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
check 0 gpu_tests 600 python -m pytest -q -m gpu tests/training/test_step_graphs.py tests/optimizer/test_ngram_table.py \
    tests/training/test_gpu_training.py
check 0 bench_rows 300 python bench/bench_row_tables.py --profile
