#!/usr/bin/env bash
# Lease 4 (2026-12-02, after lease 3's machine went back during its 7ec2b2e arm): the record candidate alone, this
# tree's defaults (COPY_POINTER=1, 1085 scheduled + 15 extension steps, FINAL_COPY_WINDOW=8192), 3 seeds, rank-slice,
# proxy train shards 1-5, GPU_MEMORY_GIB=77; then the compile caches for the next lease.
need_shards 1 2 3 4 5
watch_gpus 60
arm 0 record GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/record_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
