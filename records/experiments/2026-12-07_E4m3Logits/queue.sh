#!/usr/bin/env bash
# Issue #78 item 4, the cross-entropy's bytes: E4M3_LOGITS=1 (T4.4; record #92's `_ce_logit_gemm`) against this tree's
# defaults, on one H200. First the GPU tests of the cross-entropy (the op on its own e4m3 logits) and
# bench_cross_entropy's lm_head + loss at each stage's tokens, full softmax and stage 2/3's candidate budgets, bf16
# against e4m3 logits; then `base` and `e4m3`, each alone on the GPU, 3 seeds, rank-slice, proxy train shards 1-5
# (setup: SHARDS='proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. `base` goes first and
# compiles what the arms share.
need_shards 1 2 3 4 5
watch_gpus 60
check 0 gpu_tests 500 python -m pytest -q -m gpu tests/kernels/test_cross_entropy.py -p no:cacheprovider
check 0 bench_ce 400 python bench/bench_cross_entropy.py --skip-kernel --skip-transpose --candidates 14336,24576
arm 0 base GPU_MEMORY_GIB=77
arm 0 e4m3 GPU_MEMORY_GIB=77 E4M3_LOGITS=1
python records/tool.py stages "$L"/e4m3_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
