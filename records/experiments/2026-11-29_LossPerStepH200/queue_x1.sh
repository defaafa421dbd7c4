#!/usr/bin/env bash
# One H200 (nvidia-h200, ~27 minutes held with staging): issue #48's bar, the loss-per-step arm of queue_x4.sh
# (whose four-GPU lease was taken back in its warm-up) then V7's script, each alone on the GPU, seeds 19-21.
# Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash
# bench/lease.sh setup), rank-slice, step and optimizer graphs on.
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
PER_STEP="ATTENTION_LAYERS=0,1,2,3,4,5,7,8,9,10 MLP_LAYERS=0,1,2,3,4,5,6,7,8,9,10 VALUE_EMBED_LAYERS=1,2,8,9,10
NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 NUM_SCHEDULED_ITERATIONS=1255 TAPER_FRACTION=0 STAGE_CE_CANDIDATES=0,0,0,0"
mkdir -p "$L/v7" && cp records/2026-11-26_V7ProxyRankSliceH100/train_gpt.py "$L/v7/"
SEEDS=19,20,21 arm 0 perstep_ngram $PER_STEP NGRAM_ROWS=3900000
python records/tool.py stages $L/perstep_ngram_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
# V7 last: a session's device budget may end the lease first (it did on 2026-11-28, with ~18 minutes left)
(cd "$L/v7" && SEEDS=19,20,21 arm 0 v7)
python records/tool.py stages $L/v7_s*.txt $L/perstep_ngram_s*.txt > $L/stages.md 2>&1
note "stages (V7) rc=$?"
