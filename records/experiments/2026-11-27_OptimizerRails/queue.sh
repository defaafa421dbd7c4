#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4; ~16 minutes with staging): record #92's optimizer
# update rule and endgame as A/B arms (issue #48 item 2), three seeds each, one 1-GPU rank-slice
# process per GPU (times valid: the arms run side by side on one host).
#   GPU 0: main, the baseline.
#   GPU 1: MUON_RAILS=1 (T2.9): two momentum rails from 0.44 of the scheduled steps.
#   GPU 2: TAIL_EMA_STEPS=300 (T5.4): the weights' EMA over the last 300 steps, blended in at the end.
#   GPU 3: both.
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1
TAIL="TAIL_EMA_STEPS=300"

note "main / rails / tail EMA / both on GPUs 0-3 (3 seeds each)"
( CUDA_VISIBLE_DEVICES=0 RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
  note "main (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 RUN_ID=rails MUON_RAILS=1 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/rails.out 2>&1
  note "rails (GPU1) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=2 RUN_ID=tail_ema env $TAIL SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/tail_ema.out 2>&1
  note "tail EMA (GPU2) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=3 RUN_ID=both MUON_RAILS=1 env $TAIL SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py \
      > $L/both.out 2>&1
  note "both (GPU3) rc=$?" ) &
wait
python records/tool.py ablation $L/*_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
