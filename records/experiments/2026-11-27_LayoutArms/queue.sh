#!/usr/bin/env bash
# The next 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4; ~24 minutes with staging): #51's layout arms
# with three seeds each, one 1-GPU rank-slice process per GPU (times valid), then #48's n-gram dose
# curve as quality runs and the QK-norm + rotary backward bench.
#   0. GPU 1, before its arm: the narrow model's gpu-marked test. The narrow arms (GPUs 1 and 3) run only
#      if it passes.
#   1. GPU 0: main (step graphs, launch thresholds for eager forwards only), the baseline of every arm.
#      GPU 1: NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 (T3.18, record #92's narrow layers).
#      GPU 2: ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10 (T3.1, record #92's cut).
#      GPU 3: both: the cut, with the narrow layers that keep their attention (0,1,2,5,7,8).
#   2. GPUs 0-2: NGRAM_ROWS at three sizes (T3.19; CUDA_GRAPHS=0, which it needs), SEEDS=1,2,3 each,
#      quality only (its loss against phase 1's main; its time is eager's). GPU 3: the QK-norm + rotary
#      kernels' GPU tests, then bench_qk_rope with the backward's variants, alone on its GPU
#      (../2026-11-27_QkRopeBackward says what decides QK_ROPE_KERNEL).
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv > $L/gpus.txt 2>&1
NARROW=0,1,2,4,5,7,8,9
CUT="ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10"

note "phase 1: main / narrow / cut / cut+narrow on GPUs 0-3 (3 seeds each)"
( CUDA_VISIBLE_DEVICES=0 RUN_ID=main SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/main.out 2>&1
  note "main (GPU0) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 600 python -m pytest -q -m gpu tests/model/test_narrow_qk.py > $L/gpu_tests.out 2>&1
  tests=$?; note "gpu tests (GPU1) rc=$tests"; echo $tests > $L/gpu_tests.rc
  [ $tests -eq 0 ] || exit 1
  CUDA_VISIBLE_DEVICES=1 RUN_ID=narrow NARROW_QK_LAYERS=$NARROW SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py \
      > $L/narrow.out 2>&1
  note "narrow (GPU1) rc=$?" ) &
( CUDA_VISIBLE_DEVICES=2 RUN_ID=cut env $CUT SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/cut.out 2>&1
  note "cut (GPU2) rc=$?" ) &
( while [ ! -f $L/gpu_tests.rc ]; do sleep 5; done
  [ "$(cat $L/gpu_tests.rc)" = 0 ] || { note "cut+narrow (GPU3): skipped, GPU tests failed"; exit 1; }
  CUDA_VISIBLE_DEVICES=3 RUN_ID=cut_narrow env $CUT NARROW_QK_LAYERS=0,1,2,5,7,8 SEEDS=1,2,3 LOG_DIR=$L \
      python train_gpt.py > $L/cut_narrow.out 2>&1
  note "cut+narrow (GPU3) rc=$?" ) &
wait
python records/tool.py ablation $L/main_s*.txt $L/narrow_s*.txt $L/cut_s*.txt $L/cut_narrow_s*.txt \
    > $L/ablation.md 2>&1
note "phase 1 ablation rc=$?"

note "phase 2: n-gram dose curve (GPUs 0-2), bench_qk_rope (GPU 3)"
gpu=0
for rows in 377280 1500000 3900000; do
  ( CUDA_VISIBLE_DEVICES=$gpu RUN_ID=ngram$rows NGRAM_ROWS=$rows CUDA_GRAPHS=0 SEEDS=1,2,3 LOG_DIR=$L \
        python train_gpt.py > $L/ngram$rows.out 2>&1
    note "ngram $rows (GPU$gpu) rc=$?" ) &
  gpu=$((gpu + 1))
done
( CUDA_VISIBLE_DEVICES=3 timeout 600 python -m pytest -q -m gpu tests/kernels/test_qk_rope_kernels.py \
      > $L/qk_rope_tests.out 2>&1
  note "qk_rope gpu tests (GPU3) rc=$?"
  CUDA_VISIBLE_DEVICES=3 timeout 600 python bench/bench_qk_rope.py --tokens 49152,16384 \
      --backward-launch 16x4,32x8,64x8 > $L/qk_rope.md 2>&1
  note "bench_qk_rope (GPU3) rc=$?" ) &
wait
python records/tool.py ablation $L/main_s*.txt $L/ngram*_s*.txt > $L/ngram_ablation.md 2>&1
note "phase 2 ablation rc=$?"
