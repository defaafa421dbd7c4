#!/usr/bin/env bash
# Issue #78's bar with the fused cross-entropy's launch chosen per row width (README): `v78c` is main with the
# StepCostShape1365 queue's v78 settings (record #92's step shape at 1365 steps: STAGE_CE_CANDIDATES=10240,10240,
# 14336,0,0, STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072); `b7ec` is 7ec2b2e's train_gpt.py with its
# defaults (the bar's baseline, staged as /tmp/stage/base_7ec2b2e.py: `git show 7ec2b2e:train_gpt.py`). Each arm
# alone on the GPU for its timed steps, 3 seeds, rank-slice, proxy train shards 1-5 (setup: SHARDS=
# 'proxy_train_00000[1-5].bin.xz proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. 7ec2b2e compiles beside v78c's
# warm-up (compile_beside, 52 GiB; it runs out of memory only at the final validation's shapes, after which b7ec
# warms up in ~100 s). Last, inductor's generated code of the graphs holding the FP8 MLP backward's dy quantizations
# (the four fused rms-norm-backward + amax kernels at 0.41-0.52 ms each at stage 3 in v78's profile, against
# 0.17 ms for their siblings), as .txt files under $L/inductor_code.
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
compile_beside b7ec_compile 52 /tmp/stage/base_7ec2b2e.py v78c
SHAPE="NUM_SCHEDULED_ITERATIONS=1350 STAGE_CE_CANDIDATES=10240,10240,14336,0,0"
SHAPE="$SHAPE STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072"
# shellcheck disable=SC2086
arm 0 v78c GPU_MEMORY_GIB=77 $SHAPE
stop_beside b7ec_compile
ARM_FILE=/tmp/stage/base_7ec2b2e.py arm 0 b7ec GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/v78c_s*.txt "$L"/b7ec_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
mkdir -p "$L/inductor_code"
grep -rl --include='*.py' "fp8_mlp_backward_products" "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null | head -n 20 \
    | while read -r f; do cp "$f" "$L/inductor_code/$(basename "$f").txt"; done
note "inductor_code: $(ls "$L/inductor_code" | wc -l) files"
