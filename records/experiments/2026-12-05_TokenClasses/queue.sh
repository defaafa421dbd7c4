#!/usr/bin/env bash
# Issue #79's optional lever from modded-nanogpt PR #375 (T3.22): the n-gram table hashing token classes
# (NGRAM_TOKEN_CLASSES=1) against main's defaults, each arm alone on the GPU, 3 seeds, rank-slice, proxy train shards
# 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. About 16 minutes
# held with the compile caches carried (the classes change only the loads' graphs).
need_shards 1 2 3 4 5
watch_gpus 60
arm 0 classes GPU_MEMORY_GIB=77 NGRAM_TOKEN_CLASSES=1
arm 0 base GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/classes_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
