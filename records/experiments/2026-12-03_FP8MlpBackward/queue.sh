#!/usr/bin/env bash
# Issue #78 item 2 on one H200: the FP8 MLP backward (T6.5, FP8_MLP_BACKWARD=1) against main's bf16 backward.
# First the MLP's GPU tests, then a 3-seed A/B, each arm alone on the GPU (time and val both count), then stages 2
# and 3 profiled with the FP8 backward (the per-kernel CSV comes back), then the MLP alone (bench/bench_mlp.py:
# eager and CUDA-graph-replayed forward + backward at the three stage sizes; last, since the device budget may cut
# it). Main's defaults, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz
# proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. About 25 minutes held with cold compile caches.
need_shards 1 2 3 4 5
watch_gpus 60
check 0 mlp_gpu_tests 420 python -m pytest -q -m gpu tests/kernels/test_mlp.py -p no:cacheprovider
arm 0 base GPU_MEMORY_GIB=77
arm 0 fp8b GPU_MEMORY_GIB=77 FP8_MLP_BACKWARD=1
python records/tool.py stages "$L"/base_s*.txt "$L"/fp8b_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
mkdir -p "$L/prof"  # where the FP8 backward's step time goes now (issue #78 item 1's table, per kernel)
check 0 profile 600 env FP8_MLP_BACKWARD=1 python bench/profile_stages.py --stages 2,3 --steps 6 --verbose --out "$L/prof"
check 0 bench_mlp 420 python bench/bench_mlp.py
