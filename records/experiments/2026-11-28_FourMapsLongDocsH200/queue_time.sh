#!/usr/bin/env bash
# Same lease, after queue.sh (its compile caches warm): one timing run per arm, alone on the GPU, the
# step graphs on, SEEDS=1: the 3072-token documents with the 2560 cap first, then main.
need_shards 1 2 3 4
note "timing: docs3072cap then main, graphs on, seed 1, alone"
SEEDS=1 arm 0 t_docs3072cap STAGE_MAX_SEQ_LEN=896,2048,3072,3072,3072 STAGE_ATTENTION_CAP=0,0,2560,2560,2560
SEEDS=1 arm 0 t_main
