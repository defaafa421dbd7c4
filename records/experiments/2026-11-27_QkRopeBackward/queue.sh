#!/usr/bin/env bash
# QK_ROPE_KERNEL's new backward and the forward-only setting (T6.4, issue #51) on one GPU (bench/lease.sh
# start): the gpu-marked tests of the kernels first (both backwards against float64, compiled against
# eager, the compiled model with QK_ROPE_KERNEL=0, 1 and forward), then bench_qk_rope at stage 3's size
# (49,152 tokens, the step that decides) and at stage 1's (16,384), each path and the backward at three
# more launches. The bench runs even if a test fails: its own float64 check stops a path that disagrees.
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1
timeout 600 python -m pytest -q -m gpu tests/kernels/test_qk_rope_kernels.py > $L/qk_rope_tests.out 2>&1
note "qk_rope gpu tests rc=$?"
for tokens in 49152 16384; do
  timeout 900 python bench/bench_qk_rope.py --tokens $tokens --backward-launch 16x4,32x8,64x8 \
      > $L/qk_rope_$tokens.md 2>&1
  note "bench_qk_rope $tokens rc=$?"
done
