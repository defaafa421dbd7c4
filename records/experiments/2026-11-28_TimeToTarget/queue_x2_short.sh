#!/usr/bin/env bash
# What the rest of a lost 2-GPU lease allowed (queue_x2.sh's machine went back 11 minutes in): "both" at
# 1415 steps, seed 2 on GPU 0 and seed 3 on GPU 1, at once. Setup as queue_x2.sh.
need_shards 1 2 3 4
watch_gpus 30
both="TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0 ATTENTION_LAYERS=0,1,2,3,5,7,8,10"
both="$both VALUE_EMBED_LAYERS=1,2,8,10 NARROW_QK_LAYERS=0,1,2,5,7,8"
note "short: both1415 seed 2 on GPU 0, seed 3 on GPU 1"
( SEEDS=2 arm 0 both1415_g0 $both NUM_SCHEDULED_ITERATIONS=1400 ) &
( SEEDS=3 arm 1 both1415_g1 $both NUM_SCHEDULED_ITERATIONS=1400 ) &
wait -n; wait -n
