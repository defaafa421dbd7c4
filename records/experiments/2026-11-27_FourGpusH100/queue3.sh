#!/usr/bin/env bash
# The next 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4; ~22 minutes with staging), most important
# first: #47's and #51's A/Bs at three seeds per arm, then #49's exposed communication at an 8-rank
# share, then the profiles beside #49's full-batch loss check.
#   1. GPUs 0-2: CUDA_GRAPHS=0 / the step graphs / the step graphs with the fast paths that the
#      host-launch thresholds keep out of the small stages (FUSED_MLP_MIN_TOKENS=0: the fused and
#      e4m3 MLP in stage 1; FP8_QKV_MIN_TOKENS=0: e4m3 Q/K/V in stages 1-2), rank-slice, SEEDS=1,2,3
#      each. The thresholds were set against eager launches; a graph replay has no per-kernel host cost.
#      GPU 3: #51's sampled training CE at record #92's budgets (STAGE_CE_CANDIDATES=10240,14336,24576,0),
#      step graphs on, SEEDS=1,2,3: time and loss against GPU 1's arm.
#   2. profile_comm --share 8 at 4 ranks, alone on the host (each stage's step against 1 rank's)
#   3. side by side: profile_comm --share 8 at 1 rank (GPU 0), profile_stages --graphs both (GPU 1),
#      bench_head_dims then QK_ROPE_KERNEL's GPU tests and bench_qk_rope (T6.4; GPU 2), and on GPU 3 full_one: the full batch on one GPU (accumulation 8),
#      SEED=1, to step 760 (val at 250 / 500 / 750). Does it rise from step 500 on as lease 3's 4-GPU
#      full_four did (4.4818 / 4.3567 / 4.8935)? Both read shards 1-3 ten times over, so the same
#      curve says the rise is the data's. Its compile reuses step 1's cache (the same shapes).
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1

note "phase 1: eager / graphs / graphs+low thresholds / sampled CE on GPUs 0-3 (3 seeds each)"
( CUDA_VISIBLE_DEVICES=0 RUN_ID=eager CUDA_GRAPHS=0 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/eager.out 2>&1
  note "eager (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 RUN_ID=graphs SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/graphs.out 2>&1
  note "graphs (GPU1) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=2 RUN_ID=lowthresh FUSED_MLP_MIN_TOKENS=0 FP8_QKV_MIN_TOKENS=0 SEEDS=1,2,3 LOG_DIR=$L \
    python train_gpt.py > $L/lowthresh.out 2>&1
  note "lowthresh (GPU2) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=3 RUN_ID=sampled STAGE_CE_CANDIDATES=10240,14336,24576,0 SEEDS=1,2,3 LOG_DIR=$L \
    python train_gpt.py > $L/sampled.out 2>&1
  note "sampled (GPU3) rc=$?" ) &
wait

mkdir -p $L/share8_four $L/share8_one $L/profile
RANK_SLICE=0 torchrun --standalone --nproc_per_node=4 bench/profile_comm.py --share 8 --out $L/share8_four \
    > $L/share8_four.out 2>&1
note "share8 four rc=$?"
( CUDA_VISIBLE_DEVICES=0 RANK_SLICE=0 torchrun --standalone --nproc_per_node=1 bench/profile_comm.py --share 8 \
    --out $L/share8_one > $L/share8_one.out 2>&1; note "share8 one (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 python bench/profile_stages.py --graphs both --out $L/profile > $L/profile.out 2>&1
  note "profile_stages (GPU1) rc=$?"; cp $L/profile/table.md $L/profile_table.md 2>/dev/null ) &
( CUDA_VISIBLE_DEVICES=2 python bench/bench_head_dims.py > $L/head_dims.md 2>&1
  note "bench_head_dims (GPU2) rc=$?"
  CUDA_VISIBLE_DEVICES=2 timeout 400 python -m pytest -q -m gpu tests/kernels/test_qk_rope_kernels.py > $L/qk_rope_tests.out 2>&1
  note "qk_rope gpu tests (GPU2) rc=$?"
  CUDA_VISIBLE_DEVICES=2 python bench/bench_qk_rope.py --launch 16x4,64x8 > $L/qk_rope.md 2>&1
  note "bench_qk_rope (GPU2) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=3 RUN_ID=full_one RANK_SLICE=0 SEED=1 STOP_AFTER=760 LOG_DIR=$L python train_gpt.py \
    > $L/full_one.out 2>&1
  note "full_one (GPU3) rc=$?" ) &
wait
