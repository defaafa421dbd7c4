#!/usr/bin/env bash
# Two H200s (nvidia-h200-x2, ~18 minutes held with staging): layer 7 dropped whole against main, quality and
# time in one lease (the four-GPU lease of queue_x4.sh lost its machine after t_drop7). Proxy train shards 1-4,
# rank-slice (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
#   quality: GPU 0, two eager lanes sharing it (their losses count, their times do not), SEEDS=1,2,3: main /
#     layer 7 dropped
#   time: GPU 1, alone on its GPU with the step graphs, seed 1, one after the other: layer 7 dropped, then main
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
DROP7="ATTENTION_LAYERS=0,1,2,3,5,8,10 MLP_LAYERS=0,1,2,3,4,5,6,8,9,10 NARROW_QK_LAYERS=0,1,2,5,8"
note "quality lanes on GPU 0: main, layer 7 dropped; timing on GPU 1: layer 7 dropped then main, graphs on, seed 1"
( arm 0 main CUDA_GRAPHS=0 ) & p1=$!
( arm 0 drop7 CUDA_GRAPHS=0 $DROP7 ) & p2=$!
( SEEDS=1 arm 1 t_drop7 $DROP7; SEEDS=1 arm 1 t_main ) & p3=$!
wait $p1 $p2
python records/tool.py ablation $L/main_s*.txt $L/drop7_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
wait $p3
python records/tool.py stages $L/t_*_s1.txt > $L/timing_stages.md 2>&1
note "timing stages rc=$?"
