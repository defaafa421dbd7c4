#!/usr/bin/env bash
# One 4-GPU lease (nvidia-h100-x4) for issues #49 and #47, run by bench/lease.sh start (proxy shards
# 1-3), most important first, so that a lease that ends early still answers the bars' first parts.
#   1. #47: graphs (the default) against CUDA_GRAPHS=0, rank-slice, 3 seeds per arm, one process per
#      GPU at a time: seeds 1,2 on GPUs 0 (graphs) and 1 (eager), seed 3 on GPUs 2 and 3; then GPUs
#      0, 2 and 3 run three 1-GPU repeats for the equivalence (#49; full batch, accumulation 8)
#   2. #49 equivalence: 4 GPUs at full batch, STOP_AFTER=100 TRAIN_LOSS_EVERY=1, against the three
#      repeats' pairwise differences (one pair of lease 1 was too thin a noise floor)
#   3. #49 time: full batch on 4 GPUs (alone on the host), against the rank-slice runs of step 1
#   4. #49 exposed communication: profile_comm --share 8 at 4 ranks; then, side by side on GPUs 0 and
#      1, profile_comm --share 8 at 1 rank and #47's profile_stages --graphs both
# A 4-rank run that stops (a graph check that fails on some rank stops them all) is rerun with
# CUDA_GRAPHS=0, so that #49's answers do not hang on #47's.
nvidia-smi topo -m > $L/topo.txt 2>&1
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1
EQ="STOP_AFTER=100 TRAIN_LOSS_EVERY=1 SEED=1 RANK_SLICE=0 LOG_DIR=$L"

note "phase 1: graphs/eager seeds on GPUs 0-3"
( CUDA_VISIBLE_DEVICES=0 RUN_ID=graphs SEEDS=1,2 LOG_DIR=$L python train_gpt.py > $L/graphs_12.out 2>&1
  note "graphs s1,s2 (GPU0) rc=$?"
  env $EQ RUN_ID=eq_one_c CUDA_VISIBLE_DEVICES=0 python train_gpt.py > $L/eq_one_c.out 2>&1
  note "eq_one_c (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 RUN_ID=eager CUDA_GRAPHS=0 SEEDS=1,2 LOG_DIR=$L python train_gpt.py > $L/eager_12.out 2>&1
  note "eager s1,s2 (GPU1) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=2 RUN_ID=graphs SEEDS=3 LOG_DIR=$L python train_gpt.py > $L/graphs_3.out 2>&1
  note "graphs s3 (GPU2) rc=$?"
  env $EQ RUN_ID=eq_one_a CUDA_VISIBLE_DEVICES=2 python train_gpt.py > $L/eq_one_a.out 2>&1
  note "eq_one_a (GPU2) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=3 RUN_ID=eager CUDA_GRAPHS=0 SEEDS=3 LOG_DIR=$L python train_gpt.py > $L/eager_3.out 2>&1
  note "eager s3 (GPU3) rc=$?"
  env $EQ RUN_ID=eq_one_b CUDA_VISIBLE_DEVICES=3 python train_gpt.py > $L/eq_one_b.out 2>&1
  note "eq_one_b (GPU3) rc=$?" ) &
wait

four() {  # four RUN_ID ARGS...: a 4-rank train_gpt.py run, rerun with CUDA_GRAPHS=0 if it fails
    local id=$1; shift
    env "$@" RUN_ID=$id LOG_DIR=$L torchrun --standalone --nproc_per_node=4 train_gpt.py > $L/$id.out 2>&1
    local rc=$?
    note "$id rc=$rc"
    if [ $rc != 0 ]; then
        env "$@" RUN_ID=${id}_nographs CUDA_GRAPHS=0 LOG_DIR=$L torchrun --standalone --nproc_per_node=4 train_gpt.py \
            > $L/${id}_nographs.out 2>&1
        note "${id}_nographs rc=$?"
    fi
}
four eq_four $EQ
EQ_FOUR=$L/eq_four.txt; [ -s $L/eq_four_nographs.txt ] && EQ_FOUR=$L/eq_four_nographs.txt
python records/tool.py compare $L/eq_one_a.txt $EQ_FOUR --noise $L/eq_one_a.txt $L/eq_one_b.txt \
    --noise $L/eq_one_a.txt $L/eq_one_c.txt --noise $L/eq_one_b.txt $L/eq_one_c.txt > $L/equivalence.md 2>&1
note "compare rc=$?"
four full_four SEED=1 RANK_SLICE=0

mkdir -p $L/share8_four $L/share8_one $L/profile
RANK_SLICE=0 torchrun --standalone --nproc_per_node=4 bench/profile_comm.py --share 8 --out $L/share8_four > $L/share8_four.out 2>&1
note "share8 four rc=$?"
( CUDA_VISIBLE_DEVICES=0 RANK_SLICE=0 torchrun --standalone --nproc_per_node=1 bench/profile_comm.py --share 8 \
    --out $L/share8_one > $L/share8_one.out 2>&1; note "share8 one (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 python bench/profile_stages.py --graphs both --out $L/profile > $L/profile.out 2>&1
  note "profile_stages (GPU1) rc=$?"; cp $L/profile/table.md $L/profile_table.md 2>/dev/null ) &
wait
