#!/usr/bin/env bash
# Issue #48's record runs: the loss-per-step arm with lease 4's row-wise table (README), seeds 22-24, and V7's
# script with seeds 22-24 in one lease, each alone on its GPU; an H100 if one is lent (the bar asks for an 80 GB
# H100's memory), else an H200. One GPU (~26 minutes held with staging): the arm, then V7, then seed 22 with
# VAL_MASK=1 if the hold leaves room. Two or more GPUs (~19 minutes): V7 on GPU 1 beside the arm, the VAL_MASK=1
# seed after the arm.
# Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash
# bench/lease.sh setup), rank-slice, step and optimizer graphs on.
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
source records/experiments/2026-11-29_LossPerStepH200/per_step.sh
# lease 4's table (README); on an H200 the allocator capped at what an 80 GB H100's gets (README's GPU_MEMORY_GIB)
PER_STEP="$PER_STEP NGRAM_OPTIMIZER=rowwise NGRAM_ROWS=10575360"
if nvidia-smi -L | grep -q H200; then PER_STEP="$PER_STEP GPU_MEMORY_GIB=77"; fi
mkdir -p "$L/v7" && cp records/2026-11-26_V7ProxyRankSliceH100/train_gpt.py "$L/v7/"
gpus=$(nvidia-smi -L | wc -l)
note "$gpus GPU(s): the loss-per-step arm and V7, seeds 22-24"
if [ "$gpus" -ge 2 ]; then
    ( cd "$L/v7" && SEEDS=22,23,24 arm 1 v7 ) & v7=$!
    SEEDS=22,23,24 arm 0 perstep $PER_STEP
    SEEDS=22 arm 0 perstep_mask $PER_STEP VAL_MASK=1
    wait $v7
else
    SEEDS=22,23,24 arm 0 perstep $PER_STEP
    python records/tool.py stages $L/perstep_s*.txt > $L/stages.md 2>&1
    (cd "$L/v7" && SEEDS=22,23,24 arm 0 v7)
    if [ "$SECONDS" -lt 1140 ]; then  # the masked seed reuses the compile caches: ~5 minutes
        SEEDS=22 arm 0 perstep_mask $PER_STEP VAL_MASK=1
    else
        note "perstep_mask skipped: ${SECONDS}s gone, too close to the 30-minute hold"
    fi
fi
python records/tool.py stages $L/v7_s*.txt $L/perstep_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
pack_cache  # V7's caches hit in every later lease (its script never changes), main's where its code did not
