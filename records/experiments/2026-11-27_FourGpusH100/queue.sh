#!/usr/bin/env bash
# Issue #49 on one 4-GPU host (nvidia-h100-x4), run by bench/lease.sh start (proxy shards 1-3), most
# important first, so that a lease that ends early still answers the bar's first parts:
#   1. equivalence: 4 GPUs at full batch against 1 GPU (accumulation 8), STOP_AFTER=100
#      TRAIN_LOSS_EVERY=1, with a repeat pair of 1-GPU runs as the noise floor (the pair runs at
#      the same time on GPUs 0 and 1: losses only, never timed that way)
#   2. time: full batch on 4 GPUs against rank-slice on 1 GPU of the same host, one seed each, alone
#   3. exposed communication per stage: profile_comm --share 8 at 4 ranks against 1 rank
export RANK_SLICE=0
nvidia-smi topo -m > $L/topo.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $L/gpus.txt 2>&1
EQ="STOP_AFTER=100 TRAIN_LOSS_EVERY=1 SEED=1 LOG_DIR=$L"
note "equivalence: 4 GPUs"
env $EQ RUN_ID=eq_four torchrun --standalone --nproc_per_node=4 train_gpt.py > $L/eq_four.out 2>&1
note "eq_four rc=$?"
env $EQ RUN_ID=eq_one_a CUDA_VISIBLE_DEVICES=0 python train_gpt.py > $L/eq_one_a.out 2>&1 &
env $EQ RUN_ID=eq_one_b CUDA_VISIBLE_DEVICES=1 python train_gpt.py > $L/eq_one_b.out 2>&1 &
wait
note "eq_one pair done"
python records/tool.py compare --noise $L/eq_one_a.txt $L/eq_one_b.txt $L/eq_one_a.txt $L/eq_four.txt \
    > $L/equivalence.md 2>&1
note "compare rc=$?"
RUN_ID=full_four SEED=1 LOG_DIR=$L torchrun --standalone --nproc_per_node=4 train_gpt.py > $L/full_four.out 2>&1
note "full_four rc=$?"
RUN_ID=slice_one SEED=1 RANK_SLICE=1 CUDA_VISIBLE_DEVICES=0 LOG_DIR=$L python train_gpt.py > $L/slice_one.out 2>&1
note "slice_one rc=$?"
mkdir -p $L/share8_four $L/share8_one
torchrun --standalone --nproc_per_node=4 bench/profile_comm.py --share 8 --out $L/share8_four > $L/share8_four.out 2>&1
note "share8 four rc=$?"
CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc_per_node=1 bench/profile_comm.py --share 8 --out $L/share8_one \
    > $L/share8_one.out 2>&1
note "share8 one rc=$?"
