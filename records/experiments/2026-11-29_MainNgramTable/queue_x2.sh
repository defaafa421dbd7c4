#!/usr/bin/env bash
# On nvidia-h200-x2 (when lent): what the n-gram table's exchanges cost over NCCL, each rank computing an 8-rank
# share (bench/profile_comm.py --share 8): main's defaults (the table, its rows and gradients sent to their owners
# with a host sync each) against the small bigram table (NGRAM_ROWS=0, its dense reduce-scatter). Proxy train
# shards 1-2; about 15 minutes held without caches. The rank-slice runs never pay these exchanges.
need_shards 1 2
watch_gpus 60
mkdir -p $L/table $L/bigram
check 0,1 comm_table 600 torchrun --standalone --nproc_per_node=2 bench/profile_comm.py --share 8 --out $L/table
check 0,1 comm_bigram 600 env NGRAM_ROWS=0 NUM_SCHEDULED_ITERATIONS=1400 \
    torchrun --standalone --nproc_per_node=2 bench/profile_comm.py --share 8 --out $L/bigram
