#!/usr/bin/env bash
# Issue #77's same-lease A/B on one H200: 7ec2b2e's train_gpt.py (before the deletion pass; staged as
# /tmp/stage/base_7ec2b2e.py by the setup call) against this tree's, each alone on the GPU with its defaults
# (step graphs; 7ec2b2e's optimizer graphs too), seeds 1-3, GPU_MEMORY_GIB=77, rank-slice, proxy train shards
# 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'). Then the GPU tests this change
# touches. ~20 minutes with a cold compile cache. First, before the timed arms, the n-gram table's GPU tests
# (issue #81: its exchange above world size 1 under set_sync_debug_mode("error") and in a CUDA graph).
need_shards 1 2 3 4 5
watch_gpus 60
check 0 ngram_gpu_tests 240 python -m pytest -q -m gpu -p no:cacheprovider tests/optimizer/test_ngram_table.py
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
note "A: 7ec2b2e"
env CUDA_VISIBLE_DEVICES=0 RUN_ID=base SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/base.out" 2>&1
note "base rc=$?"
note "B: the deletion pass"
SEEDS=1,2,3 arm 0 new GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/base_s*.txt "$L"/new_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
check 0 gpu_tests 480 python -m pytest -q -m gpu -p no:cacheprovider tests/training/test_step_graphs.py \
    tests/training/test_gpu_training.py
