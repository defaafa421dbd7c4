#!/usr/bin/env bash
# Issue #79 item 2 and issue #78 item 4, the shape of the steps, on one H200, each arm against main's defaults (`base`,
# record V10's configuration), 3 seeds each alone, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_
# 00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77, in the order of their expected gain:
# `ce14k`, a coarse form of record #92's candidate ramp (stage 3 at stage 2's 14,336 candidates, the taper at the full
# softmax as now: the lm_head's three products and the cross-entropy shrink by 42 % in stage 3); `taper40k`, #92's
# taper batch (40,960 tokens a rank; ours stage 3's 49,152 under the full softmax, 58 ms a step against stage 3's
# 52); `shares92`, #92's
# stage shares (28.5 / 32 / 39 % of the scheduled steps in stages 1-3, ours equal thirds; the taper's share stays
# ours); `ext16k`, #92's extension batch (16,384 tokens a rank, ours stage 3's 49,152).
# No compile caches are assumed: ce14k's own stage-3 graphs compile beside `base`'s warm-up (lease.sh's
# compile_beside, capped at 52 GiB so both fit; killed the moment either warm-up ends); shares92 has base's shapes.
# taper40k has one row's graphs of its own; shares92, the stage profile and ext16k come last and may not fit in the
# 30 minutes.
need_shards 1 2 3 4 5
watch_gpus 60
STAGE_CE_CANDIDATES=10240,14336,14336,0,0 compile_beside ce14k_compile 52 train_gpt.py base
arm 0 base GPU_MEMORY_GIB=77
stop_beside ce14k_compile
arm 0 ce14k GPU_MEMORY_GIB=77 STAGE_CE_CANDIDATES=10240,14336,14336,0,0
python records/tool.py stages "$L"/ce14k_s*.txt "$L"/base_s*.txt > "$L/stages_ce14k.md" 2>&1
note "stages_ce14k rc=$?"
arm 0 taper40k GPU_MEMORY_GIB=77 STAGE_BATCH_TOKENS=131072,262144,393216,327680,393216
arm 0 shares92 GPU_MEMORY_GIB=77 STAGE_FRACTION=0.285,0.32,0.315,0.08
# the defaults' kernel groups per stage (issue #78's table beside #92's; the last one is at 654c9e4, before the FP8
# MLP backward and the copy pointer), from the warm caches
mkdir -p "$L/prof"
check 0 profile 600 python bench/profile_stages.py --stages 1,2,3 --steps 6 --verbose --out "$L/prof"
cp "$L/prof/table.md" "$L/profile_table.md" 2>/dev/null
arm 0 ext16k GPU_MEMORY_GIB=77 STAGE_BATCH_TOKENS=131072,262144,393216,393216,131072
python records/tool.py stages "$L"/taper40k_s*.txt "$L"/shares92_s*.txt "$L"/ext16k_s*.txt "$L"/base_s*.txt \
    > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
