#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4; ~16 minutes with staging): record #92's optimizer
# update rule and the tail EMA's cost and window as A/B arms (issue #48 item 2), three seeds each, one
# 1-GPU rank-slice process per GPU (times valid: the arms run side by side on one host).
#   GPU 0: main, the baseline (the tail EMA on since 2026-11-27: TAIL_EMA_FRAC=0.236, 300 steps).
#   GPU 1: MUON_RAILS=0 (T2.9): the single EMA (the rails are on by default since 2026-11-27).
#   GPU 2: TAIL_EMA_FRAC=0 (T5.4 off): the tail EMA's time on the clock, and its gain again.
#   GPU 3: TAIL_EMA_FRAC=0.16 (200 steps): a shorter window.
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1

note "main / rails off / no tail EMA / 200-step tail EMA on GPUs 0-3 (3 seeds each)"
( CUDA_VISIBLE_DEVICES=0 RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
  note "main (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 RUN_ID=rails_off MUON_RAILS=0 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/rails_off.out 2>&1
  note "rails off (GPU1) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=2 RUN_ID=no_tail_ema TAIL_EMA_FRAC=0 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py \
      > $L/no_tail_ema.out 2>&1
  note "no tail EMA (GPU2) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=3 RUN_ID=tail_ema200 TAIL_EMA_FRAC=0.16 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py \
      > $L/tail_ema200.out 2>&1
  note "200-step tail EMA (GPU3) rc=$?" ) &
wait
python records/tool.py ablation $L/*_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
