#!/usr/bin/env bash
# One H200 (nvidia-h200, ~25 minutes with staging): the re-derived quintic map sets (T2.3, issue #48
# item 2) as quality runs, three 1-GPU rank-slice processes sharing the GPU (their times mean nothing;
# the step-time saving of a four-map set is the bench line below; four main-sized eager lanes, ~37.5 GB
# reserved each with the tail EMA, would not fit 139 GB). Every lane CUDA_GRAPHS=0, SEEDS=1,2,3.
#   first, alone on the GPU: bench/bench_orthogonalize.py for the default and the four-map set (ms per
#     bank shape), then the Triton orthogonalization gpu test (correctness, against float64 and the
#     torch path)
#   lane 1: main (the default, ORTHOGONALIZER=polar_express)
#   lane 2: ORTHOGONALIZER=polar_express5_l3e3 (five maps: equal cost, floor 3e-3, envelope ±0.7 %)
#   lane 3 (four maps from 1e-2) ran in ../2026-11-28_FourMapsLongDocsH200 and was removed
#   not run: polar_express6_l3e4 (six maps from 3e-4); six maps from 1e-3 (±0.16 %) gave main's loss
#   (../2026-11-27_FourGpuLevers) and were removed
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
export CUDA_GRAPHS=0 CUDA_VISIBLE_DEVICES=0

note "bench: five maps, alone on the GPU"
timeout 300 python bench/bench_orthogonalize.py > $L/bench_polar_express.out 2>&1
note "bench polar_express rc=$?"
timeout 420 python -m pytest -q -m gpu tests/kernels/test_kernels.py -k triton_orthogonalize > $L/orthogonalize_gpu_test.out 2>&1
note "orthogonalize gpu test rc=$?"

note "two lanes on one GPU: main / 5 maps from 3e-3 (3 seeds each)"
( RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
  note "main rc=$?" ) &
for maps in polar_express5_l3e3; do
  ( RUN_ID=$maps ORTHOGONALIZER=$maps SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/$maps.out 2>&1
    note "$maps rc=$?" ) &
done
wait
python records/tool.py ablation $L/main_s*.txt $L/polar_express5_l3e3_s*.txt \
    > $L/ablation.md 2>&1
note "ablation rc=$?"
