#!/usr/bin/env bash
# Lease 6: issue #79's bar in one lease. This tree's defaults (the pointer's document skip with int32 bounds since
# lease 5) as `record`, then 7ec2b2e's train_gpt.py with its defaults (the bar's baseline, staged as
# /tmp/stage/base_7ec2b2e.py: `git show 7ec2b2e:train_gpt.py`), each alone on the GPU, 3 seeds, rank-slice, proxy
# train shards 1-5, GPU_MEMORY_GIB=77. Then `e4m3` (E4M3_LOGITS=1, T4.4; ../2026-12-07_E4m3Logits) alone, timed,
# against `record`. Then two quality arms side by side (val only: each one's time is not taken here;
# GPU_MEMORY_GIB=66 each so both fit): `r1078` (7 scheduled steps fewer) and `classes` (NGRAM_TOKEN_CLASSES=1,
# T3.22, PR #375, through bench/eval_windows.py, also pointer window 16384 and long window 40 at validation);
# `record` is their baseline. Then the caches are packed.
# No compile caches are assumed: 7ec2b2e compiles beside `record` (lease.sh's compile_beside, capped at 52 GiB so
# both fit; in lease 5 it ran out of memory only at the final validation's shapes, and `base` then warmed up in ~2
# minutes), killed the moment either warm-up ends. The pointer's and the cross-entropy's GPU tests and the pointer's
# bench run beside too.
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
compile_beside base_compile 52 /tmp/stage/base_7ec2b2e.py record
( check 0 gpu_tests 600 python -m pytest -q -m gpu tests/model/test_copy_pointer.py tests/tools/test_bench_copy_pointer.py \
      tests/kernels/test_cross_entropy.py -p no:cacheprovider
  check 0 bench_pointer 200 python bench/bench_copy_pointer.py ) &
side=$!
arm 0 record GPU_MEMORY_GIB=77
wait "$side"
stop_beside base_compile
note "A: 7ec2b2e"
env CUDA_VISIBLE_DEVICES=0 RUN_ID=base SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/base.out" 2>&1
note "base rc=$?"
python records/tool.py stages "$L"/record_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
arm 0 e4m3 GPU_MEMORY_GIB=77 E4M3_LOGITS=1
python records/tool.py stages "$L"/e4m3_s*.txt "$L"/record_s*.txt > "$L/stages_e4m3.md" 2>&1
note "stages_e4m3 rc=$?"
note "quality arms side by side: r1078, classes"
arm 0 r1078 GPU_MEMORY_GIB=66 NUM_SCHEDULED_ITERATIONS=1078 &
r1078=$!
env CUDA_VISIBLE_DEVICES=0 RUN_ID=classes SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=66 NGRAM_TOKEN_CLASSES=1 \
    python bench/eval_windows.py --windows 6:32,6:32c16384,6:40 --out "$L/classes_windows.json" > "$L/classes.out" 2>&1
note "classes (eval_windows) rc=$?"
wait "$r1078"
pack_cache
