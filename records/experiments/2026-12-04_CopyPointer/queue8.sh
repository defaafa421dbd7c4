#!/usr/bin/env bash
# Lease 5 (next session): issue #79's bar in one lease. This tree's defaults (COPY_POINTER=1, 1085 scheduled + 15
# extension steps, FINAL_COPY_WINDOW=8192) as `record`, then 7ec2b2e's train_gpt.py with its defaults (the bar's
# baseline, staged as /tmp/stage/base_7ec2b2e.py), then `r1078` (7 steps fewer: lease 4's 3.6254 is 0.0031 under the
# target, about 12 steps at 0.00026 val a step), then `classes` (NGRAM_TOKEN_CLASSES=1 on this tree's defaults, T3.22,
# PR #375; `record` is its baseline) through bench/eval_windows.py, which also scores its models with the pointer
# looking 16384 tokens back and with the attention's final long window at 40 blocks. Each arm alone on the GPU, 3 seeds, rank-slice, proxy train shards 1-5 (setup:
# SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77, the defaults' validation
# (VAL_LOSS_EVERY=250, off the clock). Carry the 6 parts of .bench/cache (lease 4's compile caches, 2 parts a call:
# a call carries at most 64 MiB with the tree) and .bench/base_7ec2b2e.py into $STAGE before setup. Poll back to back:
# the machine goes back 30 s after a call ends (lease 3 lost its 7ec2b2e arm so).
# The pointer's kernels skip the key tiles before a query block's document since lease 4 (T4.8): their GPU tests and
# microbenchmark run beside `record`'s compile (untimed; the launches may be slowed by the compile's CPU load).
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
( check 0 gpu_tests 240 python -m pytest -q -m gpu tests/model/test_copy_pointer.py -p no:cacheprovider
  check 0 bench_pointer 150 python bench/bench_copy_pointer.py --launch 64x32x4,128x64x8 ) &
side=$!
arm 0 record GPU_MEMORY_GIB=77
wait "$side"
note "A: 7ec2b2e"
env CUDA_VISIBLE_DEVICES=0 RUN_ID=base SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/base.out" 2>&1
note "base rc=$?"
python records/tool.py stages "$L"/record_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
arm 0 r1078 GPU_MEMORY_GIB=77 NUM_SCHEDULED_ITERATIONS=1078
env CUDA_VISIBLE_DEVICES=0 RUN_ID=classes SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 NGRAM_TOKEN_CLASSES=1 \
    python bench/eval_windows.py --windows 6:32,6:32c16384,6:40 --out "$L/classes_windows.json" > "$L/classes.out" 2>&1
note "classes (eval_windows) rc=$?"
pack_cache
