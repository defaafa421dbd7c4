#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4; ~15 minutes with staging): issue #51's sampled
# cross-entropy (T4.6) with a full-softmax taper (T5.5), priced in time at equal loss. One arm per GPU
# (one compile each, no second arm), proxy train shards 1-4 (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' DATA_SRC=/tmp/stage bash bench/lease.sh setup),
# rank-slice, SEEDS=1,2,3, the step graphs on (the defaults). Times compare across GPUs here (a few %
# apart at the power limit: clocks.txt); the gains sought are larger, and a same-GPU pair confirms a winner.
#   GPU 0: main (1270 steps)
#   GPU 1: sampled + taper at 1270 steps (the budgets of record #92; +0.0146 at -9.3 % on 2026-11-27)
#   GPU 2: sampled + taper at 1330 steps (60 more: does it reach main's loss in less time?)
#   GPU 3: larger budgets in stages 1-2 + taper at 1330 steps
# arm and note come from bench/lease.sh.
for i in 1 2 3 4; do [ -f /tmp/d/proxy_train_00000$i.bin ] || { note "shard $i missing: give setup SHARDS"; exit 1; }; done
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
( while sleep 60; do nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
      >> $L/clocks.txt 2>&1; done ) &
clock_pid=$!
taper="TAPER_FRACTION=0.08"
note "sampled CE in time: main / sampled+taper 1270 / sampled+taper 1330 / larger budgets+taper 1330"
arm 0 main &
arm 1 sampled $taper STAGE_CE_CANDIDATES=10240,14336,24576,0,0 &
arm 2 sampled1330 $taper STAGE_CE_CANDIDATES=10240,14336,24576,0,0 NUM_SCHEDULED_ITERATIONS=1315 &
arm 3 larger1330 $taper STAGE_CE_CANDIDATES=14336,20480,24576,0,0 NUM_SCHEDULED_ITERATIONS=1315 &
wait -n; wait -n; wait -n; wait -n
kill $clock_pid 2>/dev/null
python records/tool.py ablation $L/main_s*.txt $L/sampled_s*.txt $L/sampled1330_s*.txt $L/larger1330_s*.txt \
    > $L/ablation.md 2>&1
note "ablation rc=$?"
