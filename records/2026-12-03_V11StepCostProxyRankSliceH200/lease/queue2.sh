#!/usr/bin/env bash
# CeLaunch lease 2 (README "Lease 2"): issue #78's bar with main as it is (CE_LAUNCH from lease 1's sweep, the dy
# amax as before), in two arms that differ only in the taper's cross-entropy:
# - v78e: v78's settings with the taper on 24,576 sampled candidates (record #92's budget from 80 % of its run;
#   the extension keeps the full softmax), the record candidate;
# - v78d: v78's settings as lease 1 ran them (the taper on the full softmax), the taper change's off arm.
# Order, most needed first (the device budget may cut the tail):
# 1. b7ec: 7ec2b2e's train_gpt.py with its defaults (the bar's baseline, staged as /tmp/stage/base_7ec2b2e.py: `git
#    show 7ec2b2e:train_gpt.py`), 3 seeds, GPU_MEMORY_GIB=77, while this tree's train_gpt.py compiles v78e's graphs
#    beside its warm-up (compile_beside, 52 GiB; killed when b7ec's warm-up ends, before any timed step).
# 2. Inductor's generated code of the graphs holding the FP8 MLP backward, as .txt files under $L/inductor_code.
# 3. v78e, 3 seeds; the cross-entropy's and MLP's GPU tests; v78d, 3 seeds (only the taper's graphs recompile);
#    v78e's stage-3 profile (bench/profile_stages.py, 6 graphed steps).
# Each timed arm alone on the GPU, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz
# proxy_val_000000.bin.xz').
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
SHAPE="NUM_SCHEDULED_ITERATIONS=1350 STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072"
TAPER_SAMPLED="STAGE_CE_CANDIDATES=10240,10240,14336,24576,0"
TAPER_FULL="STAGE_CE_CANDIDATES=10240,10240,14336,0,0"
# shellcheck disable=SC2086
( export $SHAPE $TAPER_SAMPLED; compile_beside v78e_compile 52 train_gpt.py b7ec )
ARM_FILE=/tmp/stage/base_7ec2b2e.py arm 0 b7ec GPU_MEMORY_GIB=77
stop_beside v78e_compile
mkdir -p "$L/inductor_code"
grep -rl --include='*.py' "fp8_mlp_backward_products" "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null | head -n 20 \
    | while read -r f; do cp "$f" "$L/inductor_code/$(basename "$f").txt"; done
note "inductor_code: $(ls "$L/inductor_code" | wc -l) files"
# shellcheck disable=SC2086
arm 0 v78e GPU_MEMORY_GIB=77 $SHAPE $TAPER_SAMPLED
check 0 gpu_tests 240 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_cross_entropy.py \
    tests/kernels/test_mlp.py
note "gpu tests: $(tail -n 1 "$L/gpu_tests.out")"
# shellcheck disable=SC2086
arm 0 v78d GPU_MEMORY_GIB=77 $SHAPE $TAPER_FULL
# shellcheck disable=SC2086
env $SHAPE $TAPER_SAMPLED timeout 300 python bench/profile_stages.py --stages 3 --steps 6 --verbose --out "$L/prof" \
    > "$L/profile.out" 2>&1
note "profile rc=$?"
