#!/usr/bin/env bash
# Probe, quality only: MUON_LR 0.014 at the new defaults (1255 scheduled steps), seeds 1-3 in one
# process (the lease came as one H100: three processes do not fit its memory); partners:
# mlr017n1255_s1-3 of records/experiments/2026-11-26_MuonLrFewerStepsH200. As it ran: `touch cache_done`
# only kept an unused poller from saving compile caches.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 VAL_LOSS_EVERY=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q; cd /tmp/repo
touch $L/cache_done
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
arm() { local id=$1; shift; ( env "$@" RUN_ID=$id LOG_DIR=$L/full python train_gpt.py > $L/$id.out 2>&1; note "$id rc=$?" ) & }
arm mlr014 SEEDS=1,2,3 MUON_LR=0.014
wait
note queue done
