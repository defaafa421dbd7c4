#!/usr/bin/env bash
# Issue #78's bar again, with T6.6 (the token tables' gradients by rows). `v78t`: main with the StepCostShape1365
# queue's v78 settings (record #92's step shape at 1365 steps: STAGE_CE_CANDIDATES=10240,10240,14336,0,0,
# STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072); `b7ec`: 7ec2b2e's train_gpt.py with its defaults (the
# bar's baseline, staged as /tmp/stage/base_7ec2b2e.py: `git show 7ec2b2e:train_gpt.py`). Each arm alone on the GPU
# for its timed steps, 3 seeds, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz
# proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. No compile caches are assumed: 7ec2b2e compiles beside v78t's
# warm-up (compile_beside, 52 GiB; in StepCostShape1365's lease 1 it ran out of memory only at the final validation's
# shapes, after which b7ec warmed up in 115 s instead of ~6 minutes), and T6.6's GPU tests run beside too, killed,
# noted, if still alive when v78t's warm-up ends: no test or compile shares the GPU with a timed step.
# Their result is noted and the queue goes on either way; a record needs them passed. Last, bench_value_embeds.py
# (index_put against the kernel at stage 1's and stage 3's tokens), where the lease has time left.
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/base_7ec2b2e.py ] || { note "no /tmp/stage/base_7ec2b2e.py"; exit 1; }
compile_beside b7ec_compile 52 /tmp/stage/base_7ec2b2e.py v78t
CUDA_VISIBLE_DEVICES=0 setsid python -m pytest -q -m gpu tests/kernels/test_token_rows.py -p no:cacheprovider > "$L/gpu_tests.out" 2>&1 &
tests_pid=$!
note "gpu_tests beside v78t's compile (pid $tests_pid)"
( while kill -0 "$tests_pid" 2>/dev/null; do
      if grep -qs "Compile and warm-up took" "$L/v78t.out"; then
          kill -KILL -- -"$tests_pid" 2>/dev/null; note "gpu_tests KILLED: v78t's warm-up ended first"; break
      fi
      sleep 0.3
  done
  note "T6.6 GPU tests: $(tail -n 1 "$L/gpu_tests.out")" ) &  # pytest -q's last line; a record needs them passed
SHAPE="NUM_SCHEDULED_ITERATIONS=1350 STAGE_CE_CANDIDATES=10240,10240,14336,0,0"
SHAPE="$SHAPE STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072"
# shellcheck disable=SC2086
arm 0 v78t GPU_MEMORY_GIB=77 $SHAPE
stop_beside b7ec_compile
env CUDA_VISIBLE_DEVICES=0 RUN_ID=b7ec SEEDS=1,2,3 LOG_DIR="$L" GPU_MEMORY_GIB=77 python /tmp/stage/base_7ec2b2e.py \
    > "$L/b7ec.out" 2>&1
note "b7ec rc=$?"
python records/tool.py stages "$L"/v78t_s*.txt "$L"/b7ec_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
check 0 bench_value_embeds 240 python bench/bench_value_embeds.py --tokens 16384,49152
