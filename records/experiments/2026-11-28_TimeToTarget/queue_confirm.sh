#!/usr/bin/env bash
# The sampled CE and the cut together at more steps, so that their saving is measured at main's loss instead of
# interpolated along main's curve (lease 1, README). A 4-GPU lease (nvidia-h100-x4 or -h200-x4), two arms one after
# the other per GPU, crossed so that main and "both" each run first on one GPU and second on another; proxy train
# shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup),
# rank-slice, SEEDS=1,2,3, the step graphs on. ~20 minutes without carried compile caches.
#   GPU 0: main              then both at 1365 steps
#   GPU 1: both at 1365      then main
#   GPU 2: both at 1415      then both at 1365
#   GPU 3: CUDA_GRAPHS=0     then main            (issue #47's pair on one GPU, an H100 where the lease is one)
need_shards 1 2 3 4
watch_gpus 30
both="TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0 ATTENTION_LAYERS=0,1,2,3,5,7,8,10"
both="$both VALUE_EMBED_LAYERS=1,2,8,10 NARROW_QK_LAYERS=0,1,2,5,7,8"
note "confirm: main/both1365, both1365/main, both1415/both1365, eager/main"
( arm 0 main_a; arm 0 both1365_a $both NUM_SCHEDULED_ITERATIONS=1350 ) &
( arm 1 both1365_b $both NUM_SCHEDULED_ITERATIONS=1350; arm 1 main_b ) &
( arm 2 both1415 $both NUM_SCHEDULED_ITERATIONS=1400; arm 2 both1365_c $both NUM_SCHEDULED_ITERATIONS=1350 ) &
( arm 3 eager CUDA_GRAPHS=0; arm 3 main_c ) &
wait -n; wait -n; wait -n; wait -n
python records/tool.py ablation $L/main_?_s*.txt $L/both13*_s*.txt $L/both1415_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
python records/tool.py ablation $L/main_c_s*.txt $L/eager_s*.txt > $L/ablation_graphs.md 2>&1
note "ablation (CUDA_GRAPHS=0 against main on GPU 3) rc=$?"
