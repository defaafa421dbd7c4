#!/usr/bin/env bash
# T6.6 on and off, for a lease too short for queue.sh's arms (staging plus both warm-ups and six timed runs need the
# whole 30 minutes): first T6.6's GPU tests (noted), then bench/profile_stages.py at v78's step shape (stages 1-3,
# 6 graphed steps each) of `pre` (82c54c0's train_gpt.py, the code of v78 before T6.6, staged as
# /tmp/stage/pre_t66_82c54c0.py: `git show 82c54c0:train_gpt.py`) and `t66` (the working copy), one after the other
# in their own processes: wall ms/step and kernel groups per stage, then bench_value_embeds.py where time is left.
# Proxy train shards 1-5 staged as for queue.sh.
need_shards 1 2 3 4 5
watch_gpus 60
[ -f /tmp/stage/pre_t66_82c54c0.py ] || { note "no /tmp/stage/pre_t66_82c54c0.py"; exit 1; }
check 0 gpu_tests 420 python -m pytest -q -m gpu tests/kernels/test_token_rows.py -p no:cacheprovider
note "T6.6 GPU tests: $(tail -n 1 "$L/gpu_tests.out")"  # pytest -q's last line; a record needs them passed
SHAPE="NUM_SCHEDULED_ITERATIONS=1350 STAGE_CE_CANDIDATES=10240,10240,14336,0,0"
SHAPE="$SHAPE STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072"
# shellcheck disable=SC2086
env $SHAPE timeout 780 python bench/profile_stages.py pre=/tmp/stage/pre_t66_82c54c0.py t66=train_gpt.py \
    --stages 1,2,3 --steps 6 --verbose --out "$L/prof" > "$L/profile.out" 2>&1
note "profile rc=$?"
cp "$L/prof/table.md" "$L/profile_table.md" 2>/dev/null
cp "$L/prof/kernels.csv" "$L/profile_kernels.csv" 2>/dev/null
check 0 bench_value_embeds 240 python bench/bench_value_embeds.py --tokens 16384,49152
