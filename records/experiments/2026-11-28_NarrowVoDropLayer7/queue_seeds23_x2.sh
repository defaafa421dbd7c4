#!/usr/bin/env bash
# Two H200s (nvidia-h200-x2, ~9 minutes held with staging): layer 7 dropped and main side by side, one per GPU,
# each alone on its GPU with the step graphs, SEEDS=2,3 (seed 1 of both ran before: queue_pair_x2.sh and
# ../2026-11-28_FourMapsLongDocsH200), so each arm has three seeds of loss and a same-lease time per seed.
# Proxy train shards 1-4, rank-slice (setup as queue_x4.sh). arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
DROP7="ATTENTION_LAYERS=0,1,2,3,5,8,10 MLP_LAYERS=0,1,2,3,4,5,6,8,9,10 NARROW_QK_LAYERS=0,1,2,5,8"
note "GPU 0: layer 7 dropped, GPU 1: main; graphs on, seeds 2,3"
( SEEDS=2,3 arm 0 t_drop7 $DROP7 ) & p1=$!
( SEEDS=2,3 arm 1 t_main ) & p2=$!
wait $p1 $p2
python records/tool.py stages $L/t_*_s2.txt $L/t_*_s3.txt > $L/timing_stages.md 2>&1
note "timing stages rc=$?"
