#!/usr/bin/env bash
# Issue #78's bar at the default 1365 steps (NUM_SCHEDULED_ITERATIONS=1350) with record #92's step shape: `v78`, main's
# defaults with #92's candidate budgets mapped onto our stages (10,240 through stage 2, 14,336 through stage 3, the
# full softmax in the taper and the extension: STAGE_CE_CANDIDATES=10240,10240,14336,0,0), its taper batch (40,960
# tokens a rank) and its extension batch (16,384): STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072. Then
# 7ec2b2e's train_gpt.py with its defaults (`b7ec`, the bar's baseline, staged as /tmp/stage/base_7ec2b2e.py: `git
# show 7ec2b2e:train_gpt.py`). Then v78's stage profile; last `classes`: v78's settings with NGRAM_TOKEN_CLASSES=1
# (T3.22, PR #375), against v78, which the end of the device budget may cut. Each arm alone on the GPU, 3 seeds, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5]
# .bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77.
# No compile caches are assumed: 7ec2b2e compiles beside v78's warm-up (compile_beside, capped at 52 GiB so both
# fit), killed the moment either warm-up ends.
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
SHAPE="NUM_SCHEDULED_ITERATIONS=1350 STAGE_CE_CANDIDATES=10240,10240,14336,0,0"
SHAPE="$SHAPE STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072"
compile_beside b7ec_compile 52 /tmp/stage/base_7ec2b2e.py v78
# shellcheck disable=SC2086
arm 0 v78 GPU_MEMORY_GIB=77 $SHAPE
stop_beside b7ec_compile
env CUDA_VISIBLE_DEVICES=0 RUN_ID=b7ec SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/b7ec.out" 2>&1
note "b7ec rc=$?"
python records/tool.py stages "$L"/v78_s*.txt "$L"/b7ec_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
# v78's kernel groups per stage (issue #78 item 1's table, last taken at 654c9e4), warm caches; before `classes`,
# which the lease's end may cut short
mkdir -p "$L/prof"
# shellcheck disable=SC2086
env $SHAPE timeout 420 python bench/profile_stages.py --stages 1,2,3 --steps 6 --verbose --out "$L/prof" \
    > "$L/profile.out" 2>&1
note "profile rc=$?"
cp "$L/prof/table.md" "$L/profile_table.md" 2>/dev/null
cp "$L/prof/kernels.csv" "$L/profile_kernels.csv" 2>/dev/null
# shellcheck disable=SC2086
arm 0 classes GPU_MEMORY_GIB=77 NGRAM_TOKEN_CLASSES=1 $SHAPE
python records/tool.py stages "$L"/classes_s*.txt "$L"/v78_s*.txt > "$L/stages_classes.md" 2>&1
note "stages_classes rc=$?"
