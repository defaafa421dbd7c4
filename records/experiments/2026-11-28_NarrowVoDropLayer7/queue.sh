#!/usr/bin/env bash
# One H200 (nvidia-h200, ~28 minutes held with staging): narrow V/O heads (T3.21, issue #51 item 3).
# Proxy train shards 1-4, rank-slice (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
#   first, alone: the GPU test of the narrow V/O model (FA4's (64, 64) pair and the kernels against
#     the torch path), then bench/bench_head_dims.py's pairs at 49,152 tokens
#   quality: three eager lanes sharing the GPU (losses count, times do not), SEEDS=1,2,3 each:
#     main / NARROW_VO_LAYERS=0,5,7 / NARROW_VO_LAYERS=5,7
#   time: then alone on the GPU with the step graphs, seed 1 each, one after the other:
#     NARROW_VO_LAYERS=0,5,7, then main
# arm, check, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
check 0 narrow_vo_gpu_test 420 python -m pytest -q -m gpu tests/model/test_narrow_vo.py
check 0 bench_head_dims 300 python bench/bench_head_dims.py
note "quality lanes on GPU 0: main, narrow V/O on 0,5,7 and on 5,7"
( arm 0 main CUDA_GRAPHS=0 ) & p1=$!
( arm 0 nvo057 CUDA_GRAPHS=0 NARROW_VO_LAYERS=0,5,7 ) & p2=$!
( arm 0 nvo57 CUDA_GRAPHS=0 NARROW_VO_LAYERS=5,7 ) & p3=$!
wait $p1 $p2 $p3
python records/tool.py ablation $L/main_s*.txt $L/nvo057_s*.txt $L/nvo57_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
note "timing: narrow V/O on 0,5,7 then main, graphs on, seed 1, alone"
SEEDS=1 arm 0 t_nvo057 NARROW_VO_LAYERS=0,5,7
SEEDS=1 arm 0 t_main
python records/tool.py stages $L/t_nvo057_s1.txt $L/t_main_s1.txt > $L/timing_stages.md 2>&1
note "timing stages rc=$?"
