#!/usr/bin/env bash
# Lease 3: the pointer as Triton kernels (T4.8). The pointer's microbenchmark alone first (blocked torch against the
# kernels at stage 3's 49,152 tokens, two other launches), then COPY_POINTER=1 at 1100 and 1150 steps (main: 1365),
# main's defaults as the lease's time baseline, then 1200 steps if time is left (also validated with the pointer looking
# 4096 and 8192 tokens back). The pointer's GPU tests run beside the first arm's cold compile (untimed; they end under
# their timeout before its timed steps start). Each arm alone on the GPU, 3 seeds, rank-slice, proxy train shards 1-5
# (setup: SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. Carry .bench/cache
# (lease 2's compile caches) into $STAGE before setup. VAL_LOSS_EVERY=0: only step 0's and the final validation, so
# the warm-up compiles 2 validation shapes instead of 4 (123 s of lease 1's 506 s warm-up) and no run validates on
# its way (off the clock, ~8 s a seed). About 22 minutes held before the 1200-step arm.
need_shards 1 2 3 4 5
watch_gpus 60
check 0 bench_pointer 240 python bench/bench_copy_pointer.py --tokens 49152 --launch 128x64x8,64x32x4
check 0 gpu_tests 300 python -m pytest -q -m gpu tests/model/test_copy_pointer.py -p no:cacheprovider &
tests=$!
arm 0 cplm1100 GPU_MEMORY_GIB=77 VAL_LOSS_EVERY=0 COPY_POINTER=1 NUM_SCHEDULED_ITERATIONS=1085
wait "$tests"
arm 0 cplm1150 GPU_MEMORY_GIB=77 VAL_LOSS_EVERY=0 COPY_POINTER=1 NUM_SCHEDULED_ITERATIONS=1135
arm 0 base GPU_MEMORY_GIB=77 VAL_LOSS_EVERY=0
python records/tool.py stages "$L"/cplm1100_s*.txt "$L"/cplm1150_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
# the last arm through bench/eval_windows.py (the same training, then each model scored with the pointer looking 4096
# and 8192 tokens back at validation, as PR #379 validates)
env CUDA_VISIBLE_DEVICES=0 RUN_ID=cplm1200 SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 VAL_LOSS_EVERY=0 COPY_POINTER=1 \
    NUM_SCHEDULED_ITERATIONS=1185 python bench/eval_windows.py --windows 6:32,6:32c4096,6:32c8192 \
    --out "$L/cplm1200_windows.json" > "$L/cplm1200.out" 2>&1
note "cplm1200 (eval_windows) rc=$?"
pack_cache
