#!/usr/bin/env bash
# One H100 (nvidia-h100-x1, counted at half its time; ~27 minutes held with staging, under the 30-minute
# hold): issue #47's bar (main against CUDA_GRAPHS=0 in one H100 lease) and issue #51 item 5 (the sparse
# value embeddings under the step graphs). Proxy train shards 1-4 (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' DATA_SRC=/tmp/stage bash bench/lease.sh setup),
# rank-slice, SEEDS=1,2,3 per arm, the arms one after the other alone on the GPU. The third arm runs only if
# the first two left time for it before the machine's 30-minute hold ends. arm and note: bench/lease.sh.
for i in 1 2 3 4; do [ -f /tmp/d/proxy_train_00000$i.bin ] || { note "shard $i missing: give setup SHARDS"; exit 1; }; done
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
arm 0 main
arm 0 eager CUDA_GRAPHS=0
python records/tool.py ablation $L/main_s*.txt $L/eager_s*.txt > $L/ablation_graphs.md 2>&1
note "ablation (CUDA_GRAPHS=0 against main) rc=$?"
if [ "$SECONDS" -lt 1080 ]; then
    # the compiled lazy Adam (lazy_adam_rows) and the compiled tiny run: the arm only if they pass
    check 0 table_gpu_tests 240 python -m pytest -q -m gpu tests/optimizer/test_ngram_table.py \
        tests/optimizer/test_value_embed_sparse.py
    grep -q " passed" $L/table_gpu_tests.out && ! grep -q " failed\| error" $L/table_gpu_tests.out \
        || { note "ve_sparse skipped: a table GPU test failed"; exit 1; }
    arm 0 ve_sparse VALUE_EMBED_SPARSE=1
    python records/tool.py ablation $L/main_s*.txt $L/ve_sparse_s*.txt > $L/ablation_ve_sparse.md 2>&1
    note "ablation (VALUE_EMBED_SPARSE=1 against main) rc=$?"
else
    note "ve_sparse skipped: ${SECONDS}s gone, too close to the 30-minute hold"
fi
