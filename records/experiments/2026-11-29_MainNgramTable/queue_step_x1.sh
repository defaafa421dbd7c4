#!/usr/bin/env bash
# The table's optimizer step summed straight from the kept bf16 gradients (compiled with the update): the table's
# own work per step before (the code of the pair, copied to /tmp/oldrepo by the start call) and after, alone on one
# H200, then the GPU tests of the compiled table and of the step graphs with row tables. Needs the GPU wheels
# (setup) and proxy train shard 1; no compile caches.
need_shards 1
watch_gpus 60
check 0 bench_rows_before 300 python /tmp/oldrepo/bench/bench_row_tables.py --profile
check 0 bench_rows_after 300 python bench/bench_row_tables.py --profile
check 0 gpu_table 400 python -m pytest -q -m gpu tests/optimizer/test_ngram_table.py
check 0 gpu_graphs 420 python -m pytest -q -m gpu tests/training/test_step_graphs.py -k row_tables
