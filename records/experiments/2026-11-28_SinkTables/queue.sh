#!/usr/bin/env bash
# One nvidia-h200 lease (~25 minutes held with staging): the sink tables with their Adam every 4th step (T2.10,
# removed since; their code is commit 7b2a36c: before staging, `git show 7b2a36c:train_gpt.py >
# records/experiments/2026-11-28_SinkTables/sink_tables_7b2a36c/train_gpt.py`) against main, one arm after the other on the
# one GPU, 3 seeds each (1-3), proxy train shards 1-4 (setup: SHARDS='proxy_train_00000[1-4].bin.xz
# proxy_val_000000.bin.xz' bash bench/lease.sh setup), rank-slice, step and optimizer graphs on.
# Lease 1 ran this from commit 7b2a36c: main from a copy of 699698b's train_gpt.py (the math of main's since
# the removal), the sinks from the repository root, and the GPU tests of 7b2a36c beside main's compile.
#   1. main: a fresh compile (~7.5 min), 3 seeds
#   2. the sink tables at their defaults (TABLE_ADAM_PERIOD=4 from 0.3 of the steps): a second compile, 3 seeds
#   3. if the hold leaves room: TABLE_ADAM_PERIOD=2 (the sink path on T2.7's cadence)
# arm, note, need_shards, watch_gpus: bench/lease.sh.
D=records/experiments/2026-11-28_SinkTables
need_shards 1 2 3 4
[ -f "$D/sink_tables_7b2a36c/train_gpt.py" ] || { note "$D/sink_tables_7b2a36c/train_gpt.py missing: git show 7b2a36c:train_gpt.py into it before staging"; exit 1; }
watch_gpus 60
arm 0 main
(cd "$D/sink_tables_7b2a36c" && arm 0 sinks4)
python records/tool.py stages $L/main_s*.txt $L/sinks4_s*.txt > $L/stages.md 2>&1
note "stages rc=$?"
if [ "$SECONDS" -lt 1150 ]; then
    (cd "$D/sink_tables_7b2a36c" && arm 0 sinks2 TABLE_ADAM_PERIOD=2)
    python records/tool.py stages $L/main_s*.txt $L/sinks4_s*.txt $L/sinks2_s*.txt > $L/stages3.md 2>&1
    note "stages (three arms) rc=$?"
else
    note "sinks2 skipped: ${SECONDS}s gone"
fi
