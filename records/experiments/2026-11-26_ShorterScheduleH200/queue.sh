#!/usr/bin/env bash
# Issue #25 item 4: a shorter schedule, quality only. Three processes at once on one H200 (time is not
# measured here), each SEEDS=1,2,3: NUM_SCHEDULED_ITERATIONS 1270 (today's, the control) / 1250 / 1230;
# the extension's 15 steps unchanged; stage boundaries scale with the scheduled steps.
# Then issue #24 item 5's no-communication baseline: bench/profile_comm.py on this one GPU.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
for n in 1270 1250 1230; do
  ( LOG_DIR=$L/full RUN_ID=sched$n NUM_SCHEDULED_ITERATIONS=$n SEEDS=1,2,3 python train_gpt.py > $L/sched$n.out 2>&1
    note "sched$n rc=$?" ) &
done
wait
note "quality done"
mkdir -p $L/one
( unset TRAIN_FILES VAL_FILES VAL_TOKENS RANK_SLICE
  torchrun --standalone --nproc_per_node=1 bench/profile_comm.py --share 8 --synthetic --out $L/one > $L/one.out 2>&1; note "one rc=$?" )
note queue done
