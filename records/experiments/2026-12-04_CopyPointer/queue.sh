#!/usr/bin/env bash
# Issue #79 on one H200: the copy pointer (T4.8, COPY_POINTER=1; modded-nanogpt PR #379) at 12 % and 19 % fewer
# steps than main (PR #379 ran 1050 steps against #92's 1194), main's defaults as the same lease's baseline, then the
# pointer at main's step count if the lease has time left. The pointer's GPU tests run beside the first arm's cold
# compile (untimed; they end under their timeout before its timed steps start). Each arm alone on the GPU, 3 seeds;
# main's defaults otherwise, rank-slice, proxy train shards 1-5 (setup: SHARDS='proxy_train_00000[1-5].bin.xz
# proxy_val_000000.bin.xz'), GPU_MEMORY_GIB=77. About 27 minutes held with cold compile caches.
need_shards 1 2 3 4 5
watch_gpus 60
check 0 gpu_tests 240 python -m pytest -q -m gpu tests/model/test_copy_pointer.py -p no:cacheprovider &
tests=$!
arm 0 cplm1200 GPU_MEMORY_GIB=77 COPY_POINTER=1 NUM_SCHEDULED_ITERATIONS=1185
wait "$tests"
arm 0 cplm1100 GPU_MEMORY_GIB=77 COPY_POINTER=1 NUM_SCHEDULED_ITERATIONS=1085
arm 0 base GPU_MEMORY_GIB=77
python records/tool.py stages "$L"/cplm1200_s*.txt "$L"/cplm1100_s*.txt "$L"/base_s*.txt > "$L/stages.md" 2>&1
note "stages rc=$?"
arm 0 cplm GPU_MEMORY_GIB=77 COPY_POINTER=1
pack_cache  # for `bench/lease.sh pack-cache "$OUT"` if device time is left: the next lease then skips most of the cold compile
