#!/usr/bin/env bash
# Issue #46: the restructured main (one config tree, execution plans, GPT.layer) against 816cd7f
# (= record V7's train_gpt.py) on one H100, same math expected. Each arm compiled alone, then
# SEEDS=1,2,3 in one process; the restructured arm first. Then the GPU tests of the restructured code.
# Run by bench/lease.sh start (its environment: proxy shards 1-3, rank-slice, L = the log folder).
note "new: start"
RUN_ID=new SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/new.out 2>&1
note "new: rc=$?"
mkdir -p $L/old && cp records/2026-11-26_V7ProxyRankSliceH100/train_gpt.py $L/old/
(cd $L/old && RUN_ID=old SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/old.out 2>&1)
note "old: rc=$?"
timeout 600 python -m pytest -q -m gpu tests > $L/gpu_tests.log 2>&1
note "gpu tests: rc=$?"
