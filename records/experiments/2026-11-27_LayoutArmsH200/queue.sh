#!/usr/bin/env bash
# One H200 (nvidia-h200, ~25 minutes with staging): #51's layout arms and #48's tail EMA as quality
# runs, four 1-GPU rank-slice processes sharing the GPU (their times mean nothing; the baseline is
# ../2026-11-27_FourGpusH100's lease 4 main, CUDA_GRAPHS=0, same default math, same card type).
# Every arm CUDA_GRAPHS=0 (36 GB reserved each, where graphs reserve 86 GB), SEEDS=1,2,3.
#   lane 1: the narrow model's gpu test, then NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 if it passed (T3.18)
#   lane 2: ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10 (T3.1, record #92's cut)
#   lane 3: the cut with NARROW_QK_LAYERS=0,1,2,5,7,8 (once lane 1's test passed)
#   lane 4: TAIL_EMA_STEPS=300 (T5.4)
#   beside them: the QK-norm + rotary kernels' gpu tests (correctness only; small)
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
export CUDA_GRAPHS=0 CUDA_VISIBLE_DEVICES=0
NARROW=0,1,2,4,5,7,8,9
CUT="ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10"

note "four lanes on one GPU: narrow / cut / cut+narrow / tail EMA (3 seeds each)"
( timeout 480 python -m pytest -q -m gpu tests/model/test_narrow_qk.py > $L/narrow_gpu_test.out 2>&1
  tests=$?; note "narrow gpu test rc=$tests"; echo $tests > $L/narrow_gpu_test.rc
  [ $tests -eq 0 ] || exit 1
  RUN_ID=narrow NARROW_QK_LAYERS=$NARROW SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/narrow.out 2>&1
  note "narrow rc=$?" ) &
( RUN_ID=cut env $CUT SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/cut.out 2>&1
  note "cut rc=$?" ) &
( while [ ! -f $L/narrow_gpu_test.rc ]; do sleep 5; done
  [ "$(cat $L/narrow_gpu_test.rc)" = 0 ] || { note "cut+narrow: skipped, the narrow gpu test failed"; exit 1; }
  RUN_ID=cut_narrow env $CUT NARROW_QK_LAYERS=0,1,2,5,7,8 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py \
      > $L/cut_narrow.out 2>&1
  note "cut+narrow rc=$?" ) &
( RUN_ID=tail_ema TAIL_EMA_STEPS=300 SEEDS=1,2,3 LOG_DIR=$L python train_gpt.py > $L/tail_ema.out 2>&1
  note "tail EMA rc=$?" ) &
( timeout 420 python -m pytest -q -m gpu tests/kernels/test_qk_rope_kernels.py > $L/qk_rope_tests.out 2>&1
  note "qk_rope gpu tests rc=$?" ) &
wait
python records/tool.py ablation $L/narrow_s*.txt $L/cut_s*.txt $L/cut_narrow_s*.txt $L/tail_ema_s*.txt \
    > $L/ablation.md 2>&1
note "ablation rc=$?"
