#!/usr/bin/env bash
# Issue #79 item 2, the shape of the steps, on one H200: record #92's stage shares (28.5 / 32 / 39 % of the scheduled
# steps in stages 1-3, ours equal thirds; its taper's share stays ours), #92's extension batch (16,384 tokens a rank,
# ours stage 3's 49,152) and a coarse form of #92's candidate ramp (stage 3 at stage 2's 14,336 candidates, the taper
# at the full softmax as now), each against main's defaults, 3 seeds each alone, rank-slice, proxy train shards 1-5
# (setup: SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. `base` runs first:
# with no compile caches it compiles every graph the arms share (shares92 has the same shapes; ext16k and ce14k add
# one stage's graphs each).
need_shards 1 2 3 4 5
watch_gpus 60
arm 0 base GPU_MEMORY_GIB=77
arm 0 shares92 GPU_MEMORY_GIB=77 STAGE_FRACTION=0.285,0.32,0.315,0.08
arm 0 ce14k GPU_MEMORY_GIB=77 STAGE_CE_CANDIDATES=10240,14336,14336,0,0
arm 0 ext16k GPU_MEMORY_GIB=77 STAGE_BATCH_TOKENS=131072,262144,393216,393216,131072
python records/tool.py stages "$L"/shares92_s*.txt "$L"/ce14k_s*.txt "$L"/ext16k_s*.txt "$L"/base_s*.txt \
    > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
