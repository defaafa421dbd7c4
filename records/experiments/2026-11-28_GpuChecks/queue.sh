#!/usr/bin/env bash
# One GPU, alone (nvidia-h100-x1 or nvidia-h200, ~15 minutes with staging): the GPU tests and benches of
# everything merged on 2026-11-27 without a GPU, before any long run relies on it.
#   1. the step graphs' gpu tests with the tail EMA now on by default (T5.3, T5.4)
#   2. VALUE_EMBED_SPARSE (T3.20): a compiled tiny run beside the dense default
#   3. the re-derived quintic maps (T2.3): the Triton orthogonalization at five and six maps against
#      float64 and the torch path, then bench_orthogonalize for the default and the six-map set
# Each step has its own timeout and log; a failure does not stop the next.
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
export CUDA_VISIBLE_DEVICES=0
check() {  # check NAME SECONDS COMMAND...: run it, log to $L/NAME.out, note its rc
    local name=$1 seconds=$2; shift 2
    timeout "$seconds" "$@" > "$L/$name.out" 2>&1
    note "$name rc=$?"
}
check step_graph_tests 420 python -m pytest -q -m gpu tests/training/test_step_graphs.py
check ve_sparse_test 600 python -m pytest -q -m gpu tests/optimizer/test_value_embed_sparse.py
check orthogonalize_tests 420 python -m pytest -q -m gpu tests/kernels/test_kernels.py -k triton_orthogonalize
check bench_polar_express 240 python bench/bench_orthogonalize.py
check bench_polar_express6 240 python bench/bench_orthogonalize.py --method polar_express6_l3e4
