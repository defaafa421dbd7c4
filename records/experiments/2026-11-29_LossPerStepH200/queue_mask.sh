#!/usr/bin/env bash
# Issue #48's last item: record V9LossPerStep's configuration (per_step.sh with queue_record.sh's table) validated
# with VAL_MASK=1, seeds 22-24 in one process (one compile, ~15 minutes held on one H200 with the staging). Each
# validation's step line gives the masked loss and the `unmasked` line after it the plain one of the same forward.
# Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash
# bench/lease.sh setup), rank-slice, step and optimizer graphs on.
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
source records/experiments/2026-11-29_LossPerStepH200/per_step.sh
PER_STEP="$PER_STEP NGRAM_OPTIMIZER=rowwise NGRAM_ROWS=10575360"
if nvidia-smi -L | grep -q H200; then PER_STEP="$PER_STEP GPU_MEMORY_GIB=77"; fi
note "the record's configuration with VAL_MASK=1, seeds 22-24"
SEEDS=22,23,24 arm 0 perstep_mask $PER_STEP VAL_MASK=1
python records/tool.py stages $L/perstep_mask_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
pack_cache
