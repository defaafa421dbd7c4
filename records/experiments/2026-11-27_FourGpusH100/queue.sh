#!/usr/bin/env bash
# One 4-GPU lease (nvidia-h100-x4) for issues #49 and #47, run by bench/lease.sh start (proxy shards
# 1-3), most important first, so that a lease that ends early still answers the bars' first parts.
#   1. #47: three arms side by side, one 1-GPU rank-slice process per GPU, SEEDS=1,2,3 each:
#      CUDA_GRAPHS=0 (GPU 0), the step's graphs (the default, GPU 1), the step's and the optimizer's
#      graphs (OPTIMIZER_GRAPHS=1, GPU 2); GPU 3 runs three 1-GPU repeats for the equivalence (#49;
#      full batch, accumulation 8; losses only)
#   2. #49 equivalence: 4 GPUs at full batch, STOP_AFTER=100 TRAIN_LOSS_EVERY=1, against the three
#      repeats' pairwise differences (one pair of lease 1 was too thin a noise floor)
#   3. #49 time: full batch on 4 GPUs (alone on the host), against the rank-slice runs of step 1
#   4. #49 exposed communication: profile_comm --share 8 at 4 ranks; then, side by side on GPUs 0-3,
#      profile_comm --share 8 at 1 rank, #47's profile_stages --graphs both, #51's bench_head_dims
#      (narrow attention's backward tiles) and the GPU tests of the graphs
# A 4-rank run that stops (a graph check that fails on some rank stops them all) is rerun with
# CUDA_GRAPHS=0, so that #49's answers do not hang on #47's.
nvidia-smi topo -m > $L/topo.txt 2>&1
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1
EQ="STOP_AFTER=100 TRAIN_LOSS_EVERY=1 SEED=1 RANK_SLICE=0 LOG_DIR=$L"

note "phase 1: eager / graphs / graphs+optimizer on GPUs 0-2, the repeats on GPU 3"
( CUDA_VISIBLE_DEVICES=0 RUN_ID=eager CUDA_GRAPHS=0 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/eager.out 2>&1
  note "eager (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 RUN_ID=graphs SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/graphs.out 2>&1
  note "graphs (GPU1) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=2 RUN_ID=optgraphs OPTIMIZER_GRAPHS=1 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py \
    > $L/optgraphs.out 2>&1
  note "optgraphs (GPU2) rc=$?" ) &
( for r in a b c; do
    env $EQ RUN_ID=eq_one_$r CUDA_VISIBLE_DEVICES=3 python train_gpt.py > $L/eq_one_$r.out 2>&1
    note "eq_one_$r (GPU3) rc=$?"
  done ) &
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
( CUDA_VISIBLE_DEVICES=2 python bench/bench_head_dims.py > $L/head_dims.md 2>&1
  note "bench_head_dims (GPU2) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=3 timeout 900 python -m pytest -q -m gpu tests/training/test_step_graphs.py \
    tests/tools/test_bench_head_dims.py > $L/gpu_tests.out 2>&1
  note "gpu tests (GPU3) rc=$?" ) &
wait
