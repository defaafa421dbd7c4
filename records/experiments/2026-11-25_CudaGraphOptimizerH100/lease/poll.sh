#!/usr/bin/env bash
# Wait up to $1 seconds (or until the status file gains the line $2), then bring the logs back.
end=$(( $(date +%s) + $1 ))
while [ $(date +%s) -lt $end ]; do
  if [ -n "${2:-}" ] && grep -q "$2" /tmp/q/status 2>/dev/null; then break; fi
  sleep 10
done
cat /tmp/q/status 2>/dev/null
for f in /tmp/q/*.out; do echo "== $f"; grep -E "warm-up|Compile and|step:[0-9]+/[0-9]+ val|Error|error|rc=" $f | tail -6; done
tail -5 /tmp/q/gpu_tests.log 2>/dev/null
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader
tar -C /tmp/q -cJf $OUT/q.tar.xz --exclude='*.json.gz' . 2>/dev/null
ls -la $OUT
