#!/usr/bin/env bash
# Issue #81 item 4, for nvidia-h200-x2 when it is lent (on -x4: --nproc_per_node=4 and GPUs 0,1,2,3): the n-gram
# table's exchange in fixed-size slots over NCCL, its loads captured in the step graphs; main's defaults.
#   1. 1 GPU vs 2 at 100 steps, full batch, the table on: three 1-GPU repeats (accumulation 8), one 2-GPU run;
#      `python records/tool.py compare --repeats` judges the 2-GPU losses against the repeats' spread.
#   2. bench/profile_comm.py --share 8 (each rank an 8-rank share) at 2 ranks against 1: the ratio per stage.
# About 25 minutes held with cold compile caches (the repeats after the first find them warm).
need_shards 1 2 3 4 5
watch_gpus 60
EQ="STOP_AFTER=100 TRAIN_LOSS_EVERY=1 SEED=1 RANK_SLICE=0"
check 0,1 eq_two 900 env $EQ RUN_ID=eq_two LOG_DIR=$L torchrun --standalone --nproc_per_node=2 train_gpt.py
for r in 1 2 3; do
    check 0 eq_one_r$r 900 env $EQ RUN_ID=eq_one_r$r LOG_DIR=$L python train_gpt.py
done
python records/tool.py compare "$L"/eq_two.txt --repeats "$L"/eq_one_r*.txt > "$L/equivalence.md" 2>&1
note "compare rc=$?"
mkdir -p "$L/comm_one" "$L/comm_two"
check 0 comm_one 600 torchrun --standalone --nproc_per_node=1 bench/profile_comm.py --share 8 --out "$L/comm_one"
check 0,1 comm_two 600 torchrun --standalone --nproc_per_node=2 bench/profile_comm.py --share 8 --out "$L/comm_two"
