#!/usr/bin/env bash
# Lease 3 (2026-12-02, replaces queue4.sh): issue #79's frontier with the pointer as Triton kernels (T4.8), and
# 7ec2b2e, the bar's baseline, in the same lease. COPY_POINTER=1 at 1100 steps (1085 scheduled + 15 extension), then
# 7ec2b2e's train_gpt.py with its defaults (staged as /tmp/stage/base_7ec2b2e.py), then COPY_POINTER=1 at 1150. The
# pointer arms run through bench/eval_windows.py: the same training and final validation as train_gpt.py, then each
# model scored again with the pointer looking 8192 tokens back (PR #379 validates with 8192, trains with 2048). The
# pointer's microbenchmark (49,152 tokens) and GPU tests run beside the first arm's cold compile, before its timed
# steps (the GPU is idle while inductor compiles; launches may be slowed by the compile's CPU load). Each arm alone
# on the GPU, 3 seeds, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz
# proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77, VAL_LOSS_EVERY=0 on the pointer arms (7ec2b2e validates on its way
# off the clock, as it did in its own leases). Carry .bench/cache and .bench/base_7ec2b2e.py into $STAGE.
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
( check 0 bench_pointer 150 python bench/bench_copy_pointer.py --tokens 49152 --launch 128x64x8,64x32x4
  check 0 gpu_tests 240 python -m pytest -q -m gpu tests/model/test_copy_pointer.py -p no:cacheprovider ) &
side=$!
pointer_arm() {  # NAME SCHEDULED_STEPS
    env CUDA_VISIBLE_DEVICES=0 RUN_ID="$1" SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 VAL_LOSS_EVERY=0 COPY_POINTER=1 \
        NUM_SCHEDULED_ITERATIONS="$2" python bench/eval_windows.py --windows 6:32,6:32c8192 \
        --out "$L/$1_windows.json" > "$L/$1.out" 2>&1
    note "$1 (eval_windows) rc=$?"
}
pointer_arm cplm1100 1085
wait "$side"
note "A: 7ec2b2e"
env CUDA_VISIBLE_DEVICES=0 RUN_ID=base SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/base.out" 2>&1
note "base rc=$?"
pointer_arm cplm1150 1135
python records/tool.py stages "$L"/cplm1100_s*.txt "$L"/base_s*.txt "$L"/cplm1150_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
