#!/usr/bin/env bash
# Lease 5 (next session): issue #79's bar in one lease. This tree's defaults (COPY_POINTER=1, 1085 scheduled + 15
# extension steps, FINAL_COPY_WINDOW=8192) as `record`, then 7ec2b2e's train_gpt.py with its defaults (the bar's
# baseline, staged as /tmp/stage/base_7ec2b2e.py), then `classes` (NGRAM_TOKEN_CLASSES=1 on this tree's defaults, T3.22,
# PR #375; `record` is its baseline). Each arm alone on the GPU, 3 seeds, rank-slice, proxy train shards 1-5 (setup:
# SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77, the defaults' validation
# (VAL_LOSS_EVERY=250, off the clock). Carry the 6 parts of .bench/cache (lease 4's compile caches, 2 parts a call:
# a call carries at most 64 MiB with the tree) and .bench/base_7ec2b2e.py into $STAGE before setup. Poll back to back:
# the machine goes back 30 s after a call ends (lease 3 lost its 7ec2b2e arm so).
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
arm 0 record GPU_MEMORY_GIB=77
note "A: 7ec2b2e"
env CUDA_VISIBLE_DEVICES=0 RUN_ID=base SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/base.out" 2>&1
note "base rc=$?"
python records/tool.py stages "$L"/record_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
arm 0 classes GPU_MEMORY_GIB=77 NGRAM_TOKEN_CLASSES=1
pack_cache
