#!/usr/bin/env bash
# Lease 5: issue #79's bar in one lease, with no compile caches (the checkout lost .bench). This tree's defaults as
# `record`, then 7ec2b2e's train_gpt.py with its defaults (the bar's baseline, staged as /tmp/stage/base_7ec2b2e.py),
# then `r1078` (7 steps fewer), the caches packed, then `classes` (NGRAM_TOKEN_CLASSES=1, T3.22, PR #375) through
# bench/eval_windows.py (also pointer window 16384 and long window 40) if the lease lasts. Each timed arm alone on
# the GPU, 3 seeds, rank-slice, proxy train shards 1-5, GPU_MEMORY_GIB=77.
# Untimed work beside `record`'s compile: the pointer's GPU tests and bench, and 7ec2b2e's compile (`base_compile`,
# allocator capped at 52 GiB so both fit), which fills the caches for `base` and is killed (its process group) the
# moment either warm-up ends, so no timed step shares the GPU with it for more than ~1 s.
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
mkdir -p /tmp/precompile
CUDA_VISIBLE_DEVICES=0 RUN_ID=base_compile SEEDS=1 LOG_DIR=/tmp/precompile GPU_MEMORY_GIB=52 \
    setsid python /tmp/stage/base_7ec2b2e.py > "$L/base_compile.out" 2>&1 &
pre=$!
note "base_compile pid $pre"
( while kill -0 "$pre" 2>/dev/null; do
      if grep -qs "Compile and warm-up took" "$L/record.out" "$L/base_compile.out"; then
          kill -KILL -- -"$pre" 2>/dev/null; note "base_compile stopped: a warm-up ended"; break
      fi
      sleep 0.3
  done ) &
( check 0 gpu_tests 240 python -m pytest -q -m gpu tests/model/test_copy_pointer.py -p no:cacheprovider
  check 0 bench_pointer 150 python bench/bench_copy_pointer.py --launch 64x32x4,128x64x8 ) &
side=$!
arm 0 record GPU_MEMORY_GIB=77
wait "$side"
kill -KILL -- -"$pre" 2>/dev/null
note "A: 7ec2b2e"
env CUDA_VISIBLE_DEVICES=0 RUN_ID=base SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/base.out" 2>&1
note "base rc=$?"
python records/tool.py stages "$L"/record_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
arm 0 r1078 GPU_MEMORY_GIB=77 NUM_SCHEDULED_ITERATIONS=1078
pack_cache
env CUDA_VISIBLE_DEVICES=0 RUN_ID=classes SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 NGRAM_TOKEN_CLASSES=1 \
    python bench/eval_windows.py --windows 6:32,6:32c16384,6:40 --out "$L/classes_windows.json" > "$L/classes.out" 2>&1
note "classes (eval_windows) rc=$?"
