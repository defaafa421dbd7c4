#!/usr/bin/env bash
# A 4-GPU lease (nvidia-h100-x4 or nvidia-h200-x4; ~27 minutes with staging). The GPUs of one host
# ran a few % apart in clock on 2026-11-27 (../2026-11-27_FourGpuLevers), so every time here is
# compared on its own GPU: two arms one after the other, SEEDS=1,2,3 each, rank-slice, proxy.
#   GPU 0: main (narrow Q/K and the optimizer graphs now default)  then CUDA_GRAPHS=0 NGRAM_ROWS=1000000:
#          the n-gram table's second dose (T3.19, issue #48; loss against main, time against GPU 2's eager)
#   GPU 1: MUON_RAILS=1  then main: the rails' cost on one GPU (T2.9, issue #48); main again
#          beside GPU 0's gives the two GPUs' offset
#   GPU 2: CUDA_GRAPHS=0  then CUDA_GRAPHS=0 NGRAM_ROWS=3900000: the hashed n-gram table at the most
#          rank-slice holds (T3.19, issue #48; its loads run outside the step graphs)
#   GPU 3: the sampled CE with its inclusion correction and the taper (T4.7, T4.6, T5.5; issue #51),
#          then the GPU tests of what changed since the last lease (narrow by default, the step
#          graphs with the optimizer graphs by default, VALUE_EMBED_SPARSE's compiled run, the
#          corrected sampled CE's kernel), each under its own timeout
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv > $L/gpus.txt 2>&1
( while sleep 60; do nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
      >> $L/clocks.txt 2>&1; done ) &
clock_pid=$!

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

note "same-GPU pairs: main/n-gram 1M, rails/main, eager/n-gram 3.9M, corrected sampled CE + checks"
( arm 0 main; arm 0 ngram1m CUDA_GRAPHS=0 NGRAM_ROWS=1000000 ) &
( arm 1 rails MUON_RAILS=1; arm 1 main_gpu1 ) &
( arm 2 eager CUDA_GRAPHS=0; arm 2 ngram CUDA_GRAPHS=0 NGRAM_ROWS=3900000 ) &
( arm 3 sampled_corrected SAMPLED_CE_CORRECTION=1 TAPER_FRACTION=0.08 STAGE_CE_CANDIDATES=10240,14336,24576,0,0
  check narrow_tests 240 python -m pytest -q -m gpu tests/model/test_narrow_qk.py
  check step_graph_tests 360 python -m pytest -q -m gpu tests/training/test_step_graphs.py
  check ve_sparse_test 240 python -m pytest -q -m gpu tests/optimizer/test_value_embed_sparse.py
  check sampled_ce_tests 180 python -m pytest -q -m gpu tests/kernels/test_sampled_cross_entropy.py ) &
wait -n; wait -n; wait -n; wait -n
kill $clock_pid 2>/dev/null
python records/tool.py ablation $L/main_s[123].txt $L/rails_s*.txt $L/sampled_corrected_s*.txt \
    > $L/ablation_graphs.md 2>&1
note "ablation (graphed arms against GPU 0's main) rc=$?"
python records/tool.py ablation $L/eager_s*.txt $L/ngram_s*.txt $L/ngram1m_s*.txt > $L/ablation_eager.md 2>&1
note "ablation (n-gram against eager) rc=$?"
