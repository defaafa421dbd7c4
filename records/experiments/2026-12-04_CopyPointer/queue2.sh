#!/usr/bin/env bash
# The lease's second queue, after queue.sh's first arm (1185 scheduled steps) died at step 251 on a recompile in the
# n-gram table's step: COPY_POINTER=1 at main's step count (the schedule every warm-up covers), then main's defaults.
need_shards 1 2 3 4 5
watch_gpus 60
arm 0 cplm GPU_MEMORY_GIB=77 COPY_POINTER=1
arm 0 base GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/cplm_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
