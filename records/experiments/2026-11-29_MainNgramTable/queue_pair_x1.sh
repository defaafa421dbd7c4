#!/usr/bin/env bash
# The table's decision (README, "Reading"): alone on one H200 with the step graphs, seeds 1-3 each, the allocator
# capped at an 80 GB H100's room on both arms: main's defaults (1415 steps), then main + the row-wise table at
# 10,575,360 rows with the gain spent as 50 fewer scheduled steps (1350 + 15). Proxy train shards 1-4 (setup:
# SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup), rank-slice; carry
# the compile caches of this folder's leases (~19 minutes held with them, staging included; the table's bench before the
# pair, ~2 more; the profiles after the caches' packing take ~8 more and may be cut by the hold's end).
need_shards 1 2 3 4
watch_gpus 60
# first, the table's own work per step at record #92's rows on proxy tokens (no model; ~2 minutes): where its time goes
check 0 bench_rows 300 python bench/bench_row_tables.py --profile
note "main, then main + table at 1365 steps, alone on GPU 0 with the step graphs"
SEEDS=1,2,3 arm 0 pair_main GPU_MEMORY_GIB=77
SEEDS=1,2,3 arm 0 pair_table NGRAM_OPTIMIZER=rowwise NGRAM_ROWS=10575360 NUM_SCHEDULED_ITERATIONS=1350 GPU_MEMORY_GIB=77
python records/tool.py stages $L/pair_main_s*.txt $L/pair_table_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
pack_cache
# the row-table GPU tests (the loads outside the graphs, as above world size 1, included)
check 0 gpu_tests 420 python -m pytest -q -m gpu tests/training/test_step_graphs.py -k row_tables
# then: where the table's time goes, kernel groups per stage with and without it (graphed steps)
check 0 prof_main 420 env GPU_MEMORY_GIB=77 python bench/profile_stages.py main=train_gpt.py --out $L/prof_main
check 0 prof_table 420 env NGRAM_OPTIMIZER=rowwise NGRAM_ROWS=10575360 GPU_MEMORY_GIB=77 \
    python bench/profile_stages.py table=train_gpt.py --out $L/prof_table
python bench/profile_stages.py --merge $L/prof_main/*.json $L/prof_table/*.json > $L/profile.md 2>&1
note "profile merge rc=$?"
