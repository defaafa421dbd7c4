#!/usr/bin/env bash
# A 4-GPU H100 lease (nvidia-h100-x4) for issue #47's bar: main (step graphs on) against CUDA_GRAPHS=0,
# one 1-GPU rank-slice process per GPU, all four at once, each arm on two GPUs so that the GPUs' clock
# spread cancels (GPU 0 and 3 main, 1 and 2 eager; seeds 1-3 on GPUs 0-1, 4-6 on GPUs 2-3, paired by
# seed). Proxy train shards 1-4 (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
# arm, note, need_shards, watch_gpus: bench/lease.sh. The 1-GPU queue (../2026-11-28_GraphsSparseH100) lost its machine mid-run.
need_shards 1 2 3 4
watch_gpus 60
note "graphs on H100: main on GPU 0 and 3, CUDA_GRAPHS=0 on GPU 1 and 2"
( arm 0 mainA ) &
( arm 1 eagerA CUDA_GRAPHS=0 ) &
( SEEDS=4,5,6 arm 2 eagerB CUDA_GRAPHS=0 ) &
( SEEDS=4,5,6 arm 3 mainB ) &
wait -n; wait -n; wait -n; wait -n
python records/tool.py ablation $L/main?_s*.txt $L/eager?_s*.txt > $L/ablation_graphs.md 2>&1
note "ablation (CUDA_GRAPHS=0 against main, 6 seeds each) rc=$?"
