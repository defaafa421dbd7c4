#!/usr/bin/env bash
# Two H200s (nvidia-h200-x2, ~28 minutes held with staging; a one-GPU lease: queue_x1.sh): narrow V/O heads
# (T3.21) and layer 7 dropped whole (T3.1, MLP_LAYERS), issue #51 items 3-4, and five quintic maps from 3e-3
# (T2.3, issue #48 item 2). Proxy train shards 1-4, rank-slice (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
#   quality: three eager lanes per GPU (their losses count, their times do not), SEEDS=1,2,3 each;
#     GPU 0: main / NARROW_VO_LAYERS=0,5,7 / NARROW_VO_LAYERS=5,7
#     GPU 1: layer 7 dropped / layer 7 dropped with NARROW_VO_LAYERS=0,5 / ORTHOGONALIZER=polar_express5_l3e3,
#            beside them the GPU tests of narrow V/O and of the FP8 MLP with layer 7 dropped
#   time: then alone with the step graphs, seed 1, on each GPU the lever first, then main:
#     GPU 0: NARROW_VO_LAYERS=0,5,7 / GPU 1: layer 7 dropped
# arm, check, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
DROP7="ATTENTION_LAYERS=0,1,2,3,5,8,10 MLP_LAYERS=0,1,2,3,4,5,6,8,9,10 NARROW_QK_LAYERS=0,1,2,5,8"
note "quality lanes: GPU 0 main, narrow V/O 0,5,7 and 5,7; GPU 1 layer 7 dropped, with narrow V/O 0,5, five maps from 3e-3"
( arm 0 main CUDA_GRAPHS=0 ) & p1=$!
( arm 0 nvo057 CUDA_GRAPHS=0 NARROW_VO_LAYERS=0,5,7 ) & p2=$!
( arm 0 nvo57 CUDA_GRAPHS=0 NARROW_VO_LAYERS=5,7 ) & p3=$!
( arm 1 drop7 CUDA_GRAPHS=0 $DROP7 ) & p4=$!
( arm 1 drop7nvo05 CUDA_GRAPHS=0 $DROP7 NARROW_VO_LAYERS=0,5 ) & p5=$!
( arm 1 maps5l3e3 CUDA_GRAPHS=0 ORTHOGONALIZER=polar_express5_l3e3 ) & p6=$!
( check 1 gpu_tests 900 python -m pytest -q -m gpu tests/model/test_narrow_vo.py tests/kernels/test_mlp.py \
      -k "narrow_vo or fp8_mlp_trains" ) & p7=$!
wait $p1 $p2 $p3 $p4 $p5 $p6 $p7
python records/tool.py ablation $L/main_s*.txt $L/nvo057_s*.txt $L/nvo57_s*.txt $L/drop7_s*.txt $L/drop7nvo05_s*.txt \
    $L/maps5l3e3_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
note "timing: GPU 0 narrow V/O 0,5,7 then main; GPU 1 layer 7 dropped then main; graphs on, seed 1, one run per GPU at a time"
( SEEDS=1 arm 0 t_nvo057 NARROW_VO_LAYERS=0,5,7; SEEDS=1 arm 0 t_main_gpu0 ) & p1=$!
( SEEDS=1 arm 1 t_drop7 $DROP7; SEEDS=1 arm 1 t_main_gpu1 ) & p2=$!
wait $p1 $p2
python records/tool.py stages $L/t_*_s1.txt > $L/timing_stages.md 2>&1
note "timing stages rc=$?"
