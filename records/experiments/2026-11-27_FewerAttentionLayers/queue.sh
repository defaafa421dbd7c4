#!/usr/bin/env bash
# Issue #51 item 4 on one GPU (bench/lease.sh start; proxy shards 1-3, rank-slice): main against main
# with the attention of layers 4 and 9 and the value-embedding plane of layer 9 dropped (record #92's
# cut), SEEDS=1,2,3 per arm, each arm alone on the GPU (time and loss). Then the stage profile of both.
note "main: start"
RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
note "main: rc=$?"
RUN_ID=drop49 ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10 SEEDS=1,2,3 LOG_DIR=$L \
    python train_gpt.py > $L/drop49.out 2>&1
note "drop49: rc=$?"
python records/tool.py ablation $L/main_s*.txt $L/drop49_s*.txt > $L/ablation.md 2>&1
note "ablation: rc=$?"
