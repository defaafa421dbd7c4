#!/usr/bin/env bash
# Issue #79 (time at loss), first probe on one H200: the scheduled step count alone, everything else at main's
# defaults; each arm alone on the GPU (time and val both count), SEEDS=1,2,3, GPU_MEMORY_GIB=77, rank-slice, proxy
# train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'). The arms share every
# compiled shape (only the step counts differ), so after the control's cold compile (~7 min) each warms up from the
# caches. ~25 minutes held. Then the compile caches are packed for the next lease (bench/lease.sh pack-cache).
need_shards 1 2 3 4 5
watch_gpus 60
arm 0 s1350 GPU_MEMORY_GIB=77
arm 0 s1200 GPU_MEMORY_GIB=77 NUM_SCHEDULED_ITERATIONS=1200
arm 0 s1100 GPU_MEMORY_GIB=77 NUM_SCHEDULED_ITERATIONS=1100
python records/tool.py stages "$L"/s1*_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
