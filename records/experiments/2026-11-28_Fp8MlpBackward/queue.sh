#!/usr/bin/env bash
# One GPU (nvidia-h100-x1, bench/lease.sh start): FP8_MLP_BACKWARD (T6.5), issue #51 item 2.
#   1. its gpu tests (the dpre GEMM's e5m2 epilogue, the backward against its reference at 16,384 and
#      49,152 tokens eager and compiled, a compiled model's two steps), then T6.2's, which it touches
#   2. bench/bench_mlp.py --fp8-backward: both backwards of the FP8 MLP, alone on the GPU
#   3. only if the tests passed: a timed pair, sequential and alone on the GPU, SEEDS=1,2,3 each:
#      main (FP8_MLP_BACKWARD=0), then FP8_MLP_BACKWARD=1; then records/tool.py ablation of the two
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
export CUDA_VISIBLE_DEVICES=0

timeout 600 python -m pytest -q -m gpu tests/kernels/test_mlp.py -k "fp8_backward or grad_fp8" \
    > $L/fp8_backward_gpu_tests.out 2>&1
tests=$?
note "fp8 backward gpu tests rc=$tests"
timeout 420 python -m pytest -q -m gpu tests/kernels/test_mlp.py -k "fp8 and not fp8_backward and not grad_fp8" \
    > $L/fp8_forward_gpu_tests.out 2>&1
note "fp8 forward gpu tests rc=$?"

timeout 420 python bench/bench_mlp.py --fp8-backward --tokens 16384 49152 > $L/bench_fp8_backward.md 2>&1
note "bench_mlp --fp8-backward rc=$?"

if [ $tests -ne 0 ]; then
    note "timed pair skipped: the fp8 backward gpu tests failed"
    exit 1
fi
RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
note "main rc=$?"
RUN_ID=fp8_backward FP8_MLP_BACKWARD=1 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/fp8_backward.out 2>&1
note "fp8_backward rc=$?"
python records/tool.py ablation $L/main_s*.txt $L/fp8_backward_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
