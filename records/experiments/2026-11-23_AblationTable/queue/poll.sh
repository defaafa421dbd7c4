#!/usr/bin/env bash
# poll.sh SECONDS: wait until /tmp/R/DONE or SECONDS pass; copy logs to $OUT; print tails
T=$1; t0=$(date +%s)
[ -f /tmp/R/q.sh ] || { echo "COLD: no queue on this machine"; exit 3; }
cp .devscripts/batches.txt /tmp/R/batches.txt 2>/dev/null
while [ ! -f /tmp/R/DONE ] && [ $(( $(date +%s) - t0 )) -lt $T ]; do sleep 10; done
mkdir -p $OUT/logs; cp -r /tmp/R/logs/. $OUT/logs/ 2>/dev/null; cp /tmp/R/queue.log $OUT/ 2>/dev/null
echo "=== queue.log"; tail -5 /tmp/R/queue.log 2>/dev/null
for f in /tmp/R/logs/*.txt; do echo "=== $f"; grep -E "val_loss|Error|error|peak" $f | tail -4; tail -1 $f; done
[ -f /tmp/R/DONE ] && echo QUEUE_DONE
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
