#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4; ~27 minutes with staging) on proxy train shards 1-4
# (about 67M tokens against a 1270-step run's 57M), so that no arm reads a shard twice (with shards 1-3 a
# 1270-step run starts a second pass near step 1120, where the n-gram table fell behind:
# ../2026-11-28_SameGpuPairs). setup must decompress all four:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' DATA_SRC=/tmp/stage bash bench/lease.sh setup
# Every arm reads TRAIN_FILES=/tmp/d/proxy_train_*.bin (lease.sh's default), so all four. SEEDS=1,2,3 per arm,
# rank-slice, one 1-GPU process per GPU, two arms one after the other on each GPU (times compare per GPU).
#   GPU 0: main (rails on)  then main at 1150 steps (issue #48's step budget)
#   GPU 1: CUDA_GRAPHS=0  then CUDA_GRAPHS=0 NGRAM_ROWS=3900000 (the table's time and loss, same GPU)
#   GPU 2: CUDA_GRAPHS=0 NGRAM_ROWS=1000000  then CUDA_GRAPHS=0 NGRAM_ROWS=377280 (the bigram table's rows)
#   GPU 3: the step graph GPU tests (the narrow bank's capture fix; the row tables' loads in the graphs),
#          then bench/profile_stages.py: main's step eager and graphed (issue #47's wall against kernel
#          sums), then the same with the 3.9M-row table (where its +6-9 ms/step go, and what graphs save)
# arm, check and note come from bench/lease.sh.
for i in 1 2 3 4; do [ -f /tmp/d/proxy_train_00000$i.bin ] || { note "shard $i missing: give setup SHARDS"; exit 1; }; done
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
( while sleep 60; do nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
      >> $L/clocks.txt 2>&1; done ) &
clock_pid=$!

note "four shards: main/main 1150, eager/n-gram 3.9M, n-gram 1M/0.38M, step graph tests + n-gram profile"
( arm 0 main; arm 0 main1150 NUM_SCHEDULED_ITERATIONS=1135 ) &
( arm 1 eager CUDA_GRAPHS=0; arm 1 ngram CUDA_GRAPHS=0 NGRAM_ROWS=3900000 ) &
( arm 2 ngram1m CUDA_GRAPHS=0 NGRAM_ROWS=1000000; arm 2 ngram377k CUDA_GRAPHS=0 NGRAM_ROWS=377280 ) &
( check 3 step_graph_tests 300 python -m pytest -q -m gpu tests/training/test_step_graphs.py
  check 3 profile_graphs 480 python bench/profile_stages.py --graphs both --stages 1,2,3 --out $L/prof_graphs
  check 3 profile_ngram 420 env NGRAM_ROWS=3900000 python bench/profile_stages.py --graphs both --stages 1,3 \
      --out $L/prof_ngram ) &
wait -n; wait -n; wait -n; wait -n
kill $clock_pid 2>/dev/null
cp $L/prof_graphs/table.md $L/prof_graphs.md 2>/dev/null; cp $L/prof_ngram/table.md $L/prof_ngram.md 2>/dev/null
python records/tool.py ablation $L/main_s[123].txt $L/main1150_s*.txt > $L/ablation_main.md 2>&1
note "ablation (main at 1150 steps against main) rc=$?"
python records/tool.py ablation $L/eager_s*.txt $L/ngram_s*.txt $L/ngram1m_s*.txt $L/ngram377k_s*.txt \
    > $L/ablation_ngram.md 2>&1
note "ablation (n-gram doses against eager) rc=$?"
