#!/usr/bin/env bash
# Lease 3, second queue (LEASE_DIR=/tmp/q2, REPO_COPY=/tmp/repo2): the record candidate, this tree's defaults
# (COPY_POINTER=1, 1085 scheduled + 15 extension steps, FINAL_COPY_WINDOW=8192), 3 seeds, alone on the GPU:
# it waits for queue5's 7ec2b2e arm to end, then ends queue5 (its cplm1150 arm) and runs. Rank-slice, proxy train
# shards 1-5, GPU_MEMORY_GIB=77.
while ! grep -q "base rc=" /tmp/q/status; do sleep 2; done
kill -- -"$(cat /tmp/q/queue.pid)" 2>/dev/null
sleep 3
note "queue5 ended after its 7ec2b2e arm"
watch_gpus 60
arm 0 record GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/record_s*.txt /tmp/q/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
pack_cache
