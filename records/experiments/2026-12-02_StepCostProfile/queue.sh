#!/usr/bin/env bash
# Issue #78 item 1 on one H200: where a graphed step's GPU time goes in each stage, main's defaults (step graphs,
# FA4, rank-slice, proxy train shards 1-5). bench/profile_stages.py captures each stage's two graphs (Adam and
# non-Adam step) as the warm-up does, then profiles their replays; --traces keeps the Chrome traces. Compare its
# table.md with record #92's kernel groups in ../shared/BENCH.md (stages 2 and 3: steps 450 and 800). About 10
# minutes held with cold compile caches.
need_shards 1 2 3 4 5
watch_gpus 60
mkdir -p "$L/prof"
check 0 profile 900 python bench/profile_stages.py --stages 1,2,3 --steps 6 --verbose --out "$L/prof"
cp "$L/prof/table.md" "$L/table.md" 2>/dev/null
pack_cache
