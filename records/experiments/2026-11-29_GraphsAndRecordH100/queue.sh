#!/usr/bin/env bash
# One nvidia-h100-x1 lease (H100 only; ~30 minutes held): issue #47's bar, then issue #51's baseline if the
# hold leaves room. Proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz
# proxy_val_000000.bin.xz' bash bench/lease.sh setup), rank-slice, seeds 16-18 (unused so far), each arm alone
# on the GPU.
#   1. main (QK-rope kernels on since fcc6ffc; layer 7 dropped, 1400 scheduled steps, since the second session
#      of 2026-11-28), a fresh compile (~7.5 min) and 3 seeds
#   2. main with CUDA_GRAPHS=0: #47's bar is main <= 0.95x this arm's mean train time at equal loss; it
#      reuses main's compile caches (~3 min warm-up on H200)
#   3. V7's script, if the hold leaves room for its fresh compile (~7 min) and 3 seeds: #51's bar is main
#      <= 0.80x V7 in the same lease at <= V7 + 0.002 val
# Then the ablation and stage tables. arm, check, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
SEEDS=16,17,18 arm 0 main
SEEDS=16,17,18 arm 0 eager CUDA_GRAPHS=0
python records/tool.py ablation $L/main_s*.txt $L/eager_s*.txt > $L/ablation_eager.md 2>&1
note "ablation (eager against main) rc=$?"
python records/tool.py stages $L/main_s*.txt $L/eager_s*.txt > $L/stages_eager.md 2>&1
note "stages rc=$?"
if [ "$SECONDS" -lt 1000 ]; then
    mkdir -p "$L/v7" && cp records/2026-11-26_V7ProxyRankSliceH100/train_gpt.py "$L/v7/"
    (cd "$L/v7" && SEEDS=16,17,18 arm 0 v7)
    python records/tool.py stages $L/main_s*.txt $L/v7_s*.txt > $L/stages_v7.md 2>&1
    note "stages (V7) rc=$?"
else
    note "v7 skipped: ${SECONDS}s gone, too close to the 30-minute hold"
fi
