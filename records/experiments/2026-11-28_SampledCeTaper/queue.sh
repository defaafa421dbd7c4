#!/usr/bin/env bash
# One H200 (nvidia-h200, ~22 minutes with staging): issue #51's sampled cross-entropy (T4.6) with a
# full-softmax taper (T5.5) as quality runs, three 1-GPU rank-slice processes sharing the GPU (their
# times mean nothing; main reserves ~37.5 GB eager with the tail EMA, so four lanes would not fit).
# Every lane CUDA_GRAPHS=0, SEEDS=1,2,3. Without a taper the sampled arm was measured on 2026-11-27
# (+0.0171 val, T4.6).
#   lane 1: main (the full softmax throughout)
#   lane 2: TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0 (the full softmax over the last 8 %)
#   lane 3: TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=14336,20480,24576,0,0 (larger budgets in stages 1-2 too)
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
export CUDA_GRAPHS=0 CUDA_VISIBLE_DEVICES=0 SEEDS=1,2,3

note "three lanes on one GPU: main / sampled+taper / larger budgets+taper (3 seeds each)"
( RUN_ID=main LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
  note "main rc=$?" ) &
( RUN_ID=sampled_taper TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0 LOG_DIR=$L \
      python train_gpt.py > $L/sampled_taper.out 2>&1
  note "sampled+taper rc=$?" ) &
( RUN_ID=larger_taper TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=14336,20480,24576,0,0 LOG_DIR=$L \
      python train_gpt.py > $L/larger_taper.out 2>&1
  note "larger budgets+taper rc=$?" ) &
wait
python records/tool.py ablation $L/main_s*.txt $L/sampled_taper_s*.txt $L/larger_taper_s*.txt \
    > $L/ablation.md 2>&1
note "ablation rc=$?"
