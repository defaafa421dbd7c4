#!/usr/bin/env bash
# Issue #51's record attempt: V7 and main (the 2026-11-28 defaults: sampled CE with the taper, the layout cut)
# in one nvidia-h100-x1 lease, each arm compiled alone, seeds 13-15 (unused so far), proxy train shards 1-4
# (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup), rank-slice.
# Main at 1350 scheduled steps (1365 in all: 2 seeds on 2× H200 put 1415 steps 0.0075 below the old main, so
# fewer steps should still land at or below V7's loss), then, if the 30-minute hold leaves room, at 1400.
# arm, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
mkdir -p "$L/v7" && cp records/2026-11-26_V7ProxyRankSliceH100/train_gpt.py "$L/v7/"
(cd "$L/v7" && SEEDS=13,14,15 arm 0 v7)
SEEDS=13,14,15 arm 0 main1365 NUM_SCHEDULED_ITERATIONS=1350
if [ "$SECONDS" -lt 1320 ]; then
    SEEDS=13,14 arm 0 main1415
else
    note "main1415 skipped: ${SECONDS}s gone, too close to the 30-minute hold"
fi
