#!/usr/bin/env bash
# Lease 1 of the CeLaunch plan (README): what the next step-cost changes need to know, no timed training.
# 1. The fused cross-entropy alone at v78's (tokens, row width) pairs, every launch: num_warps x persistent programs
#    an SM x the next row's loads ahead (softcap_ce's prefetch).
# 2. v78's stage-3 profile (bench/profile_stages.py, 6 graphed steps), then inductor's generated code of the graphs
#    holding the FP8 MLP backward (the fused rms-norm-backward + dy amax kernels, four of them at 0.41-0.52 ms a
#    step against 0.17 for their siblings) as .txt files under $L/inductor_code.
# Setup as queue.sh (proxy train shards 1-5 and FA4 staged; 7ec2b2e's file not needed).
need_shards 1 2 3 4 5
watch_gpus 60
SWEEP="--num-warps 4,8,16 --programs-per-sm 1,2,3 --prefetch 0,1 --skip-references --skip-lm-head --skip-transpose"
# shellcheck disable=SC2086
check 0 bench_ce_10240 300 python bench/bench_cross_entropy.py --tokens 16384,32768 --widths 10240 $SWEEP
# shellcheck disable=SC2086
check 0 bench_ce_14336 300 python bench/bench_cross_entropy.py --tokens 49152 --widths 14336 $SWEEP
SHAPE="NUM_SCHEDULED_ITERATIONS=1350 STAGE_CE_CANDIDATES=10240,10240,14336,0,0"
SHAPE="$SHAPE STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072"
# shellcheck disable=SC2086
env $SHAPE timeout 420 python bench/profile_stages.py --stages 3 --steps 6 --verbose --out "$L/prof" \
    > "$L/profile.out" 2>&1
note "profile rc=$?"
mkdir -p "$L/inductor_code"
grep -rl --include='*.py' "fp8_mlp_backward_products" "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null | head -n 20 \
    | while read -r f; do cp "$f" "$L/inductor_code/$(basename "$f").txt"; done
note "inductor_code: $(ls "$L/inductor_code" | wc -l) files"
