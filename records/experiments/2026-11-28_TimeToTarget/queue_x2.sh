#!/usr/bin/env bash
# The two-GPU form of queue_confirm.sh (a 2-GPU lease, nvidia-h100-x2 or -h200-x2, when no 4-GPU kind is
# lent): "both" (sampled CE + taper and the cut) at 1415 steps against main on one GPU, and issue #47's
# pair (main against CUDA_GRAPHS=0) on the other, each GPU running its two arms one after the other so
# that every time comparison is on one GPU. Proxy train shards 1-4 (setup:
# SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup),
# rank-slice, SEEDS=1,2,3, the step graphs on. ~20 minutes without carried compile caches.
#   GPU 0: main              then CUDA_GRAPHS=0
#   GPU 1: both at 1415      then main
need_shards 1 2 3 4
watch_gpus 30
both="TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0 ATTENTION_LAYERS=0,1,2,3,5,7,8,10"
both="$both VALUE_EMBED_LAYERS=1,2,8,10 NARROW_QK_LAYERS=0,1,2,5,7,8"
note "confirm x2: main/eager on GPU 0, both1415/main on GPU 1"
( arm 0 main_a; arm 0 eager CUDA_GRAPHS=0 ) &
( arm 1 both1415 $both NUM_SCHEDULED_ITERATIONS=1400; arm 1 main_b ) &
wait -n; wait -n
python records/tool.py ablation $L/main_b_s*.txt $L/both1415_s*.txt > $L/ablation.md 2>&1
note "ablation (both at 1415 against main on GPU 1) rc=$?"
python records/tool.py ablation $L/main_a_s*.txt $L/eager_s*.txt > $L/ablation_graphs.md 2>&1
note "ablation (CUDA_GRAPHS=0 against main on GPU 0) rc=$?"
