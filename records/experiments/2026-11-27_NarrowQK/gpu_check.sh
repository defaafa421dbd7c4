#!/usr/bin/env bash
# The last minutes of 2026-11-27's device budget (one GPU, bench/lease.sh start): the narrow model's GPU
# test (FA4 with Q/K 64 and V 128 and FA4_NARROW_BACKWARD_TILE's backward, against SDPA and the torch
# path), then bench_qk_rope at stage 3's size with its gradient copies fixed (T6.4).
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1
timeout 420 python -m pytest -q -m gpu tests/model/test_narrow_qk.py > $L/narrow_gpu_test.out 2>&1
note "narrow gpu test rc=$?"
timeout 300 python bench/bench_qk_rope.py --tokens 49152 > $L/qk_rope.md 2>&1
note "bench_qk_rope rc=$?"
