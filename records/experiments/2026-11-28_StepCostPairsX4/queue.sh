#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4; ~25 minutes held with staging, under the 30-minute hold) of same-GPU
# pairs: each GPU runs two arms one after the other (the GPUs of one host run a few % apart in clock,
# ../2026-11-28_SameGpuPairs), SEEDS=1,2,3 each, rank-slice, proxy train shards 1-4 (setup:
#   SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
#   GPU 0: main, then QK_ROPE_KERNEL=1          (T6.4's kernels both ways, issue #51 item 3)
#   GPU 1: QK_ROPE_KERNEL=forward, then main    (the Triton forward with inductor's fused backward)
#   GPU 2: main, then CUDA_GRAPHS=0             (issue #47's bar: main <= 0.95x the eager step)
#   GPU 3: VALUE_EMBED_SPARSE=1, then main      (issue #51 item 5, under the step graphs)
# Then, if the hold leaves room, the QK-rope microbenchmark on GPU 0 (its values against float64 first).
# arm, check, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
note "same-GPU pairs: main/qk1, qkfwd/main, main/eager, vesparse/main"
( arm 0 main_g0; arm 0 qk1_g0 QK_ROPE_KERNEL=1 ) &
( arm 1 qkfwd_g1 QK_ROPE_KERNEL=forward; arm 1 main_g1 ) &
( arm 2 main_g2; arm 2 eager_g2 CUDA_GRAPHS=0 ) &
( arm 3 vesparse_g3 VALUE_EMBED_SPARSE=1; arm 3 main_g3 ) &
wait -n; wait -n; wait -n; wait -n
for pair in "0 main_g0 qk1_g0" "1 main_g1 qkfwd_g1" "2 main_g2 eager_g2" "3 main_g3 vesparse_g3"; do
    set -- $pair
    python records/tool.py ablation $L/$2_s*.txt $L/$3_s*.txt > $L/ablation_gpu$1.md 2>&1
    note "GPU$1 ablation ($3 against $2) rc=$?"
    python records/tool.py stages $L/$2_s*.txt $L/$3_s*.txt > $L/stages_gpu$1.md 2>&1
    note "GPU$1 stages rc=$?"
done
if [ "$SECONDS" -lt 1440 ]; then
    check 0 qk_rope_bench 150 python bench/bench_qk_rope.py --tokens 16384,49152
else
    note "qk_rope_bench skipped: ${SECONDS}s gone"
fi
