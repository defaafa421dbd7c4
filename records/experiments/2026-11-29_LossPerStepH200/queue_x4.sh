#!/usr/bin/env bash
# Four H200s (nvidia-h200-x4, ~20 minutes held with staging): issue #48's bar, loss per step at 1270 steps.
# Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash
# bench/lease.sh setup), rank-slice, seeds 19-21 (never used before), step and optimizer graphs on, one
# process per GPU, all four at once (times compare across GPUs only within their few % of clock spread).
#   GPU 0  the loss-per-step arm: main's mechanisms that buy loss per step, none of those that sell it for
#          time (full softmax, no taper row, V7's layout with record #92's narrow Q/K), 1255 + 15 steps,
#          and the hashed n-gram table of 3.9M rows (T3.19), the largest rank-slice holds beside an H100's model
#   GPU 1  the same without the n-gram table, with VAL_MASK=1 (its logs give val with and without the mask)
#   GPU 2  V7's train_gpt.py (records/2026-11-26_V7ProxyRankSliceH100): the bar's train-time reference
#   GPU 3  main as it is (1400 + 15 steps): where main stands against V7 on H200s in the same lease
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
PER_STEP="ATTENTION_LAYERS=0,1,2,3,4,5,7,8,9,10 MLP_LAYERS=0,1,2,3,4,5,6,7,8,9,10 VALUE_EMBED_LAYERS=1,2,8,9,10
NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 NUM_SCHEDULED_ITERATIONS=1255 TAPER_FRACTION=0 STAGE_CE_CANDIDATES=0,0,0,0"
mkdir -p "$L/v7" && cp records/2026-11-26_V7ProxyRankSliceH100/train_gpt.py "$L/v7/"
note "per-step arm with the 3.9M n-gram table (GPU0), without it and VAL_MASK=1 (GPU1), V7 (GPU2), main (GPU3)"
( SEEDS=19,20,21 arm 0 perstep_ngram $PER_STEP NGRAM_ROWS=3900000 ) & p0=$!
( SEEDS=19,20,21 arm 1 perstep $PER_STEP VAL_MASK=1 ) & p1=$!
( cd "$L/v7" && SEEDS=19,20,21 arm 2 v7 ) & p2=$!
( SEEDS=19,20,21 arm 3 main ) & p3=$!
wait $p0 $p1 $p2 $p3
python records/tool.py ablation $L/v7_s*.txt $L/perstep_ngram_s*.txt $L/perstep_s*.txt $L/main_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
python records/tool.py stages $L/v7_s*.txt $L/perstep_ngram_s*.txt $L/perstep_s*.txt $L/main_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
