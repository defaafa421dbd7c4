#!/usr/bin/env bash
# Issue #51 item 5 on one GPU (bench/lease.sh start; proxy shards 1-3, rank-slice): first the GPU tests of
# the sparse value embeddings (a compiled tiny run beside the dense default, T3.20) and of the row tables
# under the step graphs (T3.19, T3.20 at world size 1); then main against VALUE_EMBED_SPARSE=1, SEEDS=1,2,3
# per arm, one arm after the other alone on the GPU (time and loss), both with the step and optimizer
# graphs (the defaults). The A/B runs only if the tests pass. arm, check and note come from bench/lease.sh.
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
check 0 gpu_test 600 python -m pytest -q -m gpu tests/optimizer/test_value_embed_sparse.py \
    "tests/training/test_step_graphs.py::test_captured_cuda_graphs_with_row_tables_train_as_eager_steps_without_host_syncs"
grep -q " passed" $L/gpu_test.out && ! grep -q " failed\| error" $L/gpu_test.out \
    || { note "A/B: skipped (a gpu test failed)"; exit 1; }
arm 0 main
arm 0 ve_sparse VALUE_EMBED_SPARSE=1
python records/tool.py ablation $L/main_s*.txt $L/ve_sparse_s*.txt > $L/ablation.md 2>&1
note "ablation: rc=$?"
