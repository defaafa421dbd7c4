#!/usr/bin/env bash
# One H200 (nvidia-h200, ~28 minutes held with staging; two GPUs: queue.sh, which adds lanes): the two
# levers of issue #51 items 3-4 against main, proxy train shards 1-4, rank-slice (setup as queue.sh).
#   quality: three eager lanes sharing the GPU, SEEDS=1,2,3 each: main / NARROW_VO_LAYERS=0,5,7 /
#     layer 7 dropped; beside them the GPU tests of narrow V/O and of the FP8 MLP with layer 7 dropped
#   time: then alone with the step graphs, seed 1: layer 7 dropped, then main
need_shards 1 2 3 4
watch_gpus 60
DROP7="ATTENTION_LAYERS=0,1,2,3,5,8,10 MLP_LAYERS=0,1,2,3,4,5,6,8,9,10 NARROW_QK_LAYERS=0,1,2,5,8"
note "quality lanes on GPU 0: main, narrow V/O 0,5,7, layer 7 dropped"
( arm 0 main CUDA_GRAPHS=0 ) & p1=$!
( arm 0 nvo057 CUDA_GRAPHS=0 NARROW_VO_LAYERS=0,5,7 ) & p2=$!
( arm 0 drop7 CUDA_GRAPHS=0 $DROP7 ) & p3=$!
( check 0 gpu_tests 900 python -m pytest -q -m gpu tests/model/test_narrow_vo.py tests/kernels/test_mlp.py \
      -k "narrow_vo or fp8_mlp_trains" ) & p4=$!
wait $p1 $p2 $p3 $p4
python records/tool.py ablation $L/main_s*.txt $L/nvo057_s*.txt $L/drop7_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
note "timing: layer 7 dropped then main, graphs on, seed 1, alone"
SEEDS=1 arm 0 t_drop7 $DROP7
SEEDS=1 arm 0 t_main
python records/tool.py stages $L/t_*_s1.txt > $L/timing_stages.md 2>&1
note "timing stages rc=$?"
