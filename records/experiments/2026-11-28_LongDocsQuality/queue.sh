#!/usr/bin/env bash
# Quality lanes on one H200 (nvidia-h200; ~22 minutes held with staging): record #92's stage-3 documents
# of 3072 tokens under its 2560-token attention cap (issue #48 item 3), against main, three processes
# sharing the GPU (their losses count, their times do not: docs/BENCHMARKS.md), each SEEDS=1,2,3 in one
# process, CUDA_GRAPHS=0 on every lane so three fit beside each other (the step graphs' pool holds
# ~78 GB reserved on its own). Proxy train shards 1-4, rank-slice (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
note "quality lanes on GPU 0: main, 3072-token documents with the 2560 cap, 3072 without a cap"
( arm 0 main CUDA_GRAPHS=0 ) &
( arm 0 docs3072cap CUDA_GRAPHS=0 STAGE_MAX_SEQ_LEN=896,2048,3072,3072,3072 STAGE_ATTENTION_CAP=0,0,2560,2560,2560 ) &
( arm 0 docs3072 CUDA_GRAPHS=0 STAGE_MAX_SEQ_LEN=896,2048,3072,3072,3072 ) &
wait -n; wait -n; wait -n
python records/tool.py ablation $L/main_s*.txt $L/docs3072cap_s*.txt $L/docs3072_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
