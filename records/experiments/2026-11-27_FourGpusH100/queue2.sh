#!/usr/bin/env bash
# Lease 3's shorter queue (19 minutes of device time left after lease 2's machine went back with the
# three 1-GPU repeats done and collected): #49's 4-GPU runs, led by one rank-slice run per #47 arm
# on GPUs 0-2 (the time baseline of the same machine, the first compiled runs of the graphed arms
# since the capture-order fix, and the compile cache the 4-rank runs then reuse) and the graphs' GPU
# tests on GPU 3. The equivalence is judged locally against lease 2's repeats.
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1
EQ="STOP_AFTER=100 TRAIN_LOSS_EVERY=1 SEED=1 RANK_SLICE=0 LOG_DIR=$L"

note "phase 1: one rank-slice run per arm on GPUs 0-2, the graphs' GPU tests on GPU 3"
( CUDA_VISIBLE_DEVICES=0 RUN_ID=eager CUDA_GRAPHS=0 SEED=1 LOG_DIR=$L python train_gpt.py > $L/eager.out 2>&1
  note "eager (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 RUN_ID=graphs SEED=1 LOG_DIR=$L python train_gpt.py > $L/graphs.out 2>&1
  note "graphs (GPU1) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=2 RUN_ID=optgraphs OPTIMIZER_GRAPHS=1 SEED=1 LOG_DIR=$L python train_gpt.py \
    > $L/optgraphs.out 2>&1
  note "optgraphs (GPU2) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=3 timeout 480 python -m pytest -q -m gpu tests/training/test_step_graphs.py > $L/gpu_tests.out 2>&1
  note "gpu tests (GPU3) rc=$?" ) &
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
four full_four SEED=1 RANK_SLICE=0
mkdir -p $L/share8_four
RANK_SLICE=0 torchrun --standalone --nproc_per_node=4 bench/profile_comm.py --share 8 --out $L/share8_four > $L/share8_four.out 2>&1
note "share8 four rc=$?"
