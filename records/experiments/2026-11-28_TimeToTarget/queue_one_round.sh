#!/usr/bin/env bash
# queue.sh cut to one round for a lease with ~15 minutes of device time left and no compile caches: one arm
# per GPU, all four at once, 1270 steps, SEEDS=1,2,3, step graphs on. Losses compare paired by seed; times
# across GPUs carry the GPUs' clock spread (clocks.txt), so the pricing uses main's curve (main@1150 from
# ../2026-11-27_NgramFourShards) and each arm's own loss delta first.
#   GPU 0: main   GPU 1: sampled CE + taper   GPU 2: the cut   GPU 3: sampled CE + taper + the cut
for i in 1 2 3 4; do [ -f /tmp/d/proxy_train_00000$i.bin ] || { note "shard $i missing: give setup SHARDS"; exit 1; }; done
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
( while sleep 60; do nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,memory.used --format=csv,noheader \
      >> $L/clocks.txt 2>&1; done ) &
clock_pid=$!
sampled="TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0"
cut="ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10 NARROW_QK_LAYERS=0,1,2,5,7,8"
note "time to target, one round: main / sampled / cut / sampled+cut"
( arm 0 main ) &
( arm 1 sampled $sampled ) &
( arm 2 cut $cut ) &
( arm 3 sampled_cut $sampled $cut ) &
wait -n; wait -n; wait -n; wait -n
kill $clock_pid 2>/dev/null
python records/tool.py ablation $L/main_s*.txt $L/sampled_s*.txt $L/cut_s*.txt $L/sampled_cut_s*.txt \
    > $L/ablation.md 2>&1
note "ablation rc=$?"
