#!/usr/bin/env bash
# Issue #47 (and #51's sampled CE) on one GPU, when no 4-GPU kind is lent (on a 4-GPU lease,
# ../2026-11-27_FourGpusH100/queue3.sh runs the same arms side by side): main with the training step's
# CUDA graphs (the default) against CUDA_GRAPHS=0, then the graphs with the host-launch thresholds
# lifted (FUSED_MLP_MIN_TOKENS=0 FP8_QKV_MIN_TOKENS=0), then the sampled training CE at record #92's
# budgets; SEEDS=1,2,3 in one process per arm, the graphed arm first (its warm-up compiles on the
# fresh machine, later arms reuse the cache). Then the per-stage wall and kernel sums both ways
# (profile_stages --graphs both), the GPU tests of the graphs and of QK_ROPE_KERNEL and its benchmark
# (T6.4), if the machine is still held. Run by
# bench/lease.sh start (proxy shards 1-3, rank-slice).
note "graphs: start"
RUN_ID=graphs SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/graphs.out 2>&1
note "graphs: rc=$?"
RUN_ID=eager CUDA_GRAPHS=0 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/eager.out 2>&1
note "eager: rc=$?"
RUN_ID=lowthresh FUSED_MLP_MIN_TOKENS=0 FP8_QKV_MIN_TOKENS=0 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py \
    > $L/lowthresh.out 2>&1
note "lowthresh: rc=$?"
RUN_ID=sampled STAGE_CE_CANDIDATES=10240,14336,24576,0 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/sampled.out 2>&1
note "sampled: rc=$?"
python bench/profile_stages.py --graphs both --out $L/profile > $L/profile.out 2>&1
note "profile: rc=$?"
cp $L/profile/table.md $L/profile_table.md 2>/dev/null
timeout 400 python -m pytest -q -m gpu tests/training/test_step_graphs.py tests/tools/test_profile_stages.py \
    tests/training/test_gpu_training.py tests/kernels/test_qk_rope_kernels.py > $L/gpu_tests.log 2>&1
note "gpu tests: rc=$?"
python bench/bench_qk_rope.py --launch 16x4,64x8 > $L/qk_rope.md 2>&1
note "bench_qk_rope: rc=$?"
