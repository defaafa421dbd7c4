#!/usr/bin/env bash
# poll.sh SECONDS: wait until /tmp/R/DONE or SECONDS pass, snapshotting /tmp/R/logs and queue.log into
# $OUT/logs.tar.xz every 30 s (one file: the device returns at most 8, and a call cut short by the
# device budget still returns its last snapshot); print the tails.
T=$1; t0=$(date +%s)
[ -f /tmp/R/q.sh ] || { echo "COLD: no queue on this machine"; exit 3; }
cp .devscripts/batches.txt /tmp/R/batches.txt 2>/dev/null
snapshot() {  # tar exits 1 when a log grows while read; the archive is still whole up to then
  tar -C /tmp/R -cJf $OUT/logs.tar.xz.part logs queue.log 2>/dev/null; [ -s $OUT/logs.tar.xz.part ] && mv $OUT/logs.tar.xz.part $OUT/logs.tar.xz; }
while [ ! -f /tmp/R/DONE ] && [ $(( $(date +%s) - t0 )) -lt $T ]; do snapshot; sleep 30; done
snapshot
echo "=== queue.log"; tail -5 /tmp/R/queue.log 2>/dev/null
for f in /tmp/R/logs/*.txt; do echo "=== $f"; grep -E "val_loss|Error|error|peak" $f | tail -4; tail -1 $f; done
[ -f /tmp/R/DONE ] && echo QUEUE_DONE
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
