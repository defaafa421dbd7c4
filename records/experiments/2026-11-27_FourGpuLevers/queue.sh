#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4, else nvidia-h200-x4; ~25 minutes with staging): the levers merged
# without a GPU, each as a 1-GPU rank-slice process alone on its GPU (so its time counts, against main
# on GPU 0 of the same host), SEEDS=1,2,3 per arm, two waves per GPU (the second compiles on the
# first's caches). Issues #47 (optimizer graphs), #48 (rails, maps), #51 (FP8 backward, narrow Q/K,
# sampled CE with a full-softmax taper).
#   GPU 0: main (defaults: step graphs, tail EMA)        then OPTIMIZER_GRAPHS=1 (T5.3)
#   GPU 1: FP8_MLP_BACKWARD=1 (T6.5)                      then NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 (T3.18)
#   GPU 2: MUON_RAILS=1 (T2.9)                            then ORTHOGONALIZER=polar_express6_l1e3 (T2.3)
#   GPU 3: TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0 (T4.6 + T5.5)
#          then the GPU tests of FP8_MLP_BACKWARD, VALUE_EMBED_SPARSE, the quintic maps and the step
#          graphs with the tail EMA, and bench_mlp --fp8-backward (each with its own timeout and log)
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1

arm() {  # arm GPU NAME [VAR=VALUE ...]: one 3-seed process alone on GPU
    local gpu=$1 name=$2; shift 2
    env CUDA_VISIBLE_DEVICES=$gpu RUN_ID=$name SEEDS=1,2,3 LOG_DIR=$L "$@" python train_gpt.py > $L/$name.out 2>&1
    note "$name (GPU$gpu) rc=$?"
}
check() {  # check NAME SECONDS COMMAND...: on GPU 3, log to $L/NAME.out, note its rc
    local name=$1 seconds=$2; shift 2
    CUDA_VISIBLE_DEVICES=3 timeout "$seconds" "$@" > "$L/$name.out" 2>&1
    note "$name rc=$?"
}

note "wave 1: main / fp8 backward / rails / sampled CE + taper on GPUs 0-3"
( arm 0 main; arm 0 optimizer_graphs OPTIMIZER_GRAPHS=1 ) &
( arm 1 fp8_backward FP8_MLP_BACKWARD=1; arm 1 narrow NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 ) &
( arm 2 rails MUON_RAILS=1; arm 2 polar_express6 ORTHOGONALIZER=polar_express6_l1e3 ) &
( arm 3 sampled_taper TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0
  check fp8_backward_tests 420 python -m pytest -q -m gpu tests/kernels/test_mlp.py -k "fp8_backward or grad_fp8"
  check step_graph_tests 300 python -m pytest -q -m gpu tests/training/test_step_graphs.py
  check ve_sparse_test 300 python -m pytest -q -m gpu tests/optimizer/test_value_embed_sparse.py
  check orthogonalize_tests 300 python -m pytest -q -m gpu tests/kernels/test_kernels.py -k triton_orthogonalize
  check bench_fp8_backward 240 python bench/bench_mlp.py --fp8-backward --tokens 16384 49152 ) &
wait
python records/tool.py ablation $L/*_s[123].txt > $L/ablation.md 2>&1
note "ablation rc=$?"
