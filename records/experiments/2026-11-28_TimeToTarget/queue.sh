#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4): levers that lose loss but save time, priced against main's
# own loss-time curve (issues #51 and #48). ~15 minutes with warm compile caches carried from an earlier lease
# (bench/lease.sh pack-cache), ~20 without. Proxy train shards 1-4 (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' DATA_SRC=/tmp/stage bash bench/lease.sh setup),
# rank-slice, SEEDS=1,2,3, the step graphs on, two arms one after the other on each GPU. Times compare
# cleanly on one GPU (GPU 0: the cut against main); across GPUs they differ by a few % (clocks.txt).
#   GPU 0: main (1270 steps)                     then the cut (attention off on layers 4 and 9, four planes)
#   GPU 1: sampled CE + taper (1270)             then main at 1330 steps (main's curve above 1270)
#   GPU 2: sampled CE + taper at 1330            then the cut at 1330
#   GPU 3: larger budgets + taper at 1330        then the cut and the sampled CE together at 1330
# Main at 1150 steps (3.6451, 58.06 s on 2026-11-27, ../2026-11-27_NgramFourShards) is the curve's third point.
# arm and note come from bench/lease.sh.
for i in 1 2 3 4; do [ -f /tmp/d/proxy_train_00000$i.bin ] || { note "shard $i missing: give setup SHARDS"; exit 1; }; done
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
( while sleep 60; do nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
      >> $L/clocks.txt 2>&1; done ) &
clock_pid=$!
sampled="TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0"
larger="TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=14336,20480,24576,0,0"
cut="ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10 NARROW_QK_LAYERS=0,1,2,5,7,8"
more="NUM_SCHEDULED_ITERATIONS=1315"
note "time to target: main/cut, sampled/main1330, sampled1330/cut1330, larger1330/sampled_cut1330"
( arm 0 main; arm 0 cut $cut ) &
( arm 1 sampled $sampled; arm 1 main1330 $more ) &
( arm 2 sampled1330 $sampled $more; arm 2 cut1330 $cut $more ) &
( arm 3 larger1330 $larger $more; arm 3 sampled_cut1330 $sampled $cut $more ) &
wait -n; wait -n; wait -n; wait -n
kill $clock_pid 2>/dev/null
python records/tool.py ablation $L/main_s*.txt $L/main1330_s*.txt $L/cut_s*.txt $L/cut1330_s*.txt \
    $L/sampled_s*.txt $L/sampled1330_s*.txt $L/larger1330_s*.txt $L/sampled_cut1330_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
