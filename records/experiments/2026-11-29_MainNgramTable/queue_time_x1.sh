#!/usr/bin/env bash
# Lane B's time, alone on one H200 with the step graphs: main's defaults with the hashed n-gram table (row-wise,
# 10,575,360 rows), seed 1, the allocator capped at an 80 GB H100's room; then main's defaults, seed 1, if the lease
# lasts (a fresh compile). Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz
# proxy_val_000000.bin.xz' bash bench/lease.sh setup), rank-slice, lane B's compile caches carried.
need_shards 1 2 3 4
watch_gpus 30
TABLE="NGRAM_OPTIMIZER=rowwise NGRAM_ROWS=10575360"
note "main + table, then main, alone on GPU 0 with the step graphs"
SEEDS=1 arm 0 time_main_table $TABLE GPU_MEMORY_GIB=77
SEEDS=1 arm 0 time_main GPU_MEMORY_GIB=77
python records/tool.py stages $L/time_main_table_s*.txt $L/time_main_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
