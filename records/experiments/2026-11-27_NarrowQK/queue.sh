#!/usr/bin/env bash
# Issue #51 item 3 on one GPU (bench/lease.sh start; proxy shards 1-3, rank-slice): first the narrow
# model's GPU test (FA4 with Q/K 64 and V 128, FA4_NARROW_BACKWARD_TILE's backward, the QK-norm + rotary
# kernels) and bench_head_dims; then main against main with record #92's narrow layers, SEEDS=1,2,3 per
# arm, each arm alone on the GPU (time and loss). The A/B runs only if the GPU test passes.
note "gpu test: start"
timeout 900 python -m pytest -q -m gpu tests/model/test_narrow_qk.py tests/kernels/test_qk_rope_kernels.py \
    > $L/gpu_tests.out 2>&1
tests=$?
note "gpu test: rc=$tests"
python bench/bench_head_dims.py > $L/head_dims.md 2>&1
note "bench_head_dims: rc=$?"
[ $tests -eq 0 ] || { note "narrow: skipped (GPU test failed)"; exit 1; }
RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
note "main: rc=$?"
RUN_ID=narrow NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/narrow.out 2>&1
note "narrow: rc=$?"
python records/tool.py ablation $L/main_s*.txt $L/narrow_s*.txt > $L/ablation.md 2>&1
note "ablation: rc=$?"
