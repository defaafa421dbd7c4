#!/usr/bin/env bash
# One nvidia-h200 lease (~25 minutes held with staging): the sink tables with their Adam every 4th step (T2.10,
# issues #51 and #48 item 2) against main as it was before them (699698b, in main_699698b/), one arm after the
# other on the one GPU, 3 seeds each (1-3), proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz
# proxy_val_000000.bin.xz' bash bench/lease.sh setup), rank-slice, step and optimizer graphs on.
#   1. main at 699698b: a fresh compile (~7.5 min), 3 seeds
#   2. the sink tables, TABLE_ADAM_PERIOD=4 from 0.3 of the steps (the defaults): a second compile, 3 seeds
#   3. if the hold leaves room: TABLE_ADAM_PERIOD=2 (the sink path on T2.7's cadence), its time apart from the
#      cadence's loss
# arm, note, need_shards, watch_gpus: bench/lease.sh.
D=records/experiments/2026-11-28_SinkTables
need_shards 1 2 3 4
watch_gpus 60
# the GPU tests of the changed paths (step graphs' capture with the taps' scatter, the compiled model, the QK-rope
# model test) beside main's compile, under a timeout that ends them before its timed runs start
check 0 gpu_tests 330 python -m pytest -q -x -m gpu tests/training/test_step_graphs.py tests/model/test_architecture.py \
    tests/kernels/test_qk_rope_kernels.py &
tests_pid=$!
(cd "$D/main_699698b" && arm 0 main)
wait "$tests_pid"  # not the clock watcher's
arm 0 sinks4
python records/tool.py ablation $L/main_s*.txt $L/sinks4_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
python records/tool.py stages $L/main_s*.txt $L/sinks4_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
if [ "$SECONDS" -lt 1150 ]; then
    arm 0 sinks2 TABLE_ADAM_PERIOD=2
    python records/tool.py stages $L/main_s*.txt $L/sinks4_s*.txt $L/sinks2_s*.txt > $L/stages3.md 2>&1
    note "stages (three arms) rc=$?"
else
    note "sinks2 skipped: ${SECONDS}s gone"
fi
