#!/usr/bin/env bash
# One H200 (nvidia-h200, ~22 minutes held with staging): two quality questions in one lease, three
# 1-GPU rank-slice processes sharing the GPU (their losses count, their times do not), each
# CUDA_GRAPHS=0 and SEEDS=1,2,3 in one process, proxy train shards 1-4 (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
#   lane 1: main
#   lane 2: ORTHOGONALIZER=polar_express4_l1e2, four quintic maps (../2026-11-28_QuinticMaps, its lane 3)
#   lane 3: stage-3 documents of 3072 tokens under a 2560-token attention cap (../2026-11-28_LongDocsQuality)
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
note "quality lanes on GPU 0: main, four maps, 3072-token documents with the 2560 cap"
( arm 0 main CUDA_GRAPHS=0 ) & p1=$!
( arm 0 fourmaps CUDA_GRAPHS=0 ORTHOGONALIZER=polar_express4_l1e2 ) & p2=$!
( arm 0 docs3072cap CUDA_GRAPHS=0 STAGE_MAX_SEQ_LEN=896,2048,3072,3072,3072 STAGE_ATTENTION_CAP=0,0,2560,2560,2560 ) & p3=$!
wait $p1 $p2 $p3
python records/tool.py ablation $L/main_s*.txt $L/fourmaps_s*.txt $L/docs3072cap_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
python records/tool.py stages $L/main_s*.txt $L/fourmaps_s*.txt $L/docs3072cap_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
