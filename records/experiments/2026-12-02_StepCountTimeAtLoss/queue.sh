#!/usr/bin/env bash
# Issue #79 (time at loss), first probe on one H200, with issue #78's step profile after it: the scheduled step
# count alone, everything else at main's defaults; each arm alone on the GPU (time and val both count),
# SEEDS=1,2,3, GPU_MEMORY_GIB=77, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz
# proxy_val_000000.bin.xz'). The control (1350 scheduled steps, main's default) is lease 2 of
# ../2026-12-01_DeletionPassAB, same code at world size 1. The arms share every compiled shape, so only the first
# compiles cold (~7 min). Then bench/profile_stages.py profiles stages 1-3's graphed steps (issue #78 item 1; the
# queue of ../2026-12-02_StepCostProfile). ~25 minutes held.
need_shards 1 2 3 4 5
watch_gpus 60
arm 0 s1200 GPU_MEMORY_GIB=77 NUM_SCHEDULED_ITERATIONS=1200
arm 0 s1100 GPU_MEMORY_GIB=77 NUM_SCHEDULED_ITERATIONS=1100
python records/tool.py stages "$L"/s1*_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
mkdir -p "$L/prof"
check 0 profile 900 python bench/profile_stages.py --stages 1,2,3 --steps 6 --verbose --out "$L/prof"
cp "$L/prof/table.md" "$L/table.md" 2>/dev/null
note "profile table copied"
