#!/usr/bin/env bash
# Two H200s (nvidia-h200-x2, ~16 minutes held with staging): layer 7 dropped, given 50 more scheduled steps, against
# main, each alone on its GPU with the step graphs, SEEDS=1,2,3 (one compile per arm); then seed 3 of the cut at
# main's 1350 steps, the seed the session of 2026-11-28 did not reach. Proxy train shards 1-4, rank-slice (setup as
# queue_x4.sh). arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
DROP7="ATTENTION_LAYERS=0,1,2,3,5,8,10 MLP_LAYERS=0,1,2,3,4,5,6,8,9,10 NARROW_QK_LAYERS=0,1,2,5,8"
note "GPU 0: layer 7 dropped at 1400 scheduled steps, then at 1350 (seed 3); GPU 1: main; graphs on"
( arm 0 t_drop7_n1400 $DROP7 NUM_SCHEDULED_ITERATIONS=1400; SEEDS=3 arm 0 t_drop7 $DROP7 ) & p1=$!
( arm 1 t_main ) & p2=$!
wait $p1 $p2
python records/tool.py ablation $L/t_main_s*.txt $L/t_drop7_n1400_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
python records/tool.py stages $L/t_*_s*.txt > $L/timing_stages.md 2>&1
note "timing stages rc=$?"
