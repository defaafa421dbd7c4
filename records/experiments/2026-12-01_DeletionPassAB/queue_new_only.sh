#!/usr/bin/env bash
# What one session's leftover device time allowed: the deletion pass's train_gpt.py alone on one H200 (its defaults:
# step graphs, FA4), seeds 1-2, GPU_MEMORY_GIB=77, rank-slice, proxy train shards 1-5, cold compile caches. Compared
# across leases with 7ec2b2e's own (records/experiments/2026-11-29_MainNgramTable/lease3: 52.36 s, 3.6085 at seeds
# 1-3); the same-lease A/B is queue.sh.
need_shards 1 2 3 4 5
watch_gpus 60
SEEDS=1,2 arm 0 new GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/new_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
