#!/usr/bin/env bash
# Issue #79 item 2, the shape of the steps, on one H200: record #92's stage shares (28.5 / 32 / 39 % of the scheduled
# steps in stages 1-3, ours equal thirds; its taper's share stays ours) and #92's extension batch (16,384 tokens a rank,
# ours stage 3's 49,152), each against main's defaults, 3 seeds each alone, rank-slice, proxy train shards 1-5 (setup:
# SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. Run it on main's defaults of
# its day (with COPY_POINTER=1 if ../2026-12-04_CopyPointer made it the default).
need_shards 1 2 3 4 5
watch_gpus 60
arm 0 shares92 GPU_MEMORY_GIB=77 STAGE_FRACTION=0.285,0.32,0.315,0.08
arm 0 ext16k GPU_MEMORY_GIB=77 STAGE_BATCH_TOKENS=131072,262144,393216,393216,131072
arm 0 base GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/shares92_s*.txt "$L"/ext16k_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
